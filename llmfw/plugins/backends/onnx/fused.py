"""When a split's attention may run as ``GroupQueryAttention`` (com.microsoft), ONNX Runtime's fused kernel.

GQA keeps past and present K/V in one preallocated BNSH buffer ``[1, Hkv, n_cells, D]`` — the very memory of our
per-layer cache ``[Hkv, n_cells, D]`` — appends the ubatch's K/V at cells ``[P, P + T)`` and attends causally, each
query at position ``P + t`` seeing cells ``0 .. P + t`` (only the last ``local_window_size`` of them with a
window). One kernel per layer replaces the op-by-op translation's ~15 nodes (ScatterND, the cached prefix's
Slice copies, transposes, FusedMatMul, mask, Softmax, MatMul).

When q and k are rotated by one rope over the whole head at the ubatch positions, GQA applies it itself
(``do_rotary``, cos/sin tables over the cache's cells), and when q, k, v are also slices of one fused QKV
matmul, that matmul's output is GQA's packed query: one kernel from the projection to the attention output.
GQA's rotary position of a token is its cell, so this also needs positions equal to cells (checked per call).

Our cache is a unified multi-sequence cell buffer with a mask, so GQA computes the same values only for a batch
whose cells are one contiguous run ``c0 .. c0 + T - 1`` and whose mask is exactly that causal pattern: a single
sequence laid out in cell order — every plain prompt and decode. :meth:`FusedAttentionPlan.fits` checks it on
each call's inputs; any other batch (several sequences, cells reused after ``seq_rm``, a window that wrapped
around its cells) runs the op-by-op translation, in a session of its own, over the same KV memory.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Mapping

import numpy as np

from llmfw.core.exec.backend import Split
from llmfw.core.ir.graph import Node
from llmfw.core.ir.ops import attention_extras

log = logging.getLogger(__name__)

F32 = np.float32
#: the bool graph input of a "switch" model: True runs GroupQueryAttention, False the op-by-op branch
USE_GQA = "use_gqa"
#: how a model computes attention: op by op, GroupQueryAttention only, or an If between the two per layer
AttentionForm = Literal["op", "gqa", "switch"]


@dataclass(frozen=True)
class CausalRun:
    """The inputs that decide one KV cache's attention: ``kv_idx`` and ``kq_mask`` node ids, and the layers'
    sliding window (0 = none)."""

    kv_idx: int
    mask: int
    window: int
    #: the ``pos`` input when an attention of this cache rotates inside GQA (positions must equal cells)
    positions: int | None = None


@dataclass(frozen=True)
class FusedAttentionPlan:
    """The causal runs a split's attention nodes read; :meth:`fits` says whether a call's batch is one of them."""

    runs: tuple[CausalRun, ...]

    def fits(self, inputs: Mapping[int, np.ndarray]) -> bool:
        return all(is_causal_run(inputs[run.kv_idx], inputs[run.mask], run.window)
                   and (run.positions is None or np.array_equal(inputs[run.positions], inputs[run.kv_idx]))
                   for run in self.runs)


def fused_attention_plan(split: Split, n_cells: Mapping[tuple[str, int], int]) -> FusedAttentionPlan | None:
    """The plan of a split whose every attention GQA can express, else None (and why, at INFO: ``-v``).
    ``n_cells``: the cells of each (cache, layer) KV storage (they bound the rotary tables)."""
    attentions = [n for n in split.nodes if n.op == "attention"]
    if not attentions:
        return None
    reason = _not_fusable(split, attentions)
    if reason:
        log.info("onnx: attention runs op by op (no GroupQueryAttention): %s", reason)
        return None
    runs: dict[tuple[int, int], CausalRun] = {}
    for node in attentions:
        rope = fusable_rope(node, n_cells.get((node.attr_str("cache"), node.attr_int("layer")), 0))
        run = runs.get((node.inputs[3].id, node.inputs[4].id))
        positions = rope.inputs[1].id if rope is not None else (run.positions if run else None)
        runs[(node.inputs[3].id, node.inputs[4].id)] = CausalRun(node.inputs[3].id, node.inputs[4].id,
                                                                 _window(node), positions)
    return FusedAttentionPlan(tuple(runs[key] for key in sorted(runs)))


def kv_cells(storage: object) -> int:
    """The cells of a layer's KV storage (0 for storage of another backend)."""
    k = getattr(storage, "k", None)
    return int(k.shape[1]) if isinstance(k, np.ndarray) and k.ndim == 3 else 0


