"""The torch backend's kernels for the ops that are more than one torch call: rope (ggml's angles), attention
over the static KV cache, K shift, exact quantized row lookups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmfw.core.arch.architecture import RopeParams
from llmfw.core.errors import ModelError
from llmfw.core.format.quants import dequantize_rows
from llmfw.core.ir.rope import rope_cos_sin as host_rope_cos_sin
from llmfw.plugins.backends.torch.environment import import_torch
from llmfw.plugins.backends.torch.weights import TorchWeight


def rope_cos_sin(pos: Any, p: RopeParams, freq_factors: Any = None) -> tuple[Any, Any]:
    """cos and sin [T, n_dims/2] of ggml_rope_ext's angles (YaRN ramp, freq factors, attention factor).

    Computed on the host once per graph run (shared by every layer), like ggml_rope_cache_init: the angle of pair
    i is ``pos * theta_scale**i`` built by repeated float32 products, then libm-accurate cos/sin, so positions in
    the thousands round exactly as llama.cpp's do (torch's cumprod and vectorised float32 cos/sin differ there
    by several ulps).
    """
    torch = import_torch()
    factors = None if freq_factors is None else freq_factors.detach().cpu().numpy()
    cos, sin = host_rope_cos_sin(pos.detach().cpu().numpy(), p.n_dims, p.freq_base, p.freq_scale, p.ext_factor,
                                 p.attn_factor, p.beta_fast, p.beta_slow, p.n_ctx_orig, factors)
    return torch.from_numpy(cos).to(pos.device), torch.from_numpy(sin).to(pos.device)


@dataclass
class RopeTables:
    """Per-graph-run rotation tables for one (positions, rope parameters) pair, shared by every layer:
    NORM keeps complex rotations [T, 1, n_dims/2] (a pair (x[2i], x[2i+1]) is one complex number), NEOX the
    cos / sin repeated over both halves [T, 1, n_dims]."""

    rotation: Any = None
    cos2: Any = None
    sin2: Any = None

    @classmethod
    def make(cls, cos: Any, sin: Any, neox: bool) -> "RopeTables":
        torch = import_torch()
        if neox:
            return cls(cos2=torch.cat((cos, cos), -1)[:, None, :], sin2=torch.cat((sin, sin), -1)[:, None, :])
        return cls(rotation=torch.complex(cos, sin)[:, None, :])


def rope_tables(pos: Any, p: RopeParams, freq_factors: Any = None) -> RopeTables:
    cos, sin = rope_cos_sin(pos, p, freq_factors)
    return RopeTables.make(cos, sin, p.mode == "neox")


def rope_apply(x: Any, tables: RopeTables, n_dims: int, neox: bool) -> Any:
    """Rotate x [T, H, D] by per-token angles; dimensions past n_dims pass through unchanged.

    NORM rotates adjacent pairs (x[2i], x[2i+1]): one complex multiplication on a complex view of x; NEOX
    rotates (x[i], x[i + n_dims/2]): ``x * cos + rotate_half(x) * sin``.
    """
    torch = import_torch()
    head_dim = x.shape[-1]
    rot = x if n_dims == head_dim else x[..., :n_dims]
    if neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.addcmul(rot * tables.cos2, torch.cat((-x2, x1), dim=-1), tables.sin2)
    else:
        pairs = rot.reshape(*rot.shape[:-1], n_dims // 2, 2)
        try:
            as_complex = torch.view_as_complex(pairs)
        except RuntimeError:  # a view whose strides complex numbers cannot follow
            as_complex = torch.view_as_complex(pairs.contiguous())
        out = torch.view_as_real(as_complex * tables.rotation).flatten(-2)
    if n_dims == head_dim:
        return out
    return torch.cat((out, x[..., n_dims:]), dim=-1)


@dataclass
class KVStorage:
    """One layer's static K and V cache [n_head_kv, n_cells, head_dim] (a cell's heads are one row each)."""

    k: Any
    v: Any


def grouped_mask(mask: Any, group: int) -> Any:
    """The [T, n_kv] mask repeated for ``group`` query heads per KV head: [group*T, n_kv] (see attention); made
    once per graph run and read by every layer of that run."""
    return mask if group == 1 else mask.repeat(group, 1)


def attention(q: Any, k: Any, v: Any, kv_idx: Any, mask_g: Any, kv: KVStorage, scale: float, softcap: float) -> Any:
    """The IR's attention: write k/v into cache rows ``kv_idx``, attend over cells ``0 .. n_kv-1``.

    GQA without repeating K/V: query heads are ordered ``h = g * group + j`` (KV head ``h // group``), so
    ``q.transpose(0, 1)`` [H, T, D] viewed as [H_kv, group*T, D] attends its KV head as one batch entry;
    ``mask_g`` is the [T, n_kv] mask repeated ``group`` times along its rows (:func:`grouped_mask`).
    """
    torch = import_torch()
    n_tokens, n_head, head_dim = q.shape
    n_head_kv = k.shape[1]
    group = n_head // n_head_kv
    kv.k.index_copy_(1, kv_idx, k.transpose(0, 1))
    kv.v.index_copy_(1, kv_idx, v.transpose(0, 1))
    n_kv = mask_g.shape[-1]
    keys = kv.k[:, :n_kv]
    values = kv.v[:, :n_kv]
    queries = q.transpose(0, 1).reshape(n_head_kv, group * n_tokens, head_dim)
    # baddbmm + softmax + bmm: measured faster on CPU than scaled_dot_product_attention with an additive mask
    # (which takes its unfused math path), ~2x for one-token decodes
    if softcap:
        scores = torch.bmm(queries, keys.transpose(1, 2)).mul_(scale / softcap)
        scores = torch.tanh_(scores).mul_(softcap).add_(mask_g)
    else:
        scores = torch.baddbmm(mask_g, queries, keys.transpose(1, 2), alpha=scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), values)
    head_dim_v = values.shape[-1]
    return out.reshape(n_head, n_tokens, head_dim_v).transpose(0, 1).reshape(n_tokens, n_head * head_dim_v)


def k_shift(shift: Any, freq_factors: Any, kv: KVStorage, p: RopeParams) -> Any:
    """Re-rotate cached keys of cells ``0 .. n_kv-1`` in place by ``shift`` positions (after ``seq_add``)."""
    torch = import_torch()
    n_kv = shift.shape[0]
    tables = rope_tables(shift, p, freq_factors)
    cached = kv.k[:, :n_kv].transpose(0, 1)  # [n_kv, Hkv, D] view
    kv.k[:, :n_kv].copy_(rope_apply(cached, tables, p.n_dims, p.mode == "neox").transpose(0, 1))
    return torch.zeros(0, dtype=torch.float32, device=shift.device)


def get_rows_raw(weight: TorchWeight, ids: Any) -> Any:
    """Exact rows of a quantized table (an embedding lookup) straight from its GGUF blocks."""
    torch = import_torch()
    if weight.raw is None:
        raise ModelError(f"torch backend: weight {weight.name} has no quantized blocks to look rows up in")
    rows = dequantize_rows(weight.raw, weight.ggml_type, weight.ne, ids.cpu().numpy())
    return torch.from_numpy(rows).to(ids.device)


def slice_op(x: Any, axis: int, start: int | None, stop: int | None) -> Any:
    """``x[..., start:stop]`` along ``axis`` (a view)."""
    axis = axis % x.dim()
    return x[(slice(None),) * axis + (slice(start, stop),)]


def softcap_op(x: Any, cap: float) -> Any:
    torch = import_torch()
    return torch.tanh(x * (1.0 / cap)).mul_(cap)

