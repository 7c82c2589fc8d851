"""The torch backend's weight forms: matmul weights as fp16 (fbgemm), per-row int8 (fbgemm), bf16 or f32, plus
dense float32 tensors for elementwise use and the raw GGUF blocks for exact ``get_rows`` lookups."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from llmfw.core.exec.backend import WeightSource
from llmfw.core.errors import BackendUnavailable
from llmfw.core.format.quants import dequantize_rows
from llmfw.plugins.backends.torch.environment import import_torch

#: matmul weight forms; the ``matmul`` option (the CLI maps ``LLMFW_TORCH_MATMUL`` onto it) picks one instead of
#: the device default
MATMUL_FORMS = ("fp16", "int8", "bf16", "f32")
MATMUL_FORM_ENV = "LLMFW_TORCH_MATMUL"


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


def default_matmul_form(device: str, forced: str | None = None) -> str:
    """The weight form for ``device``: ``forced`` (the ``matmul`` option) when given, else fp16 (CPU, when
    fbgemm has it) or bf16."""
    if forced:
        if forced not in MATMUL_FORMS:
            raise BackendUnavailable(f"the torch matmul form must be one of {', '.join(MATMUL_FORMS)}, got {forced!r}")
        available = _FORM_AVAILABLE.get(forced)
        if available is not None and (device != "cpu" or not available()):
            raise BackendUnavailable(f"torch matmul form {forced} needs fbgemm's kernels on the CPU; device "
                                     f"{device!r}, kernels present: {available()}")
        return forced
    if device == "cpu":
        # fp16 weights keep llama.cpp's accuracy (int8 per-row does not: docs/backends.md, torch); without fbgemm, f32
        # (bf16 matmuls have no fast path on AVX2 CPUs: a prefill is many times slower than in f32)
        return "fp16" if has_fbgemm_fp16() else "f32"
    return "bf16"


#: int8 weights use 7 bits ([-63, 63]) so that 8-bit activations fit fbgemm's AVX2 kernel: it sums pairs of
#: u8 x s8 products in int16 (255 * 63 * 2 < 32767). On SmolLM2 8-bit activations with 7-bit weights
#: err less than the other split (7-bit activations, ``reduce_range``).
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


def dequantized_row_chunks(source: WeightSource, rows_per_chunk: int) -> Iterator[tuple[int, np.ndarray]]:
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
    for start, rows in dequantized_row_chunks(source, 4096):
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
        # 576-wide SmolLM2 matrix takes the room of a 1024-wide one
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
        return int(self.weight.numel() * self.weight.element_size())


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
    int8_parts = [p for p in parts if isinstance(p, Int8Linear)]
    if len(int8_parts) == len(parts):
        rows = [p.int8_rows() for p in int8_parts]
        return Int8Linear(torch.cat([q for q, _ in rows]), torch.cat([s for _, s in rows]))
    if form == "fp16":
        return Fp16Linear(torch.cat([p.dense() for p in parts]))
    weights = [p.weight if isinstance(p, DenseLinear) else p.dense().to(device) for p in parts]
    dtype = torch.bfloat16 if form == "bf16" else torch.float32
    return DenseLinear(torch.cat([w.to(dtype) for w in weights]).contiguous())


def slice_linear(fused: Linear, row: int, n_out: int) -> Linear:
    """Output rows ``row .. row + n_out`` of a fused linear as a linear of their own, in the same form."""
    if isinstance(fused, Int8Linear):
        q, scale = fused.int8_rows()
        return Int8Linear(q[row:row + n_out].contiguous(), scale[row:row + n_out].contiguous())
    if isinstance(fused, Fp16Linear):
        return Fp16Linear(fused.dense()[row:row + n_out])
    return DenseLinear(fused.weight[row:row + n_out].contiguous())


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
    #: set when this weight was folded into a fused weight (``Backend.fuse_weights``): (its name, first row)
    fused_into: tuple[str, int] | None = None

    @property
    def nbytes(self) -> int:
        total = self.linear.nbytes if self.linear is not None else 0
        if self.tensor is not None:
            total += self.tensor.numel() * self.tensor.element_size()
        if self.raw is not None:
            total += self.raw.nbytes
        return total

