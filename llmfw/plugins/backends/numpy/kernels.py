"""The numpy backend's op kernels: pure functions of float32 numpy arrays (also the oracle that other backends'
tests compare against). Each computes what the graph op means (:mod:`llmfw.core.ir.graph`) the way ggml rounds it
where that is cheap (norms sum their squares in double)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

F32 = np.float32
F64 = np.float64

#: query rows per attention block: small enough that the block's scores stay in cache and that a causal
#: prefill skips most of its masked half, large enough that the per-block Python overhead stays small
ATTN_BLOCK_ROWS = 64


@dataclass
class NumpyKV:
    """K and V storage of one layer: ``[n_head_kv, n_cells, head_dim]`` (per-head slices are contiguous)."""

    k: np.ndarray
    v: np.ndarray


def rms_norm(x: np.ndarray, eps: float, weight: np.ndarray | None = None) -> np.ndarray:
    """``x / sqrt(mean(x²) + eps)`` (then ``* weight`` when given, rounded after the normalisation like ggml).

    ggml accumulates the sum of squares in double; a batched float64 matmul does the same and is much faster
    than ``einsum(..., dtype=float64)``."""
    n = x.shape[-1]
    if x.size == n:  # one row (a decode step): the scale in Python floats (doubles), 4 array ops in all
        row = x.reshape(n).astype(F64)
        out = x * F32(1.0 / math.sqrt(float(np.dot(row, row)) / n + eps))
    else:
        rows = x.reshape(-1, n).astype(F64)
        sum_sq = np.matmul(rows[:, None, :], rows[:, :, None]).reshape(x.shape[:-1] + (1,))
        sum_sq /= n
        sum_sq += eps
        np.sqrt(sum_sq, out=sum_sq)
        out = x * np.divide(1.0, sum_sq, out=sum_sq).astype(F32)
    if weight is not None:
        if weight.ndim == 1 and weight.dtype == F32 and weight.shape[0] == out.shape[-1]:
            out *= weight  # the common case: a per-channel norm weight, in place
        else:
            out = out * weight
    return out


def layer_norm(x: np.ndarray, eps: float, weight: np.ndarray | None = None) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps)`` over the last axis (then ``* weight`` when given)."""
    mean = np.mean(x, axis=-1, keepdims=True, dtype=np.float64).astype(F32)
    centered = x - mean
    var = np.mean(np.square(centered), axis=-1, keepdims=True, dtype=np.float64)
    out = (centered * (1.0 / np.sqrt(var + eps)).astype(F32)).astype(F32, copy=False)
    return out if weight is None else out * weight


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        out = np.negative(x)
        np.exp(out, out=out)
        out += F32(1.0)
        result: np.ndarray = np.divide(x, out, out=out)
        return result


def gelu(x: np.ndarray) -> np.ndarray:
    c = F32(math.sqrt(2.0 / math.pi))
    out: np.ndarray = F32(0.5) * x * (F32(1.0) + np.tanh(c * (x + F32(0.044715) * x * x * x)))
    return out


def rope_apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_dims: int, mode: str) -> np.ndarray:
    """Rotate the first n_dims of the last axis of x [T, H, D] (NORM: adjacent pairs, NEOX: halves)."""
    out = np.array(x, dtype=F32, copy=True)
    c = cos[:, None, :]
    s = sin[:, None, :]
    if mode == "neox":
        half = n_dims // 2
        x0 = x[..., :half]
        x1 = x[..., half:n_dims]
        out[..., :half] = x0 * c - x1 * s
        out[..., half:n_dims] = x0 * s + x1 * c
    else:
        x0 = x[..., 0:n_dims:2]
        x1 = x[..., 1:n_dims:2]
        out[..., 0:n_dims:2] = x0 * c - x1 * s
        out[..., 1:n_dims:2] = x0 * s + x1 * c
    return out


