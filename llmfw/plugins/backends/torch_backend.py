"""The torch backend: the graph IR executed with PyTorch on the CPU or on a CUDA device.

Weights are converted once, at load, into the fastest form for the device that still clears the reference bar
(``LLMFW_TORCH_MATMUL`` = fp16 | int8 | bf16 | f32 overrides it):

* CPU: fp16 matmul weights for fbgemm's fp16 linear (``quantized::linear_dynamic_fp16``: float32 activations
  and accumulation, weights widened inside the kernel). Per-row int8 for fbgemm's dynamic quantized linear
  (``quantized::linear_dynamic``) is faster but measured *outside* the bar on SmolLM2 (mean log-prob error
  0.45 / 0.74 on prompts 0 / 1 vs 0.25: per-row re-quantization of Q4_1 blocks plus one activation scale per
  token), so it is opt-in. Without fbgemm: float32 (bf16 matmuls have no fast path on AVX2 CPUs).
* CUDA: bf16 weights; activations are cast to bf16 for the matmul and back to float32 after it (unverified: no
  GPU was available when this was written).

Everything else (norms, rope, attention, activations) runs in float32. A split is compiled once per graph build
into straight-line Python source (one line per op, like ``torch.fx`` code generation), with these rewrites:
matmuls sharing their input (Q/K/V, gate/up) become one matmul on a fused weight built once and cached; a norm
followed by a multiplication with a weight becomes one ``rms_norm`` / ``layer_norm`` call; rope angles are
computed once per graph run and shared by every layer. The KV cache is a static preallocated tensor per layer,
written in place with ``index_copy_``. torch is imported only by this module, and only when the backend is used.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from llmfw.core.architecture import RopeParams
from llmfw.core.backend import (
    Backend, BackendOptions,
    CompiledSplit,
    KVLayerShape,
    NativeValue,
    Split,
    WeightSource,
    release_freed_memory,
)
from llmfw.core.errors import BackendUnavailable, ModelError
from llmfw.core.graph import OPS, Node
from llmfw.core.quants import dequantize_rows
from llmfw.core.rope import rope_cos_sin as host_rope_cos_sin

log = logging.getLogger(__name__)

PIP_EXTRA = "torch"
INSTALL_HINT = f"pip install 'llmfw[{PIP_EXTRA}]'"

#: matmul weight forms; ``LLMFW_TORCH_MATMUL`` picks one instead of the device default
MATMUL_FORMS = ("fp16", "int8", "bf16", "f32")
MATMUL_FORM_ENV = "LLMFW_TORCH_MATMUL"

#: ``LLMFW_TORCH_SPIN=0``: torch's OpenMP threads sleep at once when idle instead of spinning. Measured on the
#: 2-core VM (SmolLM2 one-token decodes): quiet machine 40 → 45 ms/token, next to one busy process 122 → 53 ms.
SPIN_ENV = "LLMFW_TORCH_SPIN"

_torch: Any = None


def _apply_spin_setting() -> None:
    """Set OpenMP's wait policy from ``LLMFW_TORCH_SPIN`` before torch loads its OpenMP runtime (which reads it
    once); an explicit ``OMP_WAIT_POLICY`` wins."""
    if os.environ.get(SPIN_ENV, "").strip() != "0" or "OMP_WAIT_POLICY" in os.environ:
        return
    if "torch" in sys.modules:
        log.warning("%s=0 has no effect: torch was imported before llmfw's torch backend", SPIN_ENV)
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def import_torch() -> Any:
    """torch, imported on first use; BackendUnavailable naming the extra when it is not installed."""
    global _torch
    if _torch is None:
        _apply_spin_setting()
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise BackendUnavailable(f"the torch backend needs PyTorch, which is not installed ({exc}); "
                                     f"install it with: {INSTALL_HINT}") from exc
        _torch = torch
    return _torch


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA kernel driver is loaded (what CUDA needs), read from /proc without importing torch."""
    return os.path.exists("/proc/driver/nvidia/version")


def check_device(device: str | None) -> str:
    """Normalise a device ("cpu", "cuda", "cuda:1"); BackendUnavailable when torch cannot use it."""
    torch = import_torch()
    device = device or "cpu"
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        raise BackendUnavailable(f"torch backend device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"torch backend device {device!r} requested but torch {torch.__version__} sees no "
                                 f"CUDA device (torch.cuda.is_available() is False)")
    return device


# ---------------------------------------------------------------------------------------------------------------
# Weight forms
# ---------------------------------------------------------------------------------------------------------------

def _has_fbgemm_ops(*ops: str) -> bool:
    torch = import_torch()
    try:
        return "fbgemm" in torch.backends.quantized.supported_engines and all(
            hasattr(torch.ops.quantized, op) for op in ops)
    except (AttributeError, RuntimeError):  # pragma: no cover - exotic builds
        return False


def has_dynamic_int8() -> bool:
    """Whether this torch has fbgemm's dynamic quantized linear on int8 weights."""
    return _has_fbgemm_ops("linear_prepack", "linear_dynamic", "linear_unpack")


