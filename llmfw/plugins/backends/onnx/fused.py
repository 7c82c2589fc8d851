"""When a split's attention may run as ``GroupQueryAttention`` (com.microsoft), ONNX Runtime's fused kernel.

GQA keeps past and present K/V in one preallocated BNSH buffer ``[1, Hkv, n_cells, D]`` — the very memory of our
per-layer cache ``[Hkv, n_cells, D]`` — appends the ubatch's K/V at cells ``[P, P + T)`` and attends causally, each
query at position ``P + t`` seeing cells ``0 .. P + t`` (only the last ``local_window_size`` of them with a
window). One kernel per layer replaces the op-by-op translation's ~15 nodes (ScatterND, the cached prefix's
Slice copies, transposes, FusedMatMul, mask, Softmax, MatMul).

Our cache is a unified multi-sequence cell buffer with a mask, so GQA computes the same values only for a batch
whose cells are one contiguous run ``c0 .. c0 + T - 1`` and whose mask is exactly that causal pattern: a single
sequence laid out in cell order — every plain prompt and decode. :meth:`FusedAttentionPlan.fits` checks it on
each call's inputs; any other batch (several sequences, cells reused after ``seq_rm``, a window that wrapped
around its cells) runs the op-by-op translation, in a session of its own, over the same KV memory.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from llmfw.core.backend import Split
from llmfw.core.graph import Node

log = logging.getLogger(__name__)

F32 = np.float32


@dataclass(frozen=True)
class CausalRun:
    """The inputs that decide one KV cache's attention: ``kv_idx`` and ``kq_mask`` node ids, and the layers'
    sliding window (0 = none)."""

    kv_idx: int
    mask: int
    window: int


@dataclass(frozen=True)
class FusedAttentionPlan:
    """The causal runs a split's attention nodes read; :meth:`fits` says whether a call's batch is one of them."""

    runs: tuple[CausalRun, ...]

    def fits(self, inputs: Mapping[int, np.ndarray]) -> bool:
        return all(is_causal_run(inputs[run.kv_idx], inputs[run.mask], run.window) for run in self.runs)


def fused_attention_plan(split: Split) -> FusedAttentionPlan | None:
    """The plan of a split whose every attention GQA can express, else None (and why, at INFO: ``-v``)."""
    attentions = [n for n in split.nodes if n.op == "attention"]
    if not attentions:
        return None
    reason = _not_fusable(split, attentions)
    if reason:
        log.info("onnx: attention runs op by op (no GroupQueryAttention): %s", reason)
        return None
    runs = {CausalRun(n.inputs[3].id, n.inputs[4].id, _window(n)) for n in attentions}
    return FusedAttentionPlan(tuple(sorted(runs, key=lambda r: (r.kv_idx, r.mask))))


def _window(node: Node) -> int:
    """The attention's sliding window (the ``window`` attr; 0 = none)."""
    window = node.attrs.get("window", 0)
    return int(window) if isinstance(window, int) and window > 0 else 0


def _not_fusable(split: Split, attentions: list[Node]) -> str:
    """Why GQA cannot express the split's attention ('' when it can)."""
    if any(n.op == "k_shift" for n in split.nodes):
        return "the split also shifts K"
    inputs = set(split.input_ids)
    for node in attentions:
        q, k, v, kv_idx, mask = node.inputs
        if kv_idx.id not in inputs or mask.id not in inputs:
            return f"layer {node.attrs.get('layer')}: kv_idx / mask are computed in the split"
        if q.shape is None or k.shape is None or v.shape is None:
            return f"layer {node.attrs.get('layer')}: untyped q/k/v"
        if k.shape[2] != v.shape[2]:
            return f"layer {node.attrs.get('layer')}: K head size {k.shape[2]} differs from V's {v.shape[2]}"
        if len({mask.id for mask in (n.inputs[4] for n in attentions if n.inputs[3].id == kv_idx.id)}) != 1:
            return "one kv_idx with several masks"
    return ""


def is_causal_run(kv_idx: np.ndarray, mask: np.ndarray, window: int) -> bool:
    """Whether a ubatch writes cells ``c0 .. c0+T-1`` and token t sees exactly cells ``0 .. c0+t`` (the last
    ``window`` of them when windowed): what GroupQueryAttention computes with ``seqlens_k = c0 + T - 1``."""
    n_tokens = kv_idx.shape[0]
    if n_tokens == 0 or mask.ndim != 2 or mask.shape[0] != n_tokens:
        return False
    c0 = int(kv_idx[0])
    if c0 < 0 or c0 + n_tokens > mask.shape[1]:
        return False
    if n_tokens > 1 and not np.array_equal(kv_idx, np.arange(c0, c0 + n_tokens)):
        return False
    return np.array_equal(mask, causal_mask(c0, n_tokens, mask.shape[1], window))


def causal_mask(c0: int, n_tokens: int, n_kv: int, window: int) -> np.ndarray:
    """[T, n_kv]: 0 where token t (at cell c0 + t) sees cell j, -inf elsewhere."""
    cells = np.arange(n_kv)[None, :]
    position = (c0 + np.arange(n_tokens))[:, None]
    visible = cells <= position
    if window > 0:
        visible &= position - cells < window
    return np.where(visible, F32(0.0), F32(-np.inf)).astype(F32)