#: the most cos/sin values of one rotary table GQA may read (rows = cells): 4 M floats, 16 MiB each
MAX_ROTARY_TABLE = 1 << 22


def fusable_rope(attention: Node, n_cells: int) -> Node | None:
    """The rope node of q when GQA can rotate q and k itself: both are one rope over the whole head with the
    same attrs, the positions input and factors, and the table over the cache's cells stays small."""
    q, k = attention.inputs[0], attention.inputs[1]
    if q.op != "rope" or k.op != "rope" or q.attrs != k.attrs or q.shape is None or k.shape is None:
        return None
    if [i.id for i in q.inputs[1:]] != [i.id for i in k.inputs[1:]] or q.inputs[1].op != "input":
        return None
    n_dims = q.attr_int("n_dims", 0)
    if n_dims != q.shape[2] or n_dims != k.shape[2] or not 0 < n_cells * n_dims // 2 <= MAX_ROTARY_TABLE:
        return None
    return q


def packed_qkv(q: Node, k: Node, v: Node) -> Node | None:
    """The fused QKV matmul whose output q, k, v are consecutive slices of (reshaped to heads): GQA then reads
    it as its packed query. None when they are not."""
    parts = []
    for node in (q, k, v):
        if node.op != "reshape" or node.inputs[0].op != "slice":
            return None
        parts.append(node.inputs[0])
    source = parts[0].inputs[0]
    if source.shape is None or len(source.shape) != 2:
        return None
    stop = 0
    for part in parts:
        if part.inputs[0] is not source or part.attrs.get("axis", -1) not in (-1, 1):
            return None
        start, end = part.attrs.get("start"), part.attrs.get("stop")
        if (start or 0) != stop or not isinstance(end, int):
            return None
        stop = end
    return source if stop == source.shape[1] else None


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
        q, k, v, kv_idx, mask = node.inputs[:5]
        if attention_extras(node.inputs)[1] is not None:
            return f"layer {node.attrs.get('layer')}: attention sinks (GroupQueryAttention has none here)"
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
    ``window`` of them when windowed), every other cell at -inf: what GroupQueryAttention computes with
    ``seqlens_k = c0 + T - 1``. Reads the mask row by row as booleans (no second mask-sized float array)."""
    n_tokens = kv_idx.shape[0]
    if n_tokens == 0 or mask.ndim != 2 or mask.shape[0] != n_tokens:
        return False
    c0, n_kv = int(kv_idx[0]), mask.shape[1]
    if c0 < 0 or c0 + n_tokens > n_kv:
        return False
    if n_tokens > 1 and not np.array_equal(kv_idx, np.arange(c0, c0 + n_tokens)):
        return False
    visible = mask == 0
    if not (visible | np.isneginf(mask)).all():
        return False
    last = c0 + np.arange(n_tokens)
    first = np.maximum(last - window + 1, 0) if window > 0 else np.zeros(n_tokens, dtype=np.int64)
    # each row's visible cells: exactly last - first + 1 of them, the first and the last where they must be,
    # none before the first or after the last (argmax finds the first True of a row)
    return bool((visible.sum(axis=1) == last - first + 1).all()
                and (visible.argmax(axis=1) == first).all()
                and (n_kv - 1 - visible[:, ::-1].argmax(axis=1) == last).all())


def causal_mask(c0: int, n_tokens: int, n_kv: int, window: int) -> np.ndarray:
    """[T, n_kv]: 0 where token t (at cell c0 + t) sees cell j, -inf elsewhere."""
    cells = np.arange(n_kv)[None, :]
    position = (c0 + np.arange(n_tokens))[:, None]
    visible = cells <= position
    if window > 0:
        visible &= position - cells < window
    return np.where(visible, F32(0.0), F32(-np.inf)).astype(F32)