def has_fbgemm_fp16() -> bool:
    """Whether this torch has fbgemm's fp16-weight linear (f32 activations, weights converted in the kernel)."""
    return _has_fbgemm_ops("linear_prepack_fp16", "linear_dynamic_fp16", "linear_unpack_fp16")


_FORM_AVAILABLE: dict[str, Callable[[], bool]] = {"fp16": has_fbgemm_fp16, "int8": has_dynamic_int8}


def default_matmul_form(device: str) -> str:
    """The weight form for ``device``: the env override, else int8 (CPU, when available) or bf16."""
    forced = os.environ.get(MATMUL_FORM_ENV, "").strip().lower()
    if forced:
        if forced not in MATMUL_FORMS:
            raise BackendUnavailable(f"{MATMUL_FORM_ENV} must be one of {', '.join(MATMUL_FORMS)}, got {forced!r}")
        available = _FORM_AVAILABLE.get(forced)
        if available is not None and (device != "cpu" or not available()):
            raise BackendUnavailable(f"{MATMUL_FORM_ENV}={forced} needs fbgemm's kernels on the CPU; device "
                                     f"{device!r}, kernels present: {available()}")
        return forced
    if device == "cpu":
        # fp16 weights keep llama.cpp's accuracy (int8 per-row does not: see the README); without fbgemm, f32
        # (bf16 matmuls have no fast path on AVX2 CPUs: ~10x slower prefill than f32 measured here)
        return "fp16" if has_fbgemm_fp16() else "f32"
    return "bf16"


#: int8 weights use 7 bits ([-63, 63]) so that 8-bit activations fit fbgemm's AVX2 kernel: it sums pairs of
#: u8 x s8 products in int16 (255 * 63 * 2 < 32767). Measured on SmolLM2: 8-bit activations with 7-bit weights
#: err ~1.6x less than the other split (7-bit activations, ``reduce_range``).
INT8_WEIGHT_MAX = 63


def quantize_rows_int8(w: np.ndarray, qmax: int = INT8_WEIGHT_MAX) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row quantization: ``w ≈ q * scale[:, None]`` with int8 ``q`` in [-qmax, qmax]; all-zero rows
    get scale 1."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=1) / np.float32(qmax)
    scale[scale == 0] = 1.0
    q = np.rint(w / scale[:, None])
    np.clip(q, -qmax, qmax, out=q)
    return q.astype(np.int8), scale.astype(np.float32)


def _dequantized_row_chunks(source: WeightSource, rows_per_chunk: int):
    """The weight as float32 row blocks ``(start, rows)``, so that converting a 49152-row output head never
    holds its whole float32 copy (the peak stays a few MB above the result)."""
    shape = source.numpy_shape
    n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    for start in range(0, n_rows, rows_per_chunk):
        index = np.arange(start, min(n_rows, start + rows_per_chunk))
        yield start, dequantize_rows(source.raw, source.ggml_type, source.ne, index)


def dequantize_source(source: WeightSource) -> np.ndarray:
    """The whole weight as float32 in its numpy shape."""
    shape = source.numpy_shape
    out = np.empty((int(np.prod(shape[:-1])) if len(shape) > 1 else 1, shape[-1]), dtype=np.float32)
    for start, rows in _dequantized_row_chunks(source, 4096):
        out[start:start + rows.shape[0]] = rows
    return out.reshape(shape)


class Int8Linear:
    """``x @ W.T`` through fbgemm's dynamic quantized linear on per-row int8 weights.

    Activations are quantized per call to 8 bits with one (asymmetric) scale for the whole input (weights are
    7-bit, see INT8_WEIGHT_MAX); for more than one row the input is first scaled
    row by row to a common range (exact, the matmul is linear) so that one token's outliers cannot coarsen the
    quantization of the others — per-token activation quantization, like llama.cpp's per-block one.
    """

    form = "int8"

    def __init__(self, q: Any, scale: Any):
        torch = import_torch()
        self.n_out, self.n_in = int(q.shape[0]), int(q.shape[1])
        with warnings.catch_warnings():  # quantized tensor creation is deprecated; it is what the kernel takes
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(self.n_out, dtype=torch.long),
                                                          0)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self._linear = torch.ops.quantized.linear_dynamic

    def __call__(self, x: Any) -> Any:
        if x.dim() == 1 or x.shape[-2] == 1 or x.numel() == x.shape[-1]:
            return self._linear(x, self.packed, False)
        row_max = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)
        return self._linear(x / row_max, self.packed, False).mul_(row_max)

    def int8_rows(self) -> tuple[Any, Any]:
        """(int8 [n_out, n_in], float32 scale [n_out]) recovered from the packed weight."""
        torch = import_torch()
        qw, _ = torch.ops.quantized.linear_unpack(self.packed)
        return qw.int_repr(), qw.q_per_channel_scales().to(torch.float32)

    def dense(self) -> Any:
        q, scale = self.int8_rows()
        return q.float() * scale[:, None]

    @property
    def nbytes(self) -> int:
        return self.n_out * self.n_in + 8 * self.n_out