@dataclass
class RopeTable:
    """Per-run rotation factors for :func:`rope_apply_full`: ``x·C + partner(x)·S`` over the whole last axis.

    ``C`` repeats cos for both members of a pair; ``S`` is ``-sin`` for the first member and ``+sin`` for the
    second, so ``x0·c + x1·(-s)`` equals ``rope_apply``'s ``x0·c - x1·s`` bit for bit (and ``x1·c + x0·s`` its
    ``x0·s + x1·c``: float addition commutes)."""

    cos: np.ndarray
    sin: np.ndarray
    full_c: np.ndarray  # [T, 1, n_dims]
    full_s: np.ndarray  # [T, 1, n_dims]


def rope_table(cos: np.ndarray, sin: np.ndarray, mode: str) -> RopeTable:
    if mode == "neox":
        full_c = np.concatenate([cos, cos], axis=-1)
        full_s = np.concatenate([-sin, sin], axis=-1)
    else:
        full_c = np.repeat(cos, 2, axis=-1)
        full_s = np.stack([-sin, sin], axis=-1).reshape(cos.shape[0], -1)
    return RopeTable(cos, sin, full_c[:, None, :], full_s[:, None, :])


def rope_apply_full(x: np.ndarray, table: RopeTable, n_dims: int, mode: str) -> np.ndarray:
    """:func:`rope_apply` in 5 array operations instead of ~10 when every dimension rotates (n_dims == D)."""
    if n_dims != x.shape[-1]:
        return rope_apply(x, table.cos, table.sin, n_dims, mode)
    if mode == "neox":
        half = n_dims // 2
        partner = np.empty(x.shape, dtype=F32)
        partner[..., :half] = x[..., half:]
        partner[..., half:] = x[..., :half]
    else:
        # a copy (np.array), never a view of x: it is scaled in place below
        partner = np.array(x.reshape(x.shape[:-1] + (n_dims // 2, 2))[..., ::-1], dtype=F32).reshape(x.shape)
    out: np.ndarray = np.multiply(x, table.full_c, dtype=F32)
    partner *= table.full_s
    out += partner
    return out


def visible_limits(mask: np.ndarray, block: int = ATTN_BLOCK_ROWS) -> list[tuple[int, int, int]]:
    """``(row_start, row_stop, n_cols)`` per block of mask rows: cells at or past ``n_cols`` are hidden (-inf)
    from every row of the block, so attention may skip them (at least one column is kept, so that a fully
    masked row still gives NaN like the full computation)."""
    n_tokens, n_kv = mask.shape
    visible_cols = np.isfinite(mask)
    limits = []
    for start in range(0, n_tokens, block):
        stop = min(start + block, n_tokens)
        any_visible = visible_cols[start:stop].any(axis=0)
        last = int(np.flatnonzero(any_visible)[-1]) + 1 if any_visible.any() else 1
        limits.append((start, stop, min(max(last, 1), n_kv)))
    return limits


def attention(q: np.ndarray, kv: NumpyKV, n_kv: int, mask: np.ndarray, scale: float,
              softcap: float, limits: list[tuple[int, int, int]] | None = None,
              sinks: np.ndarray | None = None) -> np.ndarray:
    """softmax(softcap(scale·q·Kᵀ) + mask)·V over cells 0..n_kv-1, GQA by head groups → [T, H*Dv].

    ``limits`` (from :func:`visible_limits` of ``mask``; computed when omitted) lets each block of query rows
    skip the cells none of its rows can see. ``sinks`` [H]: per-head logits that only add to the denominator."""
    n_tokens, n_head, _ = q.shape
    dv = kv.v.shape[-1]
    if limits is None:
        limits = visible_limits(mask[:, :n_kv])
    # the scale is applied to q (small) rather than to the scores (large): the same product up to rounding
    q = np.multiply(q, F32(scale), dtype=F32)
    if n_tokens == 1:
        return _attention_block(q, kv, limits[0][2], mask, softcap, sinks).reshape(1, n_head * dv)
    out = np.empty((n_tokens, n_head * dv), dtype=F32)
    for start, stop, n_cols in limits:
        out[start:stop] = _attention_block(q[start:stop], kv, n_cols, mask[start:stop], softcap, sinks)
    return out


def _attention_block(q: np.ndarray, kv: NumpyKV, n_cols: int, mask: np.ndarray, softcap: float,
                     sinks: np.ndarray | None = None) -> np.ndarray:
    """Attention of the (already scaled) query rows ``q`` [t, H, Dk] over cache cells ``0..n_cols-1`` → [t, H*Dv]."""
    n_tokens, n_head, _ = q.shape
    qg = group_queries(q, kv.k.shape[0])
    scores = np.matmul(qg, kv.k[:, :n_cols].transpose(0, 2, 1))  # [Hkv, G*t, n]
    sink_terms = masked_exp(scores, mask[:, :n_cols], softcap, n_tokens, sinks)
    denominators = scores.sum(axis=-1, keepdims=True)
    if sink_terms is not None:
        denominators += sink_terms
    out = np.matmul(scores, kv.v[:, :n_cols])  # [Hkv, G*t, Dv]
    out /= denominators  # normalise after the product: Dv columns instead of n_kv
    return ungroup_heads(out, n_tokens)


def group_queries(q: np.ndarray, n_head_kv: int) -> np.ndarray:
    """[t, H, D] → [Hkv, G*t, D]: each KV head becomes one matmul over all its query heads and tokens (a free
    reshape for one token)."""
    n_tokens, n_head, head_dim = q.shape
    group = n_head // n_head_kv
    if n_tokens == 1:
        return q.reshape(n_head_kv, group, head_dim)
    grouped: np.ndarray = q.reshape(n_tokens, n_head_kv, group, head_dim).transpose(1, 2, 0, 3).reshape(
        n_head_kv, group * n_tokens, head_dim)
    return grouped


def ungroup_heads(out: np.ndarray, n_tokens: int) -> np.ndarray:
    """[Hkv, G*t, Dv] → [t, H*Dv], the inverse of :func:`group_queries`."""
    n_head_kv, rows, dv = out.shape
    if n_tokens == 1:
        return out.reshape(1, n_head_kv * rows * dv)
    heads: np.ndarray = out.reshape(n_head_kv, rows // n_tokens, n_tokens, dv).transpose(2, 0, 1, 3).reshape(
        n_tokens, -1)
    return heads


def masked_exp(scores: np.ndarray, mask: np.ndarray, softcap: float, n_tokens: int,
               sinks: np.ndarray | None = None) -> np.ndarray | None:
    """In place: ``exp(softcap(scores) + mask - rowmax)`` — the unnormalised softmax of grouped scores
    [Hkv, G*t, n] under the mask [t, n]. With ``sinks`` [H] the row maximum includes the head's sink and the
    sink's own term ``exp(sink - max)`` [Hkv, G*t, 1] is returned (it belongs to the denominator only)."""
    if softcap:
        scores /= F32(softcap)
        np.tanh(scores, out=scores)
        scores *= F32(softcap)
    n_head_kv, rows, n_cols = scores.shape
    scores4 = scores.reshape(n_head_kv, rows // n_tokens, n_tokens, n_cols)
    scores4 += mask
    peak = scores4.max(axis=-1, keepdims=True)
    if sinks is None:
        scores4 -= peak
        np.exp(scores, out=scores)
        return None
    sink4 = np.asarray(sinks, dtype=F32).reshape(n_head_kv, rows // n_tokens, 1, 1)
    peak = np.maximum(peak, sink4)
    scores4 -= peak
    np.exp(scores, out=scores)
    sink_terms: np.ndarray = np.exp(sink4 - peak).reshape(n_head_kv, rows, 1)
    return sink_terms


def write_kv(kv: NumpyKV, k: np.ndarray, v: np.ndarray, idx: np.ndarray) -> None:
    kv.k[:, idx, :] = k.transpose(1, 0, 2)
    kv.v[:, idx, :] = v.transpose(1, 0, 2)
