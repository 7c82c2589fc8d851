"""The "ggml" backend: the numpy backend with llama.cpp's CPU roundings (an experiment, see below).

The numpy backend computes in exact float32 on dequantized weights. llama.cpp's CPU backend (ggml-cpu, x86
AVX2, as built by llama-cpp-python 0.3.36, the binding the reference outputs come from) rounds in three more
places.
This backend reproduces them; every other op is the numpy backend's:

1. **Quantized matmuls quantize the activations** (``ggml_compute_forward_mul_mat``: ``src1`` is converted to the
   weight type's ``vec_dot_type`` before the dot products):

   * Q4_0 / Q5_0 / Q8_0 / IQ4_NL weights → **Q8_0** activations; Q4_1 / Q5_1 → **Q8_1**: blocks of 32,
     ``amax = max|x|``, ``d = amax / 127``, ``q = round_half_even(x * (127 / amax))`` (the AVX2
     ``quantize_row_q8_*``: a multiply by the reciprocal and ``_mm256_round_ps``, not the reference
     ``roundf(x / d)``), ``d`` stored as f16; Q8_1 also stores ``s = f16(d * Σq)`` with the *unrounded* ``d``,
     and its dot product adds ``m_w * s`` per block (``ggml_vec_dot_q4_1_q8_1``) instead of ``m_w * d * Σq``.
   * K-quants → **Q8_K** activations: blocks of 256, ``iscale = -127 / x[argmax|x|]``,
     ``q = min(127, round_half_even(iscale * x))``, ``d = 1 / iscale`` kept in float32
     (``quantize_row_q8_K_ref``, which x86 uses as is).
   * F16 weights → f16 activations; F32 weights → float32 (no rounding).

   The integer dot products of ggml are exact, and so is ``(q_a·d_a)·(q_w·d_w)`` in float32 (8+11 by 4..8+11 bits),
   so multiplying the *dequantized* quantized activations with the dequantized weights in float32 BLAS gives
   ggml's value up to the order of the float32 sums (~1e-7 relative) — fast, and without integer kernels.
2. **The KV cache is F16** (llama.cpp's default ``type_k = type_v = f16``): K and V are rounded to f16 when
   written (stored as float32 holding f16 values, so nothing is converted per step).
3. **GELU through an f16 table** (``GGML_GELU_FP16``, on in every CPU build: ``ggml_vec_gelu_f32`` and the
   ``geglu`` of a gated FFN): ``gelu(x) = f16(gelu(f16(x)))`` for ``-10 < x < 10``, ``0`` below, ``x`` above.
   For a GELU model (Gemma) this is the largest of the roundings: without it even the first token's state differs
   from llama.cpp's measurably, with it the first tokens agree to float32 noise.
4. **Attention without flash attention** (llama-cpp-python 0.3.36 passes ``flash_attn=False``, i.e.
   ``LLAMA_FLASH_ATTN_TYPE_DISABLED``): ``KQ = mul_mat(K_f16, q)`` rounds q to f16 (the scale is applied later, in
   ``soft_max_ext``, in float32), the soft-max is normalised in float32 (sum in double), and the probabilities are
   rounded to f16 for ``KQV = mul_mat(Vᵀ_f16, KQ)``.

What it does and does not buy (docs/backends.md, ggml): each emulated kernel matches ggml's output to
float32 noise when fed llama.cpp's own inputs, but the network as a whole is *chaotic*
under 8-bit activations: a ±1-ulp difference anywhere flips a few roundings, and the flips grow through the layers
to log-prob changes the same size as numpy-vs-llama.cpp, and as llama.cpp-vs-llama.cpp on two
builds. So its logits are no closer to llama.cpp's than the numpy backend's; it reproduces the *kind and size* of
llama.cpp's rounding noise, not its bits. Use it to study that noise (e.g. how robust a greedy choice is to it),
not as a more exact engine; the class attributes ``quantize_activations``, ``f16_kv_cache``, ``f16_attention``
and ``f16_gelu`` (:class:`GgmlOptions`, ``backend_options={"ggml": {...}}``) switch each emulation off
separately.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from llmfw.core.exec.backend import BackendOptions, CompiledSplit, Split, WeightSource
from llmfw.core.format.quants import GGMLType, dequantize
from llmfw.core.ir.graph import Node
from llmfw.plugins.backends.numpy import (
    F32,
    NumpyBackend,
    NumpyKV,
    SplitCompiler,
    Step,
    group_queries,
    gelu,
    masked_exp,
    ungroup_heads,
    write_kv,
)

F16 = np.float16

#: the activation format ggml converts ``src1`` to before a quantized dot product (``type_traits_cpu[...]
#: .vec_dot_type``), by weight type
_VEC_DOT_TYPE: dict[GGMLType, str] = {
    GGMLType.Q4_0: "q8_0", GGMLType.Q5_0: "q8_0", GGMLType.Q8_0: "q8_0",
    GGMLType.Q4_1: "q8_1", GGMLType.Q5_1: "q8_1",
    GGMLType.Q2_K: "q8_k", GGMLType.Q3_K: "q8_k", GGMLType.Q4_K: "q8_k", GGMLType.Q5_K: "q8_k",
    GGMLType.Q6_K: "q8_k",
    GGMLType.IQ4_NL: "q8_0", GGMLType.F16: "f16", GGMLType.BF16: "bf16",
}

#: weight types whose blocks carry a minimum ``m`` (value ``q*d + m``) paired with Q8_1's stored ``s``
_TYPES_WITH_BLOCK_MIN = frozenset({GGMLType.Q4_1, GGMLType.Q5_1})
Q8_BLOCK = 32
Q8_K_BLOCK = 256


# ---------------------------------------------------------------------------------------------------------
# activation quantization (what ggml's quantize_row_* do to src1), returned dequantized: q * d exactly
# ---------------------------------------------------------------------------------------------------------

def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AVX2 ``quantize_row_q8_0`` / ``q8_1`` of rows ``x`` [R, n]: ``(q * f16(d))`` [R, n] float32 and the block
    sums of ``q`` [R, n/32] (exact integers as float32, for Q8_1's ``s``) — with the float32 ``d`` [R, n/32, 1]."""
    rows, n = x.shape
    blocks = x.reshape(rows, n // Q8_BLOCK, Q8_BLOCK)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = amax / F32(127.0)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, F32(127.0) / amax, F32(0.0)).astype(F32)
    q = np.rint(blocks * inverse)  # _mm256_round_ps(_MM_ROUND_NEAREST): ties to even, like np.rint
    sums = q.sum(axis=-1)  # |Σq| ≤ 32·127: exact in float32
    q *= d.astype(F16).astype(F32)  # exact: an 8-bit integer times an 11-bit f16 scale
    return q.reshape(rows, n), sums, d


def q8_1_block_sums(sums: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q8_1's ``s = f16(d * Σq)`` per block (``d`` the float32 scale, before its own f16 rounding)."""
    block_sums: np.ndarray = (d[..., 0] * sums).astype(F16).astype(F32)
    return block_sums


def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_K_ref`` of rows ``x`` [R, n] (n a multiple of 256), returned as ``q * d`` float32.

    The element of largest magnitude maps to -127 (``iscale = -127 / max``), others are rounded to nearest
    (ties to even: ggml's ``nearest_int``) and clamped to 127; ``d = 1 / iscale`` stays float32."""
    rows, n = x.shape
    blocks = x.reshape(rows, n // Q8_K_BLOCK, Q8_K_BLOCK)
    # the first element of largest |x| (ggml keeps the first on ties: ``if (ax > amax)``)
    where = np.abs(blocks).argmax(axis=-1)[..., None]
    signed_max = np.take_along_axis(blocks, where, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(signed_max != 0, F32(-127.0) / signed_max, F32(0.0)).astype(F32)
        q = np.minimum(np.rint(blocks * iscale), F32(127.0))
        d = np.where(iscale != 0, F32(1.0) / iscale, F32(0.0)).astype(F32)
    q *= d  # ggml scales each integer block sum by d instead: the same up to float32 rounding (~1e-7)
    return q.reshape(rows, n)


# ---------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------

@dataclass
class GgmlMatrix:
    """A quantized matmul weight with the activation format ggml pairs it with.

    ``scaled`` [n_out, n_in] is ``q * d`` per element (exact in float32); ``block_min`` [n_out, n_in/32] is the
    per-block minimum of Q4_1/Q5_1 (None for other types, whose dequantized value is all of ``scaled``)."""

    scaled: np.ndarray
    block_min: np.ndarray | None
    vec_dot: str
    #: float32 ``scaled.T`` laid out contiguously, for the one-token product (see the numpy backend)
    scaled_t: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.scaled.shape

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows ``ids`` (a ``get_rows`` on a tied embedding table)."""
        ids = np.asarray(ids, dtype=np.intp)
        out = self.scaled[ids]
        if self.block_min is not None:
            out = (out.reshape(*out.shape[:-1], -1, Q8_BLOCK) + self.block_min[ids][..., None]).reshape(out.shape)
        dequantized: np.ndarray = out.astype(F32, copy=False)
        return dequantized

    def matmul(self, x: np.ndarray, quantize: bool = True) -> np.ndarray:
        """``x @ W.T`` the way ggml computes it for this weight type (``quantize=False``: exact float32)."""
        lead, n_in = x.shape[:-1], x.shape[-1]
        rows = np.ascontiguousarray(x, dtype=F32).reshape(-1, n_in)
        min_term = None
        if not quantize:
            xq = rows
            if self.block_min is not None:
                min_term = rows.reshape(rows.shape[0], -1, Q8_BLOCK).sum(axis=-1, dtype=F32) @ self.block_min.T
        elif self.vec_dot in ("q8_0", "q8_1"):
            xq, sums, d = quantize_q8(rows)
            if self.block_min is not None:
                min_term = q8_1_block_sums(sums, d) @ self.block_min.T
        elif self.vec_dot == "q8_k":
            xq = quantize_q8_k(rows)
        elif self.vec_dot == "f16":
            xq = round_f16(rows)
        elif self.vec_dot == "bf16":
            xq = round_bf16(rows)
        else:
            xq = rows
        out = xq @ self.scaled_t if self.scaled_t is not None else xq @ self.scaled.T
        if min_term is not None:
            out += min_term
        product: np.ndarray = out.reshape(*lead, out.shape[-1])
        return product  # explicit width: a ubatch may select no output rows


def _scaled_part(raw: np.ndarray, qtype: GGMLType, ne: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
    """``(q * d, m)`` for a weight: Q4_1/Q5_1 blocks are decoded with their ``m`` zeroed (so ``q*d + 0`` is the
    exact product) and ``m`` returned per block; other types decode to ``scaled`` directly."""
    if qtype not in _TYPES_WITH_BLOCK_MIN:
        return np.ascontiguousarray(dequantize(raw, qtype, ne), dtype=F32), None
    blocks = np.array(raw, dtype=np.uint8, copy=True).reshape(-1, _block_bytes(qtype))
    block_min = blocks[:, 2:4].copy().view(F16).astype(F32).reshape(*reversed(ne[1:]), -1)
    blocks[:, 2:4] = 0
    return np.ascontiguousarray(dequantize(blocks.reshape(-1), qtype, ne), dtype=F32), block_min


def _block_bytes(qtype: GGMLType) -> int:
    from llmfw.core.format.quants import type_info

    return type_info(qtype).type_size


# ---------------------------------------------------------------------------------------------------------
# attention, as ggml's non-flash path computes it
# ---------------------------------------------------------------------------------------------------------

#: below this magnitude f16 values are subnormal: multiples of 2**-24
_F16_MIN_NORMAL = F32(2.0 ** -14)
_F16_MAX = 65504.0
_SUBNORMAL_ROUNDER = F32(0.75)


def round_f16(x: np.ndarray) -> np.ndarray:
    """float32 → f16 → float32 (round to nearest even, like F16C's ``_mm256_cvtps_ph``).

    Done on the float32 bits (keep 10 mantissa bits, ties to even; subnormals by rounding to multiples of
    2**-24): the same values as ``astype(float16).astype(float32)``, faster on the large attention
    probability matrices. Out-of-range or non-finite input takes numpy's conversion (inf, NaN)."""
    x = np.ascontiguousarray(x, dtype=F32)
    if x.size == 0 or not float(np.abs(x).max()) < _F16_MAX:
        with np.errstate(over="ignore", invalid="ignore"):
            return x.astype(F16).astype(F32)
    bits = x.view(np.uint32)
    rounded = (bits + (np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1)))) & np.uint32(0xFFFFE000)
    # subnormal range: float32 addition of 0.75 (whose ulp is 2**-24) rounds to a multiple of 2**-24, to even
    subnormal = x + _SUBNORMAL_ROUNDER
    subnormal -= _SUBNORMAL_ROUNDER
    return np.where(np.abs(x) < _F16_MIN_NORMAL, subnormal, rounded.view(F32))


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → bf16 → float32, rounding to nearest even like ``GGML_FP32_TO_BF16`` (NaNs aside)."""
    bits = np.ascontiguousarray(x, dtype=F32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(F32)


def ggml_attention(q: np.ndarray, kv: NumpyKV, mask: np.ndarray, scale: float, softcap: float,
                   f16_inputs: bool, limits: list[tuple[int, int, int]]) -> np.ndarray:
    """``softmax(scale * f16(q)·K + mask) → f16 → ·V`` per block of query rows → [T, H*Dv].

    K and V hold f16 values already (the cache rounds on write). ``f16_inputs=False`` keeps q and the
    probabilities in float32 (to measure this step alone)."""
    n_tokens, n_head, _ = q.shape
    dv = kv.v.shape[-1]
    if f16_inputs:
        q = round_f16(q)
    out = np.empty((n_tokens, n_head * dv), dtype=F32)
    for start, stop, n_cols in limits:
        out[start:stop] = _ggml_attention_block(q[start:stop], kv, n_cols, mask[start:stop], scale, softcap,
                                                f16_inputs)
    return out


def _ggml_attention_block(q: np.ndarray, kv: NumpyKV, n_cols: int, mask: np.ndarray, scale: float,
                          softcap: float, f16_inputs: bool) -> np.ndarray:
    n_tokens = q.shape[0]
    scores = np.matmul(group_queries(q, kv.k.shape[0]), kv.k[:, :n_cols].transpose(0, 2, 1))  # [Hkv, G*t, n]
    scores *= F32(scale)  # soft_max_ext's scale, after the f16 product
    masked_exp(scores, mask[:, :n_cols], softcap, n_tokens)
    # ggml_vec_soft_max_f32 sums in double and scales the row by float(1/sum) before the f16 conversion
    inverse = (1.0 / scores.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(F32)
    scores *= inverse
    probs = round_f16(scores) if f16_inputs else scores
    return ungroup_heads(np.matmul(probs, kv.v[:, :n_cols]), n_tokens)  # [Hkv, G*t, Dv] -> [t, H*Dv]


#: ggml's GELU table covers (-10, 10); outside it GELU is 0 or the identity
_GELU_TABLE_LIMIT = F32(10.0)


def ggml_gelu(x: np.ndarray) -> np.ndarray:
    """``ggml_vec_gelu_f32`` with ``GGML_GELU_FP16``: the tanh GELU of ``f16(x)`` looked up as an f16 value."""
    table = round_f16(gelu(round_f16(x)))
    return np.where(x <= -_GELU_TABLE_LIMIT, F32(0.0), np.where(x >= _GELU_TABLE_LIMIT, x, table)).astype(F32)


# ---------------------------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------------------------

class GgmlOptions(BackendOptions):
    """``backend_options={"ggml": {...}}``: each emulation can be switched off alone (to measure its
    contribution; all on = llama.cpp)."""

    quantize_activations: bool = True
    f16_kv_cache: bool = True
    f16_attention: bool = True
    f16_gelu: bool = True


class GgmlBackend(NumpyBackend):
    """The numpy backend with ggml-cpu's roundings: 8-bit activations in quantized matmuls, an f16 KV cache and
    f16 attention products (see the module docstring)."""

    name = "ggml"
    #: a fidelity study of ggml's kernels, not a default (see the module docstring)
    default_priority: ClassVar[dict[str, int]] = {}
    options_schema = GgmlOptions

    def __init__(self, device: str | None = None, options: BackendOptions | None = None):
        super().__init__(device, options)
        ggml = self.options_as(GgmlOptions)
        self.quantize_activations = ggml.quantize_activations
        self.f16_kv_cache = ggml.f16_kv_cache
        self.f16_attention = ggml.f16_attention
        self.f16_gelu = ggml.f16_gelu
        self._matrix_by_source: dict[str, GgmlMatrix] = {}

    def load_weight(self, source: WeightSource) -> Any:
        qtype = GGMLType(source.ggml_type)
        vec_dot = _VEC_DOT_TYPE.get(qtype)
        if "mul_mat" not in source.usage or vec_dot is None or len(source.ne) != 2:
            return super().load_weight(source)  # F32 matrices, norms, biases, lookup-only tables
        matrix = self._matrix_by_source.get(source.source_name)
        if matrix is None:
            scaled, block_min = _scaled_part(source.raw, qtype, source.ne)
            # a matrix with at least as many outputs as inputs multiplies a single token faster transposed
            scaled_t = np.ascontiguousarray(scaled.T) if source.ne[1] >= source.ne[0] else None
            matrix = GgmlMatrix(scaled if scaled_t is None else scaled_t.T, block_min, vec_dot, scaled_t)
            self._matrix_by_source[source.source_name] = matrix
        return matrix

    def free_weights(self) -> None:
        super().free_weights()
        self._matrix_by_source.clear()

    def compile(self, split: Split, kv: Mapping[tuple[str, int], Any]) -> CompiledSplit:
        return _GgmlSplitCompiler(self, split, kv).compile()


class _GgmlSplitCompiler(SplitCompiler):
    """The numpy split compiler with ggml's mul_mat, KV writes and attention."""

    backend: GgmlBackend

    def _op_mul_mat(self, node: Node, ins: list[int], out: int) -> Step:
        handle = self.backend.weight(node.inputs[0].attr_str("name")) if node.inputs[0].op == "weight" else None
        if not isinstance(handle, GgmlMatrix):
            return super()._op_mul_mat(node, ins, out)
        env, x_slot, quantize = self.env, ins[1], self.backend.quantize_activations

        def step() -> None:
            env[out] = handle.matmul(env[x_slot], quantize)

        return step

    def _op_get_rows(self, node: Node, ins: list[int], out: int) -> Step:
        table = self.backend.weight(node.inputs[0].attr_str("name")) if node.inputs[0].op == "weight" else None
        if not isinstance(table, GgmlMatrix):
            return super()._op_get_rows(node, ins, out)
        env, ids_slot = self.env, ins[1]

        def step() -> None:
            env[out] = table.rows(env[ids_slot])

        return step

    def _op_gelu(self, node: Node, ins: list[int], out: int) -> Step:
        return self._unary(ggml_gelu if self.backend.f16_gelu else gelu, ins, out)

    def _write_kv(self, storage: NumpyKV, k: np.ndarray, v: np.ndarray, idx: np.ndarray) -> None:
        if self.backend.f16_kv_cache:
            k, v = round_f16(k), round_f16(v)
        write_kv(storage, k, v, idx)

    def _attend(self, q: np.ndarray, storage: NumpyKV, mask: np.ndarray, scale: float, softcap: float,
                limits: list[tuple[int, int, int]]) -> np.ndarray:
        return ggml_attention(q, storage, mask, scale, softcap, self.backend.f16_attention, limits)

    def _op_k_shift(self, node: Node, ins: list[int], out: int) -> Step:
        shift_step = super()._op_k_shift(node, ins, out)
        if not self.backend.f16_kv_cache:
            return shift_step
        storage = self.kv_storage(node)

        def step() -> None:
            shift_step()  # ggml re-ropes K in float32 and stores the result back into the f16 cache
            storage.k[...] = round_f16(storage.k)

        return step