#: fbgemm's PackedGemmMatrixFP16 block of input rows (its default ``brow``)
FBGEMM_FP16_K_BLOCK = 512


class Fp16Linear:
    """``x @ W.T`` through fbgemm's fp16-weight linear: weights stored as fp16 (half the bytes of f32, 11
    significant bits: GGUF's 4-8 bit quants and their f16 scales survive almost exactly), activations and
    accumulation in float32."""

    form = "fp16"

    def __init__(self, weight: Any):
        torch = import_torch()
        self.n_out, self.n_in = int(weight.shape[0]), int(weight.shape[1])
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)
        self._linear = torch.ops.quantized.linear_dynamic_fp16

    def __call__(self, x: Any) -> Any:
        return self._linear(x, self.packed)

    def dense(self) -> Any:
        torch = import_torch()
        weight, _ = torch.ops.quantized.linear_unpack_fp16(self.packed)
        return weight

    @property
    def nbytes(self) -> int:
        # fbgemm packs the input dimension in blocks of FBGEMM_FP16_K_BLOCK rows, padding the last block: a
        # 576-wide SmolLM2 matrix takes the room of a 1024-wide one (measured: 96 MB for the 49152x576 head)
        padded_in = -(-self.n_in // FBGEMM_FP16_K_BLOCK) * FBGEMM_FP16_K_BLOCK
        return 2 * self.n_out * padded_in


class DenseLinear:
    """``x @ W.T`` with a float weight (bf16: activations cast to bf16 for the matmul, result in float32)."""

    def __init__(self, weight: Any):
        torch = import_torch()
        self.weight = weight
        self.n_out, self.n_in = int(weight.shape[0]), int(weight.shape[1])
        self.form = "bf16" if weight.dtype == torch.bfloat16 else "f32"
        self._f = torch.nn.functional.linear
        self._dtype = weight.dtype

    def __call__(self, x: Any) -> Any:
        if self._dtype == x.dtype:
            return self._f(x, self.weight)
        return self._f(x.to(self._dtype), self.weight).float()

    def dense(self) -> Any:
        return self.weight.float()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


Linear = Int8Linear | Fp16Linear | DenseLinear


def make_linear(w: np.ndarray, form: str, device: str = "cpu") -> Linear:
    """A linear for float32 weight rows ``w`` [n_out, n_in] in ``form`` ("int8", "bf16", "f32")."""
    torch = import_torch()
    w = np.ascontiguousarray(w, dtype=np.float32).reshape(w.shape[0], -1)
    if form == "int8":
        q, scale = quantize_rows_int8(w)
        return Int8Linear(torch.from_numpy(q), torch.from_numpy(scale))
    if form == "fp16":
        return Fp16Linear(torch.from_numpy(w))
    dtype = torch.bfloat16 if form == "bf16" else torch.float32
    return DenseLinear(torch.from_numpy(w).to(device=device, dtype=dtype).contiguous())


def concat_linears(parts: list[Linear], form: str, device: str) -> Linear:
    """One linear whose output rows are ``parts``' output rows in order (a fused QKV or gate/up weight)."""
    torch = import_torch()
    if all(isinstance(p, Int8Linear) for p in parts):
        rows = [p.int8_rows() for p in parts]
        return Int8Linear(torch.cat([q for q, _ in rows]), torch.cat([s for _, s in rows]))
    if form == "fp16":
        return Fp16Linear(torch.cat([p.dense() for p in parts]))
    weights = [p.weight if isinstance(p, DenseLinear) else p.dense().to(device) for p in parts]
    dtype = torch.bfloat16 if form == "bf16" else torch.float32
    return DenseLinear(torch.cat([w.to(dtype) for w in weights]).contiguous())


@dataclass
class TorchWeight:
    """A model weight in the backend's forms: a linear for ``mul_mat``, a dense tensor for elementwise use,
    the raw GGUF blocks for exact ``get_rows`` lookups. Forms are made at load from the usage hint; a form
    needed later is derived from another (and cached) with a log line saying so."""

    name: str
    shape: tuple[int, ...]
    linear: Linear | None = None
    tensor: Any = None
    raw: np.ndarray | None = None
    ggml_type: int = 0
    ne: tuple[int, ...] = ()
    #: set when this weight was folded into a fused linear: (that fused linear's key, first output row)
    fused_into: tuple[tuple[str, ...], int] | None = None

    @property
    def nbytes(self) -> int:
        total = self.linear.nbytes if self.linear is not None else 0
        if self.tensor is not None:
            total += self.tensor.numel() * self.tensor.element_size()
        if self.raw is not None:
            total += self.raw.nbytes
        return total


# ---------------------------------------------------------------------------------------------------------------
# Kernels (module-level functions bound into the generated code)
# ---------------------------------------------------------------------------------------------------------------

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
    cos, sin = torch.from_numpy(cos), torch.from_numpy(sin)
    return cos.to(pos.device), sin.to(pos.device)


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


def grouped_mask(cache: dict[int, Any], mask: Any, group: int) -> Any:
    """The [T, n_kv] mask repeated for ``group`` query heads per KV head: [group*T, n_kv] (see attention);
    ``cache`` keeps it for the other layers of the same graph run."""
    grouped = cache.get(group)
    if grouped is None:
        grouped = cache[group] = mask if group == 1 else mask.repeat(group, 1)
    return grouped


def attention(q: Any, k: Any, v: Any, kv_idx: Any, mask: Any, masks: dict[int, Any], kv: KVStorage,
              scale: float, softcap: float) -> Any:
    """The IR's attention: write k/v into cache rows ``kv_idx``, attend over cells ``0 .. n_kv-1``.

    GQA without repeating K/V: query heads are ordered ``h = g * group + j`` (KV head ``h // group``), so
    ``q.transpose(0, 1)`` [H, T, D] viewed as [H_kv, group*T, D] attends its KV head as one batch entry; the
    mask is repeated ``group`` times along its rows (once per graph run, kept in ``masks``).
    """
    torch = import_torch()
    n_tokens, n_head, head_dim = q.shape
    n_head_kv = k.shape[1]
    group = n_head // n_head_kv
    kv.k.index_copy_(1, kv_idx, k.transpose(0, 1))
    kv.v.index_copy_(1, kv_idx, v.transpose(0, 1))
    n_kv = mask.shape[-1]
    mask_g = grouped_mask(masks, mask, group)
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
    rows = dequantize_rows(weight.raw, weight.ggml_type, weight.ne, ids.cpu().numpy())
    return torch.from_numpy(rows).to(ids.device)


def slice_op(x: Any, axis: int, start: int | None, stop: int | None) -> Any:
    """``x[..., start:stop]`` along ``axis`` (a view)."""
    axis = axis % x.dim()
    return x[(slice(None),) * axis + (slice(start, stop),)]


def softcap_op(x: Any, cap: float) -> Any:
    torch = import_torch()
    return torch.tanh(x * (1.0 / cap)).mul_(cap)


# ---------------------------------------------------------------------------------------------------------------
# Split compilation: graph nodes -> generated Python source -> a function
# ---------------------------------------------------------------------------------------------------------------

class SplitCompiler:
    """Turns one split into straight-line code. ``lines`` is kept for ``--verbose`` dumps and debugging."""

    def __init__(self, backend: "TorchBackend", split: Split, kv: Mapping[tuple[str, int], Any]):
        self.backend = backend
        self.split = split
        self.kv = kv
        self.nodes = split.nodes
        self.by_id = {n.id: n for n in self.nodes}
        self.consts: dict[str, Any] = {}
        self.lines: list[str] = []
        self.uses = self._count_uses()
        self.skip: set[int] = set()
        self.memo: dict[tuple, str] = {}

    # -- analysis ---------------------------------------------------------------------------------------
    def _count_uses(self) -> dict[int, int]:
        uses: dict[int, int] = {}
        for node in self.nodes:
            for src in node.inputs:
                uses[src.id] = uses.get(src.id, 0) + 1
        for out_id in self.split.output_ids:
            uses[out_id] = uses.get(out_id, 0) + 1
        return uses

    def _sole_consumer(self, node: Node, op: str) -> Node | None:
        """The next node if it is the only consumer of ``node`` and has op ``op``."""
        if self.uses.get(node.id, 0) != 1:
            return None
        for later in self.nodes[self.nodes.index(node) + 1:]:
            if any(src is node for src in later.inputs):
                return later if later.op == op else None
        return None

    def _weight_of(self, node: Node) -> TorchWeight | None:
        if node.op != "weight" or node.id not in self.by_id:
            return None
        return self.backend.weights.get(node.attrs["name"])

    # -- naming -----------------------------------------------------------------------------------------
    def const(self, value: Any, hint: str = "c") -> str:
        name = f"{hint}{len(self.consts)}"
        self.consts[name] = value
        return name

    @staticmethod
    def var(node: Node) -> str:
        return f"v{node.id}"

    def emit(self, node: Node, expr: str) -> None:
        self.lines.append(f"    {self.var(node)} = {expr}  # {node.op} L{node.layer} {node.name}")

    # -- code generation --------------------------------------------------------------------------------
    def compile(self) -> CompiledSplit:
        body = [f"    v{i} = inputs[{i}]" for i in self.split.input_ids]
        self._plan_fused_matmuls()
        for node in self.nodes:
            if node.id in self.skip:
                continue
            handler = getattr(self, f"_op_{node.op}", None)
            if handler is None:
                raise ModelError(f"torch backend cannot compile op {node.op!r} (node %{node.id})")
            handler(node)
        outputs = ", ".join(f"{i}: v{i}" for i in self.split.output_ids)
        lines = free_dead_values(body + self.lines, {f"v{i}" for i in self.split.output_ids})
        source = "def run(inputs):\n" + "\n".join(lines) + f"\n    return {{{outputs}}}\n"
        namespace: dict[str, Any] = {"torch": import_torch(), "F": import_torch().nn.functional, **self.consts,
                                     **KERNELS}
        exec(compile(source, f"<torch split {id(self.split):x}>", "exec"), namespace)  # noqa: S102 - our codegen
        self.source = source
        return namespace["run"]

    def _plan_fused_matmuls(self) -> None:
        """Group mul_mats whose weights live here and that read the same input: one fused matmul each."""
        groups: dict[int, list[Node]] = {}
        for node in self.nodes:
            if node.op == "mul_mat" and self._weight_of(node.inputs[0]) is not None:
                groups.setdefault(node.inputs[1].id, []).append(node)
        self.fused: dict[int, tuple[list[Node], Linear]] = {}
        for members in groups.values():
            if len(members) < 2:
                continue
            names = tuple(m.inputs[0].attrs["name"] for m in members)
            fused = self.backend.fused_linear(names)
            if fused is None:
                continue
            for m in members:
                self.fused[m.id] = (members, fused)

    def _op_weight(self, node: Node) -> None:
        weight = self.backend.weights.get(node.attrs["name"])
        if weight is None:
            raise ModelError(f"weight {node.attrs['name']!r} is not loaded on backend {self.backend.spec}")
        # weights are resolved where they are used (linear, dense tensor or raw rows)

    def _dense(self, node: Node) -> str:
        """The expression for a node's value as a dense tensor (weights: their dense form)."""
        weight = self._weight_of(node)
        if weight is None:
            return self.var(node)
        key = ("dense", weight.name)
        if key not in self.memo:
            self.memo[key] = self.const(self.backend.dense_tensor(weight.name), "w")
        return self.memo[key]

    def _op_get_rows(self, node: Node) -> None:
        table, ids = node.inputs
        weight = self._weight_of(table)
        if weight is not None and weight.raw is not None:
            self.emit(node, f"get_rows_raw({self.const(weight, 'w')}, {self.var(ids)})")
        else:
            self.emit(node, f"torch.index_select({self._dense(table)}, 0, {self.var(ids)})")

    def _op_mul_mat(self, node: Node) -> None:
        w, x = node.inputs
        if node.id in self.fused:
            members, fused = self.fused[node.id]
            first = members[0]
            if node is first:
                out = f"f{node.id}"
                self.lines.append(f"    {out} = {self.const(fused, 'lin')}({self.var(x)})  # fused "
                                  f"{'+'.join(m.inputs[0].attrs['name'] for m in members)}")
                self.memo[("fused", first.id)] = out
            offset = 0
            for m in members:
                if m is node:
                    break
                offset += self.backend.weights[m.inputs[0].attrs["name"]].shape[0]
            n_out = self.backend.weights[w.attrs["name"]].shape[0]
            self.emit(node, f"{self.memo[('fused', first.id)]}.narrow(-1, {offset}, {n_out})")
            return
        weight = self._weight_of(w)
        if weight is not None:
            self.emit(node, f"{self.const(self.backend.linear(weight.name), 'lin')}({self.var(x)})")
        else:
            self.emit(node, f"torch.matmul({self.var(x)}, {self.var(w)}.transpose(-1, -2))")

    def _binary(self, node: Node, fn: str) -> None:
        a, b = node.inputs
        self.emit(node, f"torch.{fn}({self._dense(a)}, {self._dense(b)})")

    def _op_add(self, node: Node) -> None:
        self._binary(node, "add")

    def _op_sub(self, node: Node) -> None:
        self._binary(node, "sub")

    def _op_mul(self, node: Node) -> None:
        self._binary(node, "mul")

    def _op_scale(self, node: Node) -> None:
        self.emit(node, f"torch.mul({self.var(node.inputs[0])}, {float(node.attrs['s'])!r})")

    def _norm_with_weight(self, node: Node) -> tuple[str, Node]:
        """A norm's following ``mul`` by a 1-D weight of the normalised size, folded into the norm call."""
        mul = self._sole_consumer(node, "mul")
        if mul is not None:
            other = mul.inputs[1] if mul.inputs[0] is node else mul.inputs[0]
            weight = self._weight_of(other)
            if weight is not None and len(weight.shape) == 1:
                self.skip.add(mul.id)
                return self._dense(other), mul
        return "None", node

    def _op_rms_norm(self, node: Node) -> None:
        x = node.inputs[0]
        weight, target = self._norm_with_weight(node)
        expr = f"F.rms_norm({self.var(x)}, ({self.var(x)}.shape[-1],), {weight}, {float(node.attrs['eps'])!r})"
        self.emit(node, expr)
        if target is not node:
            self.emit(target, self.var(node))

    def _op_norm(self, node: Node) -> None:
        x = node.inputs[0]
        weight, target = self._norm_with_weight(node)
        expr = (f"F.layer_norm({self.var(x)}, ({self.var(x)}.shape[-1],), {weight}, None, "
                f"{float(node.attrs['eps'])!r})")
        self.emit(node, expr)
        if target is not node:
            self.emit(target, self.var(node))

    def _op_silu(self, node: Node) -> None:
        self.emit(node, f"F.silu({self.var(node.inputs[0])})")

    def _op_relu(self, node: Node) -> None:
        self.emit(node, f"torch.relu({self.var(node.inputs[0])})")

    def _op_gelu(self, node: Node) -> None:
        self.emit(node, f"F.gelu({self.var(node.inputs[0])}, approximate='tanh')")

    def _op_softcap(self, node: Node) -> None:
        self.emit(node, f"softcap_op({self.var(node.inputs[0])}, {float(node.attrs['cap'])!r})")

    def _op_clamp(self, node: Node) -> None:
        lo, hi = node.attrs.get("min"), node.attrs.get("max")
        self.emit(node, f"torch.clamp({self.var(node.inputs[0])}, {lo!r}, {hi!r})")

    def _op_reshape(self, node: Node) -> None:
        shape = tuple(int(d) for d in node.attrs["shape"])
        self.emit(node, f"{self._dense(node.inputs[0])}.reshape({shape!r})")

    def _op_slice(self, node: Node) -> None:
        axis = int(node.attrs.get("axis", -1))
        start, stop = node.attrs.get("start"), node.attrs.get("stop")
        self.emit(node, f"slice_op({self._dense(node.inputs[0])}, {axis}, {start!r}, {stop!r})")

    def _op_rope(self, node: Node) -> None:
        x, pos = node.inputs[0], node.inputs[1]
        ff = node.inputs[2] if len(node.inputs) > 2 else None
        params = RopeParams.from_attrs(node.attrs)
        key = ("rope", pos.id, params, ff.id if ff is not None else None)
        if key not in self.memo:
            cs = f"cs{node.id}"
            ff_expr = self._dense(ff) if ff is not None else "None"
            self.lines.append(f"    {cs} = rope_tables({self.var(pos)}, {self.const(params, 'rp')}, {ff_expr})")
            self.memo[key] = cs
        cs = self.memo[key]
        self.emit(node, f"rope_apply({self.var(x)}, {cs}, {params.n_dims}, {params.mode == 'neox'})")

    def _kv_storage(self, node: Node) -> KVStorage:
        cache_key = (node.attrs.get("cache", "kv"), int(node.attrs.get("layer", node.layer)))
        storage = self.kv.get(cache_key)
        if storage is None:
            raise ModelError(f"no KV storage for cache {cache_key[0]!r} layer {cache_key[1]} on {self.backend.spec}")
        return storage

    def _op_k_shift(self, node: Node) -> None:
        shift = node.inputs[0]
        ff = self._dense(node.inputs[1]) if len(node.inputs) > 1 else "None"
        params = RopeParams.from_attrs(node.attrs)
        self.emit(node, f"k_shift({self.var(shift)}, {ff}, {self.const(self._kv_storage(node), 'kv')}, "
                        f"{self.const(params, 'rp')})")

    def _op_attention(self, node: Node) -> None:
        q, k, v, kv_idx, mask = node.inputs
        storage = self._kv_storage(node)
        mkey = ("mask", mask.id)
        if mkey not in self.memo:
            self.memo[mkey] = f"masks{mask.id}"
            self.lines.append(f"    {self.memo[mkey]} = {{}}  # grouped masks of %{mask.id}, made once per run")
        args = ", ".join(self.var(n) for n in (q, k, v, kv_idx, mask))
        self.emit(node, f"attention({args}, {self.memo[mkey]}, {self.const(storage, 'kv')}, "
                        f"{float(node.attrs['scale'])!r}, {float(node.attrs.get('softcap', 0.0) or 0.0)!r})")


_LOCAL_NAME = re.compile(r"\b(?:v|f|cs|masks)\d+\b")


def free_dead_values(lines: list[str], keep: set[str]) -> list[str]:
    """Insert ``del`` after the last use of every local, so that a long prefill holds one layer's temporaries at
    a time instead of all of them until the split returns (measured: +700 MB peak for SmolLM2's pp512)."""
    last_use: dict[str, int] = {}
    for index, line in enumerate(lines):
        code = line.split("#", 1)[0]
        target, _, expr = code.partition("=")
        for name in _LOCAL_NAME.findall(expr):
            last_use[name] = index
        for name in _LOCAL_NAME.findall(target):
            last_use.setdefault(name, index)
    dead_after: dict[int, list[str]] = {}
    for name, index in last_use.items():
        if name not in keep:
            dead_after.setdefault(index, []).append(name)
    out = []
    for index, line in enumerate(lines):
        out.append(line)
        if index in dead_after:
            out.append(f"    del {', '.join(sorted(dead_after[index]))}")
    return out


KERNELS: dict[str, Callable[..., Any]] = {
    "rope_tables": rope_tables, "rope_apply": rope_apply, "attention": attention, "grouped_mask": grouped_mask,
    "get_rows_raw": get_rows_raw, "k_shift": k_shift, "softcap_op": softcap_op, "slice_op": slice_op,
}


# ---------------------------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------------------------

class TorchBackend(Backend):
    """PyTorch on ``cpu`` (default) or ``cuda[:N]``; see the module docstring."""

    name: ClassVar[str] = "torch"
    pip_extra: ClassVar[str | None] = PIP_EXTRA
    supported_ops: ClassVar[frozenset[str]] = frozenset(OPS - {"input"})
    is_host: ClassVar[bool] = False
    requires: ClassVar[tuple[str, ...]] = ("torch",)
    #: the default only on a CUDA GPU: on a CPU, importing torch alone costs seconds and onnx decodes faster
    default_priority: ClassVar[Mapping[str, int]] = {"cuda": 300}

    def __init__(self, device: str | None = None, options: BackendOptions | None = None):
        torch = import_torch()
        super().__init__(device=check_device(device), options=options)
        self.torch_device = torch.device(self.device)
        self.matmul_form = default_matmul_form(self.device)
        if self.matmul_form == "int8":
            torch.backends.quantized.engine = "fbgemm"
        self.use_threads(None)
        self._fused: dict[tuple[str, ...], Linear] = {}
        self._loading = True
        self.last_source: str = ""
        log.info("torch backend on %s: matmul weights as %s, %d threads", self.device, self.matmul_form,
                 torch.get_num_threads())

    @property
    def spec(self) -> str:
        return self.name if self.device == "cpu" else f"{self.name}:{self.device}"

    def set_n_threads(self, n_threads: int | None) -> None:
        """torch's intra-op thread count is process-wide: set it explicitly (None keeps torch's default)."""
        super().set_n_threads(n_threads)
        if n_threads:
            import_torch().set_num_threads(int(n_threads))

    @classmethod
    def check_available(cls, device: str | None = None) -> None:
        check_device(device)

    @classmethod
    def default_unavailable_reason(cls, device: str) -> str | None:
        """No NVIDIA driver: no CUDA GPU, decided without importing torch (seconds) just to hear so."""
        if device.startswith("cuda") and not nvidia_driver_present():
            return "no CUDA GPU (no NVIDIA driver loaded)"
        return super().default_unavailable_reason(device)

    # -- weights ----------------------------------------------------------------------------------------
    def load_weight(self, source: WeightSource) -> TorchWeight:
        torch = import_torch()
        shape = source.numpy_shape
        weight = TorchWeight(source.name, shape, ggml_type=int(source.ggml_type), ne=tuple(source.ne))
        usage = set(source.usage)
        matrix = len(shape) == 2
        if "get_rows" in usage:
            # exact lookups from the original blocks: compact, and no error added to embeddings
            weight.raw = np.array(source.raw, dtype=np.uint8, copy=True)
        if matrix and ("mul_mat" in usage or not usage):
            weight.linear = self._convert_linear(source)
        if not matrix or (usage - {"mul_mat", "get_rows"}):
            values = dequantize_source(source)
            weight.tensor = torch.from_numpy(values).to(self.torch_device)
        if weight.linear is None and weight.tensor is None and weight.raw is None:
            weight.tensor = torch.from_numpy(dequantize_source(source)).to(self.torch_device)
        self.weights[source.name] = weight
        return weight

    def _convert_linear(self, source: WeightSource) -> Linear:
        """Per-row conversion in chunks: a 49152x576 head never exists as one float32 array."""
        torch = import_torch()
        n_out, n_in = source.numpy_shape
        if self.matmul_form == "int8":
            q = torch.empty((n_out, n_in), dtype=torch.int8)
            scale = torch.empty(n_out, dtype=torch.float32)
            for start, rows in _dequantized_row_chunks(source, 4096):
                q_rows, s_rows = quantize_rows_int8(rows)
                q[start:start + len(rows)] = torch.from_numpy(q_rows)
                scale[start:start + len(rows)] = torch.from_numpy(s_rows)
            linear = Int8Linear(q, scale)
            del q
            release_freed_memory()
            return linear
        if self.matmul_form == "fp16":
            w16 = torch.empty((n_out, n_in), dtype=torch.float16)
            for start, rows in _dequantized_row_chunks(source, 4096):
                w16[start:start + len(rows)] = torch.from_numpy(rows)
            # prepack takes float32; one matrix at a time keeps the float32 copy transient
            linear = Fp16Linear(w16.float())
            del w16
            release_freed_memory()  # glibc keeps freed temporaries otherwise: RSS after load would count them
            return linear
        dtype = torch.bfloat16 if self.matmul_form == "bf16" else torch.float32
        w = torch.empty((n_out, n_in), dtype=dtype, device=self.torch_device)
        for start, rows in _dequantized_row_chunks(source, 4096):
            w[start:start + len(rows)] = torch.from_numpy(rows).to(self.torch_device, dtype)
        return DenseLinear(w)


    def linear(self, name: str) -> Linear:
        """The linear form of weight ``name``, rebuilt from a fused weight if it was folded into one."""
        weight = self.weights[name]
        if weight.linear is None and weight.fused_into is not None:
            key, row = weight.fused_into
            fused = self._fused[key]
            n_out = weight.shape[0]
            if isinstance(fused, Int8Linear):
                q, scale = fused.int8_rows()
                weight.linear = Int8Linear(q[row:row + n_out].contiguous(), scale[row:row + n_out].contiguous())
            elif isinstance(fused, Fp16Linear):
                weight.linear = Fp16Linear(fused.dense()[row:row + n_out])
            else:
                weight.linear = DenseLinear(fused.weight[row:row + n_out].contiguous())
            log.info("torch backend: weight %s unfused again from %s", name, "+".join(key))
        if weight.linear is None:
            log.warning("torch backend: weight %s was not marked for mul_mat; converting its dense form", name)
            weight.linear = make_linear(self.dense_tensor(name).cpu().numpy(), self.matmul_form, self.device)
        return weight.linear

    def fused_linear(self, names: tuple[str, ...]) -> Linear | None:
        """One linear for weights ``names`` stacked by output rows; built once, members' own forms released."""
        if names in self._fused:
            return self._fused[names]
        weights = [self.weights[n] for n in names]
        if len({w.shape[1] for w in weights}) != 1 or any(len(w.shape) != 2 for w in weights):
            return None
        if any(w.fused_into is not None and w.linear is None for w in weights):
            return None  # already folded into another group: keep the graph's own structure
        fused = concat_linears([self.linear(n) for n in names], self.matmul_form, self.device)
        self._fused[names] = fused
        row = 0
        for w in weights:
            w.fused_into = (names, row)
            row += w.shape[0]
            w.linear = None  # the fused copy replaces it; linear() rebuilds it if a graph needs it alone
        release_freed_memory()
        log.debug("torch backend: fused %s into one %s matmul", "+".join(names), fused.form)
        return fused

    def dense_tensor(self, name: str) -> Any:
        """Weight ``name`` as a float32 tensor (derived from its linear or raw form once, if needed)."""
        weight = self.weights[name]
        if weight.tensor is None:
            torch = import_torch()
            if weight.raw is not None:
                rows = dequantize_rows(weight.raw, weight.ggml_type, weight.ne,
                                       np.arange(int(np.prod(weight.shape[:-1]))))
                weight.tensor = torch.from_numpy(rows.reshape(weight.shape)).to(self.torch_device)
            else:
                log.warning("torch backend: weight %s used elementwise; dequantizing its matmul form", name)
                weight.tensor = self.linear(name).dense().to(self.torch_device)
        return weight.tensor

    def weight_nbytes(self) -> int:
        """Bytes of weight data this backend keeps (fused weights included)."""
        return sum(w.nbytes for w in self.weights.values()) + sum(f.nbytes for f in self._fused.values())

    def free_weights(self) -> None:
        super().free_weights()
        self._fused.clear()

    # -- KV storage -------------------------------------------------------------------------------------
    def alloc_kv(self, shape: KVLayerShape) -> KVStorage:
        torch = import_torch()
        k = torch.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_k), dtype=torch.float32,
                        device=self.torch_device)
        v = torch.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_v), dtype=torch.float32,
                        device=self.torch_device)
        return KVStorage(k, v)

    def read_kv_cells(self, kv: KVStorage, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        torch = import_torch()
        index = torch.from_numpy(np.array(cells, dtype=np.int64)).to(self.torch_device)
        return (kv.k.index_select(1, index).cpu().numpy(), kv.v.index_select(1, index).cpu().numpy())

    def write_kv_cells(self, kv: KVStorage, cells: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        torch = import_torch()
        index = torch.from_numpy(np.array(cells, dtype=np.int64)).to(self.torch_device)
        kv.k.index_copy_(1, index, torch.from_numpy(np.array(k)).to(self.torch_device))
        kv.v.index_copy_(1, index, torch.from_numpy(np.array(v)).to(self.torch_device))

    # -- compute ----------------------------------------------------------------------------------------
    def compile(self, split: Split, kv: Mapping[tuple[str, int], Any]) -> CompiledSplit:
        torch = import_torch()
        if self._loading:  # the first compile follows the last weight: hand conversion temporaries back
            self._loading = False
            release_freed_memory()
        compiler = SplitCompiler(self, split, kv)
        run = compiler.compile()
        self.last_source = compiler.source
        if log.isEnabledFor(logging.DEBUG):
            log.debug("torch split source:\n%s", compiler.source)
        inference_mode = torch.inference_mode
        cuda = self.torch_device.type == "cuda"

        def run_split(inputs: Mapping[int, NativeValue]) -> dict[int, NativeValue]:
            with inference_mode():
                return run(inputs)

        run_split.source = compiler.source  # type: ignore[attr-defined]
        run_split.on_cuda = cuda  # type: ignore[attr-defined]
        return run_split

    def from_numpy(self, array: np.ndarray) -> NativeValue:
        torch = import_torch()
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if self.torch_device.type == "cpu" else tensor.to(self.torch_device, non_blocking=True)

    def to_numpy(self, value: NativeValue) -> np.ndarray:
        return value.detach().to("cpu").numpy()

    def synchronize(self) -> None:
        if self.torch_device.type == "cuda":
            import_torch().cuda.synchronize(self.torch_device)
