"""The ONNX Runtime backend: each graph split becomes one ONNX model run by an InferenceSession.

Weights are converted once, at load, into the forms ONNX Runtime runs fastest (``shared/PERF-NOTES.md``):

* A quantized matrix becomes ``MatMulNBits`` blocks (com.microsoft, ``accuracy_level=4``: the activations are
  quantized to int8 per block, as llama.cpp does inside its quantized matmuls). The map is exact for every type
  of the real models: Q4_0 → 4-bit codes; Q8_0, Q5_0 → 8-bit codes; Q4_1, Q4_K → 4-bit codes plus a per-block
  *offset* applied as ``blocksum(x) @ offsets.T`` (llama.cpp's Q8_1 block sums do the same; ORT's float zero
  points take a path ~50x slower); Q5_1, Q5_K → 8-bit codes plus offsets; Q6_K → 8-bit codes in blocks of 16
  (its sub-block scales). Other quantized types (Q2_K, Q3_K, IQ...) are requantized once to 8-bit blocks of 32,
  an error far below the type's own quantization step.
* Float matrices stay float32 (``Gemm`` / ``MatMul``); norms, biases and rope factors are float32 initializers.
* An embedding table used by ``get_rows`` keeps one byte per element (int8 codes + per-block scales) and rows
  are decoded in the graph.

Weights reach sessions as external initializers (``SessionOptions.add_external_initializers``), so a model is
never serialized with its weights and all sessions share one copy of the packed bytes.

The KV cache of a layer is a pair of float32 arrays ``[n_head_kv, n_cells, head_dim]``. The ``attention`` node
writes the ubatch's K/V rows with ``ScatterND`` whose input and output are bound (IOBinding) to the *same*
buffer, so ONNX Runtime updates the cache in place — no cache-sized copy per token.

One session serves a split structure for every ubatch size and every KV length: token counts and ``n_kv`` are
dynamic axes (the graph's reshapes use ``-1`` for the token axis); sessions are cached per structure.
``onnxruntime`` and ``onnx`` are imported only by this module, only when the backend is used.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from llmfw.core.backend import Backend, BackendOptions, CompiledSplit, KVLayerShape, Split, WeightSource
from llmfw.core.errors import BackendUnavailable, ModelError
from llmfw.core.graph import OPS, Node
from llmfw.core.quants import GGMLType, block_view, dequantize, k4_sub_block_params
from llmfw.core.rope import yarn_corr_dims

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install onnxruntime onnx (core dependencies of llmfw)"
F32 = np.float32

#: elements per MatMulNBits block (ggml's 32-element blocks map onto it one to one)
BLOCK = 32
#: ONNX opset of the default domain; com.microsoft ops are version 1
OPSET = 17
#: ONNX element types used in the graphs (constants here: the module must import without onnx)
_ONNX_FLOAT, _ONNX_INT64 = 1, 7  # onnx.TensorProto.FLOAT, INT64
#: sessions kept per backend (one per split structure: decode, prefill, mixed placements...)
MAX_SESSIONS = 16


# ---------------------------------------------------------------------------------------------------------------
# lazy imports
# ---------------------------------------------------------------------------------------------------------------

def import_onnxruntime() -> tuple[Any, Any]:
    """``(onnxruntime, onnx)``, imported on first use; BackendUnavailable naming the extra when missing."""
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailable(f"the onnx backend needs onnxruntime and onnx, which are not installed ({exc}); "
                                 f"install them with: {INSTALL_HINT}") from exc
    return onnxruntime, onnx


def execution_providers(device: str | None) -> list[str]:
    """The ONNX Runtime execution providers for a device spec: ``None``/``"cpu"`` or ``"cuda"``."""
    ort, _ = import_onnxruntime()
    if device in (None, "cpu"):
        return ["CPUExecutionProvider"]
    if device == "cuda" or device.startswith("cuda:"):
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise BackendUnavailable(f"onnx backend device {device!r} needs onnxruntime's CUDAExecutionProvider "
                                     f"(pip install onnxruntime-gpu); this onnxruntime {ort.__version__} has "
                                     f"{', '.join(available)}")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    raise BackendUnavailable(f"onnx backend: unknown device {device!r}; expected 'cpu' or 'cuda[:N]'")


# ---------------------------------------------------------------------------------------------------------------
# weight forms
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class BlockWeight:
    """A matrix [n_out, n_in] as integer codes in blocks of ``block`` (16 or 32) consecutive elements of a row:

    ``W[r, block*b + j] = codes[r, block*b + j] * scales[r, b] (+ offsets[r, b])``, codes signed with ``bits``
    bits. ``packed`` is MatMulNBits' ``B`` (unsigned code ``codes + 2**(bits-1)``, two 4-bit codes per byte low
    nibble first); ``codes`` (int8) is kept only for ``get_rows`` tables.
    """

    shape: tuple[int, int]
    bits: int
    scales: np.ndarray
    offsets: np.ndarray | None
    packed: np.ndarray | None = None
    codes: np.ndarray | None = None
    #: True when ``W`` reproduces ggml's dequantized values (up to float rounding); False when requantized
    exact: bool = True
    source_type: str = ""
    block: int = BLOCK

    @property
    def n_blocks(self) -> int:
        return self.shape[1] // self.block


@dataclass
class DenseWeight:
    """A float32 tensor (norm weights, biases, rope factors, float matrices)."""

    array: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape


Weight = BlockWeight | DenseWeight

#: value = code * d, d the block's leading f16 → bits needed for the code
_SYMMETRIC_EXACT = {GGMLType.Q4_0: 4, GGMLType.Q8_0: 8, GGMLType.Q5_0: 8}
#: value = q * d + m with q ≥ 0 (d, m leading f16s) → (bits, centre subtracted from q to make a signed code)
_AFFINE_EXACT = {GGMLType.Q4_1: (4, 8), GGMLType.Q5_1: (8, 16)}
#: K-quants whose 32-element sub-blocks are value = d1 * q - m1 → (bits, centre)
_K4_EXACT = {GGMLType.Q4_K: (4, 8), GGMLType.Q5_K: (8, 16)}
#: requantized types with a per-(sub)block minimum: an asymmetric 8-bit grid fits them better
_AFFINE_REQUANT = {GGMLType.Q2_K}
_FLOAT_TYPES = {GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.F64}
#: Q6_K: 16-element sub-blocks, value = d * scale_j * (q - 32); int8 scales at byte 192, d (f16) at 208
Q6_K_SUB_BLOCK, Q6_K_SCALES_AT, Q6_K_D_AT = 16, 192, 208


def _block_header_f16(source: WeightSource, offset: int) -> np.ndarray:
    """The f16 at byte ``offset`` of every block, as float32 [n_rows, n_blocks_per_row]."""
    blocks = block_view(source.raw, source.ggml_type, source.ne)
    n_blocks = blocks.shape[-2]
    header = np.ascontiguousarray(blocks.reshape(-1, blocks.shape[-1])[:, offset:offset + 2])
    return header.view(np.float16).astype(F32).reshape(-1, n_blocks)


def _safe_reciprocal(d: np.ndarray) -> np.ndarray:
    out = np.zeros_like(d)
    np.divide(1.0, d, out=out, where=d != 0)
    return out


def block_codes(source: WeightSource) -> BlockWeight:
    """Integer codes + per-block scales (+ offsets) for a quantized matrix, exact where the type allows."""
    qtype = GGMLType(source.ggml_type)
    n_in = int(source.ne[0])
    if n_in % BLOCK:
        raise ModelError(f"onnx backend: {source.name} rows have {n_in} elements, not a multiple of {BLOCK}")
    n_out = int(np.prod(source.ne[1:], dtype=np.int64))
    shape = (n_out, n_in)
    direct = _stored_codes(source, qtype, shape)
    if direct is not None:  # Q4_0 / Q4_1 / Q8_0: the codes are in the bytes, no float round trip
        return _stored_block_weight(source, shape, codes=direct)
    values = dequantize(source.raw, qtype, source.ne).reshape(shape)
    if qtype in _SYMMETRIC_EXACT:
        return codes_from_values(values, _block_header_f16(source, 0), bits=_SYMMETRIC_EXACT[qtype],
                                 source_type=qtype.name)
    if qtype in _AFFINE_EXACT:
        bits, centre = _AFFINE_EXACT[qtype]
        return codes_from_values(values, _block_header_f16(source, 0), bits=bits, base=_block_header_f16(source, 2),
                                 centre=centre, source_type=qtype.name)
    if qtype in _K4_EXACT:
        bits, centre = _K4_EXACT[qtype]
        d1, m1 = k4_sub_block_params(source.raw, qtype, source.ne)
        return codes_from_values(values, d1, bits=bits, base=-m1, centre=centre, source_type=qtype.name)
    if qtype == GGMLType.Q6_K:
        return codes_from_values(values, _q6_k_scales(source, n_out), bits=8, block=Q6_K_SUB_BLOCK,
                                 source_type=qtype.name)
    return requantize_8bit(values.reshape(n_out, -1, BLOCK), shape, asymmetric=qtype in _AFFINE_REQUANT,
                           source_type=qtype.name)


def _stored_block_weight(source: WeightSource, shape: tuple[int, int], *, codes: np.ndarray | None = None,
                         packed: np.ndarray | None = None) -> BlockWeight:
    """Q4_0 / Q4_1 / Q8_0: scales (and Q4_1's offsets) from the block headers, with codes and/or packed bytes."""
    qtype = GGMLType(source.ggml_type)
    d = _block_header_f16(source, 0)
    offsets = _block_header_f16(source, 2) + F32(8.0) * d if qtype == GGMLType.Q4_1 else None
    bits = 8 if qtype == GGMLType.Q8_0 else 4
    return BlockWeight(shape, bits, d, offsets, packed=packed, codes=codes, exact=True, source_type=qtype.name)


def block_weight_of_packed(source: WeightSource, packed: np.ndarray) -> BlockWeight:
    n_out, n_blocks = packed.shape[:2]
    return _stored_block_weight(source, (n_out, n_blocks * BLOCK), packed=packed)


def codes_from_values(values: np.ndarray, scales: np.ndarray, *, bits: int, base: np.ndarray | None = None,
                      centre: int = 0, block: int = BLOCK, source_type: str = "") -> BlockWeight:
    """The exact codes of values known to lie on a per-block grid ``scale * q (+ base)``, q integer.

    ``values`` [n_out, n_in] (ggml's dequantization), ``scales`` / ``base`` [n_out, n_in // block]. The code is
    ``q - centre`` (signed); the offset ``base + centre * scale`` restores the values.
    """
    n_out, n_in = values.shape
    blocked = values.reshape(n_out, n_in // block, block)
    if base is not None:
        blocked = blocked - base[..., None]
    codes = np.rint(blocked * _safe_reciprocal(scales)[..., None]) - centre
    offsets = None if base is None else base + F32(centre) * scales
    return _finish((n_out, n_in), bits, codes, scales, offsets, True, source_type, block)


def _q6_k_scales(source: WeightSource, n_out: int) -> np.ndarray:
    """Q6_K's per-16-element scales d * scale_j, float32 [n_out, n_in // 16] (ggml multiplies the same way)."""
    blocks = block_view(source.raw, source.ggml_type, source.ne)
    blocks = blocks.reshape(-1, blocks.shape[-1])
    d = np.ascontiguousarray(blocks[:, Q6_K_D_AT:Q6_K_D_AT + 2]).view(np.float16).astype(F32)
    sub_scales = blocks[:, Q6_K_SCALES_AT:Q6_K_SCALES_AT + 16].view(np.int8).astype(F32)
    return (d * sub_scales).reshape(n_out, -1)


def _stored_codes(source: WeightSource, qtype: GGMLType, shape: tuple[int, int]) -> np.ndarray | None:
    """Signed codes [n_out, n_in] read straight from the blocks of the types that store them plainly."""
    if qtype not in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1):
        return None
    blocks = block_view(source.raw, qtype, source.ne).reshape(shape[0], shape[1] // BLOCK, -1)
    if qtype == GGMLType.Q8_0:  # d | 32 int8
        return np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(shape)
    # d (| m) | 16 bytes: element j in the low nibble of byte j, element j+16 in its high nibble; code q - 8
    nibbles = blocks[..., 2 if qtype == GGMLType.Q4_0 else 4:]
    q = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=-1).view(np.int8)
    q -= np.int8(8)
    return q.reshape(shape)


def requantize_8bit(values: np.ndarray, shape: tuple[int, int], asymmetric: bool,
                    source_type: str = "") -> BlockWeight:
    """8-bit codes of float values [n_out, n_blocks, 32]: symmetric (absmax/127) or centred on the block's
    (min+max)/2 with step (max-min)/254."""
    if asymmetric:
        lo, hi = values.min(axis=-1), values.max(axis=-1)
        offsets = ((hi + lo) * F32(0.5)).astype(F32)
        scales = ((hi - lo) / F32(254.0)).astype(F32)
        centred = values - offsets[..., None]
    else:
        offsets = None
        scales = (np.abs(values).max(axis=-1) / F32(127.0)).astype(F32)
        centred = values
    codes = np.rint(centred * _safe_reciprocal(scales)[..., None])
    return _finish(shape, 8, codes, scales, offsets, False, source_type, BLOCK)


def _finish(shape: tuple[int, int], bits: int, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None,
            exact: bool, source_type: str, block: int) -> BlockWeight:
    limit = 1 << (bits - 1)
    codes = np.clip(codes, -limit, limit - 1).astype(np.int8).reshape(shape)
    return BlockWeight(shape, bits, np.ascontiguousarray(scales, dtype=F32),
                       None if offsets is None else np.ascontiguousarray(offsets, dtype=F32),
                       codes=codes, exact=exact, source_type=source_type, block=block)


def pack_nbits(codes: np.ndarray, bits: int, block: int = BLOCK) -> np.ndarray:
    """MatMulNBits' B: uint8 [n_out, n_blocks, block*bits/8], codes shifted to unsigned (zero point
    2**(bits-1))."""
    n_out, n_in = codes.shape
    # code + 2**(bits-1) in wrapping uint8 arithmetic: no int16 copy of the matrix
    unsigned = (codes.view(np.uint8) + np.uint8(1 << (bits - 1))).reshape(n_out, n_in // block, block)
    if bits == 8:
        return unsigned
    # consecutive elements two per byte, the first in the low nibble
    return unsigned[..., 0::2] | (unsigned[..., 1::2] << np.uint8(4))


def packed_from_blocks(source: WeightSource) -> np.ndarray | None:
    """MatMulNBits' B straight from the bytes of the types whose blocks store it almost as is (Q4_0, Q4_1, Q8_0),
    without the int8 code matrix in between: the load's largest cost on a 4-bit model was that round trip.

    Q4_x keeps element j in the low nibble of byte j and element j+16 in its high nibble, unsigned (code + 8 is
    the stored nibble); MatMulNBits wants elements 2k, 2k+1 in byte k. Q8_0's int8 codes only flip their sign
    bit (code + 128)."""
    qtype = GGMLType(source.ggml_type)
    if qtype not in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1):
        return None
    n_in = int(source.ne[0])
    n_out = int(np.prod(source.ne[1:], dtype=np.int64))
    blocks = block_view(source.raw, qtype, source.ne).reshape(n_out, n_in // BLOCK, -1)
    if qtype == GGMLType.Q8_0:
        return blocks[..., 2:] ^ np.uint8(0x80)
    nibbles = blocks[..., 2 if qtype == GGMLType.Q4_0 else 4:]
    even, odd = nibbles[..., 0::2], nibbles[..., 1::2]
    first_half = (even & np.uint8(0x0F)) | (odd << np.uint8(4))        # elements 0..15: low nibbles
    second_half = (even >> np.uint8(4)) | (odd & np.uint8(0xF0))       # elements 16..31: high nibbles
    return np.concatenate([first_half, second_half], axis=-1)


def dequantize_block_weight(w: BlockWeight) -> np.ndarray:
    """The float32 matrix a BlockWeight stands for (tests and error measurements)."""
    codes = w.codes if w.codes is not None else _unpack_nbits(w.packed, w.bits)
    n_out, n_in = w.shape
    values = codes.reshape(n_out, -1, w.block).astype(F32) * w.scales[..., None]
    if w.offsets is not None:
        values += w.offsets[..., None]
    return values.reshape(n_out, n_in)


def _unpack_nbits(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        unsigned = packed
    else:
        unsigned = np.stack([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=-1)
    return (unsigned.reshape(packed.shape[0], -1).astype(np.int16) - (1 << (bits - 1))).astype(np.int8)


def convert_weight(source: WeightSource) -> Weight:
    """The ONNX-side form of one GGUF tensor, chosen from its type and what the graph does with it."""
    qtype = GGMLType(source.ggml_type)
    usage = source.usage
    is_matrix = len(source.ne) == 2 or (len(source.ne) > 2 and all(int(d) == 1 for d in source.ne[2:]))
    if qtype in _FLOAT_TYPES or not is_matrix or not (usage & {"mul_mat", "get_rows"} or not usage):
        array = np.ascontiguousarray(dequantize(source.raw, qtype, source.ne), dtype=F32)
        if np.shares_memory(array, source.raw):
            array = array.copy()
        return DenseWeight(array.reshape(array.shape[-2:]) if is_matrix and array.ndim > 2 else array)
    lookups = not usage or "get_rows" in usage
    packed = None if lookups else packed_from_blocks(source)
    if packed is not None:  # a matmul-only Q4_0 / Q4_1 / Q8_0 matrix: no codes needed at all
        return block_weight_of_packed(source, packed)
    weight = block_codes(source)
    if "mul_mat" in usage or not usage:
        weight.packed = pack_nbits(weight.codes, weight.bits, weight.block)
    if not lookups:
        weight.codes = None  # only the packed form is needed; halves the memory of 4-bit matrices
    return weight


def fuse_block_weights(parts: Sequence[BlockWeight]) -> BlockWeight:
    """Stack matrices that multiply the same input into one [sum n_out, n_in] (one MatMulNBits call)."""
    bits = parts[0].bits
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in parts])
    return BlockWeight(
        shape=(sum(p.shape[0] for p in parts), parts[0].shape[1]), bits=bits,
        scales=np.concatenate([p.scales for p in parts]), offsets=offsets,
        packed=np.concatenate([p.packed for p in parts]), exact=all(p.exact for p in parts),
        source_type="+".join(sorted({p.source_type for p in parts})), block=parts[0].block)


def _share_rows(fused: BlockWeight, parts: Sequence[BlockWeight]) -> None:
    """Point each part's arrays at its rows of the fused copy, so the fusion costs no memory (sessions built
    earlier keep the old arrays alive through their OrtValues)."""
    start = 0
    for part in parts:
        rows = slice(start, start + part.shape[0])
        part.packed, part.scales = fused.packed[rows], fused.scales[rows]
        if part.offsets is not None:
            part.offsets = fused.offsets[rows]
        start = rows.stop


# ---------------------------------------------------------------------------------------------------------------
# rope tables (ggml_rope_ext semantics: NORM/NEOX, YaRN, freq_factors)
# ---------------------------------------------------------------------------------------------------------------

def rope_frequencies(attrs: Mapping[str, Any], freq_factors: np.ndarray | None) -> tuple[np.ndarray, float]:
    """Per rotated pair i: the angle per position ``theta_i`` (theta = pos * theta_i) and the magnitude scale.

    ggml's angle is linear in the position for every pair — ``freq_scale`` interpolation, the YaRN ramp and the
    frequency factors only change its slope — so one float32 vector folds all of them.
    """
    n_dims = int(attrs["n_dims"])
    half = n_dims // 2
    freq_base, freq_scale = float(attrs["freq_base"]), float(attrs.get("freq_scale", 1.0))
    ext_factor = float(attrs.get("ext_factor", 0.0) or 0.0)
    extrap = float(freq_base) ** (-2.0 * np.arange(half, dtype=np.float64) / n_dims)
    if freq_factors is not None:
        extrap = extrap / np.asarray(freq_factors, dtype=np.float64).reshape(-1)[:half]
    mscale = float(attrs.get("attn_factor", 1.0))
    if ext_factor != 0.0:
        low, high = yarn_corr_dims(n_dims, int(attrs["n_ctx_orig"]), freq_base, float(attrs["beta_fast"]),
                                   float(attrs["beta_slow"]))
        y = (np.arange(half, dtype=np.float64) - low) / max(0.001, high - low)
        ramp_mix = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
        slope = freq_scale * extrap * (1.0 - ramp_mix) + extrap * ramp_mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    else:
        slope = freq_scale * extrap
    return slope.astype(F32), mscale


# ---------------------------------------------------------------------------------------------------------------
# KV storage
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class OnnxKV:
    """K and V of one layer, ``[n_head_kv, n_cells, head_dim]`` float32 (each head's cells contiguous, so a
    prefix of cells is a cheap slice), with OrtValues sharing their memory (bound as both input and output of
    the in-place ScatterND)."""

    k: np.ndarray
    v: np.ndarray
    k_value: Any = None
    v_value: Any = None


# ---------------------------------------------------------------------------------------------------------------
# split → ONNX model
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class _Program:
    """One ONNX model built from a split structure, and its session."""

    session: Any
    input_names: list[str]            # split.input_ids order
    output_names: list[str]           # split.output_ids order
    kv_bindings: list[tuple[str, str, tuple[str, int], str]]  # (input, output, kv key, "k"|"v")
    node_count: int = 0               # ONNX nodes before ORT's own fusions (diagnostics)


@dataclass
class _Emitter:
    """Accumulates ONNX nodes, small constants and external weights while a split is translated."""

    helper: Any
    numpy_helper: Any
    nodes: list[Any] = field(default_factory=list)
    constants: list[Any] = field(default_factory=list)
    externals: dict[str, np.ndarray] = field(default_factory=dict)
    _counter: Any = field(default_factory=itertools.count)
    _const_cache: dict[tuple, str] = field(default_factory=dict)

    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._counter)}"

    def op(self, op_type: str, inputs: Sequence[str], n_outputs: int = 1, domain: str = "",
           hint: str | None = None, **attrs: Any) -> Any:
        outputs = [self.fresh(hint or op_type.lower()) for _ in range(n_outputs)]
        self.nodes.append(self.helper.make_node(op_type, list(inputs), outputs, domain=domain or None, **attrs))
        return outputs[0] if n_outputs == 1 else outputs

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        """A small constant initializer embedded in the model (deduplicated)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        name = self._const_cache.get(key)
        if name is None:
            name = self._const_cache[key] = self.fresh("c")
            self.constants.append(self.numpy_helper.from_array(array, name))
        return name

    def external(self, name: str, array: np.ndarray) -> str:
        """A weight initializer whose bytes are handed to the session, not serialized."""
        self.externals[name] = array
        return name


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    return value


def split_signature(split: Split, inputs: Sequence[np.ndarray]) -> tuple:
    """A hashable key equal for two splits that translate to the same ONNX model: ops, wiring, attributes,
    weight names and input dtypes/ranks — not token counts or KV lengths (dynamic axes)."""
    local: dict[int, Any] = {nid: ("in", k) for k, nid in enumerate(split.input_ids)}
    items = []
    for k, node in enumerate(split.nodes):
        local[node.id] = k
        items.append((node.op, tuple(local.get(i.id, ("ext", i.op, i.attrs.get("name"))) for i in node.inputs),
                      _freeze(node.attrs)))
    return (tuple(items), tuple(local[i] for i in split.output_ids),
            tuple((a.dtype.str, a.ndim) for a in inputs))


class _SplitTranslator:
    """Translates one split into ONNX nodes. Shapes seen on the first run guide choices that do not depend on
    the token count or the KV length (head sizes, rotated dims); the model itself keeps those axes dynamic."""

    def __init__(self, backend: "OnnxBackend", split: Split, inputs: Sequence[np.ndarray],
                 kv: Mapping[tuple[str, int], Any]):
        import_onnxruntime()
        from onnx import helper, numpy_helper

        self.backend = backend
        self.split = split
        self.kv = kv
        self.e = _Emitter(helper, numpy_helper)
        self.names: dict[int, str] = {}
        self.shapes: dict[int, tuple[int, ...]] = {}
        self.graph_inputs: list[Any] = []
        self.graph_outputs: list[Any] = []
        self.kv_bindings: list[tuple[str, str, tuple[str, int], str]] = []
        self._kv_current: dict[tuple[tuple[str, int], str], str] = {}
        self._shared: dict[tuple, Any] = {}
        self._last_kv_writer: dict[tuple[tuple[str, int], str], int] = {}
        self._kv_declared: set[str] = set()
        self._fused: dict[int, str] = {}  # mul_mat node id → its part of a fused matmul's output
        self._fused_parts: dict[int, list[Node]] = {}
        for node_id, array in zip(split.input_ids, inputs):
            name = f"in_{node_id}"
            self.names[node_id] = name
            self.shapes[node_id] = array.shape
            dims = [f"{name}_d{i}" for i in range(array.ndim)]
            self.graph_inputs.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(array.dtype), dims))

    # -- driving -----------------------------------------------------------------------------------------
    def translate(self) -> tuple[Any, list[str]]:
        """The ONNX model of the split and the names of its outputs (split.output_ids order)."""
        self._plan_fusion()
        self._mark_last_kv_writers()
        for node in self.split.nodes:
            self._translate_node(node)
        output_names = self._declare_outputs()
        return self._assemble(), output_names

    def _mark_last_kv_writers(self) -> None:
        """The last node writing each cache tensor names its ScatterND output as the bound graph output."""
        for node in self.split.nodes:
            if node.op in ("attention", "k_shift"):
                key = (node.attrs["cache"], int(node.attrs["layer"]))
                for which in ("k", "v") if node.op == "attention" else ("k",):
                    self._last_kv_writer[(key, which)] = node.id

    def _translate_node(self, node: Node) -> None:
        if node.op == "weight":  # emitted by its consumers, in the form each one needs
            self.shapes[node.id] = tuple(self.backend.weight(node.attrs["name"]).shape)
            return
        handler = getattr(self, f"_op_{node.op}", None)
        if handler is None:
            raise ModelError(f"onnx backend: op {node.op!r} is not implemented")
        self.names[node.id] = handler(node)

    def _declare_outputs(self) -> list[str]:
        helper = self.e.helper
        output_names = []
        for node_id in self.split.output_ids:
            name = f"out_{node_id}"
            self.e.nodes.append(helper.make_node("Identity", [self.names[node_id]], [name]))
            output_names.append(name)
            self.graph_outputs.append(helper.make_tensor_value_info(name, _ONNX_FLOAT, None))
        for (key, which), current in self._kv_current.items():
            # the last update's own output is the graph output: bound to the input's buffer, ScatterND skips
            # its copy (an Identity here would copy the whole cache)
            self.graph_outputs.append(helper.make_tensor_value_info(current, _ONNX_FLOAT, None))
            self.kv_bindings.append((_kv_name(key, which), current, key, which))
        return output_names

    def _assemble(self) -> Any:
        helper = self.e.helper
        initializers = list(self.e.constants)
        initializers += [_external_tensor_proto(name, array) for name, array in self.e.externals.items()]
        graph = helper.make_graph(self.e.nodes, "llmfw_split", self.graph_inputs, self.graph_outputs,
                                  initializer=initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                        helper.make_opsetid("com.microsoft", 1)],
                                  producer_name="llmfw")
        model.ir_version = min(model.ir_version, 10)  # what ORT ≥ 1.17 reads
        return model

    def value(self, node: Node) -> str:
        if node.id in self.names:
            return self.names[node.id]
        if node.op == "weight":
            return self.dense(node.attrs["name"])
        raise ModelError(f"onnx backend: value of node {node!r} is not available to its split")

    def shape(self, node: Node) -> tuple[int, ...]:
        return self.shapes[node.id]

    # -- weights -----------------------------------------------------------------------------------------
    def dense(self, name: str) -> str:
        weight = self.backend.weight(name)
        if isinstance(weight, DenseWeight):
            return self.e.external(f"w:{name}", weight.array)
        # a quantized table used elementwise (unusual): hand over its float values once
        return self.e.external(f"w:{name}", self.backend.dense_copy(name))

    # -- fusion of matmuls sharing their input ------------------------------------------------------------
    def _plan_fusion(self) -> None:
        """Group block-quantized mul_mats with the same input (Q/K/V, gate/up) into one MatMulNBits."""
        groups: dict[tuple[int, int, int, int], list[Node]] = {}
        for node in self.split.nodes:
            if node.op != "mul_mat" or node.inputs[0].op != "weight":
                continue
            weight = self.backend.weight(node.inputs[0].attrs["name"])
            if isinstance(weight, BlockWeight) and weight.packed is not None:
                groups.setdefault((node.inputs[1].id, weight.bits, weight.block, weight.shape[1]), []).append(node)
        for members in groups.values():
            if len(members) > 1:
                self._fused_parts[members[0].id] = members

    # -- ops ---------------------------------------------------------------------------------------------
    def _op_mul_mat(self, node: Node) -> str:
        w_node, x_node = node.inputs
        fused = self._fused.get(node.id)
        if fused is not None:  # a later member of a fused group: its part was split off already
            return fused
        x, x_shape = self.value(x_node), self.shape(x_node)
        if w_node.op != "weight":
            # activation × activation (no current architecture emits it): x @ w.T
            self.shapes[node.id] = x_shape[:-1] + (self.shape(w_node)[0],)
            return self.e.op("MatMul", [x, self.e.op("Transpose", [self.value(w_node)], perm=[1, 0])])
        name = w_node.attrs["name"]
        weight = self.backend.weight(name)
        if isinstance(weight, DenseWeight):
            self.shapes[node.id] = x_shape[:-1] + (weight.shape[0],)
            if len(x_shape) == 2:  # Gemm reads W [n_out, n_in] as it is: no transposed copy
                return self.e.op("Gemm", [x, self.e.external(f"w:{name}", weight.array)], transB=1, hint="mm")
            wt = self.e.external(f"wt:{name}", self.backend.transposed(name))
            return self.e.op("MatMul", [x, wt], hint="mm")
        members = self._fused_parts.get(node.id)
        if members is None:
            self.shapes[node.id] = x_shape[:-1] + (weight.shape[0],)
            return self._matmul_nbits(x, x_shape, name, weight)
        names = tuple(m.inputs[0].attrs["name"] for m in members)
        out = self._matmul_nbits(x, x_shape, "+".join(names), self.backend.fused_weight(names))
        sizes = [self.backend.weight(n).shape[0] for n in names]
        parts = self.e.op("Split", [out, self.e.const(sizes)], n_outputs=len(sizes), axis=-1, hint="part")
        for member, part, size in zip(members, parts, sizes):
            self._fused[member.id] = part
            self.shapes[member.id] = x_shape[:-1] + (size,)
        return parts[0]

    def _matmul_nbits(self, x: str, x_shape: tuple[int, ...], key: str, weight: BlockWeight) -> str:
        n_out, n_in = weight.shape
        if x_shape[-1] != n_in:
            raise ModelError(f"onnx backend: mul_mat of {key} expects inputs with {n_in} columns, got {x_shape}")
        b = self.e.external(f"q:{key}", weight.packed)
        s = self.e.external(f"s:{key}", weight.scales)
        out = self.e.op("MatMulNBits", [x, b, s], domain="com.microsoft", hint="mmq", K=n_in, N=n_out,
                        bits=weight.bits, block_size=weight.block, accuracy_level=self.backend.accuracy_level)
        if weight.offsets is None:
            return out
        # per-block offsets: W = codes*scales + offsets ⇒ x @ W.T += blocksum(x) @ offsets.T
        n_blocks = weight.n_blocks
        lead = self.e.op("Shape", [x], end=-1)
        blocked = self.e.op("Reshape", [x, self.e.op("Concat", [lead, self.e.const([n_blocks, weight.block])],
                                                       axis=0)])
        sums = self.e.op("ReduceSum", [blocked, self.e.const([-1])], keepdims=0, hint="blocksum")
        offsets_t = self.e.external(f"oT:{key}", self.backend.offsets_transposed(key, weight))
        if len(x_shape) == 2:  # one Gemm: sums @ offsets.T + out
            return self.e.op("Gemm", [sums, offsets_t, out], hint="mmq")
        return self.e.op("Add", [out, self.e.op("MatMul", [sums, offsets_t])], hint="mmq")

    def _op_get_rows(self, node: Node) -> str:
        table, ids = node.inputs
        ids_name = self.value(ids)
        ids_shape = self.shape(ids)
        if table.op != "weight":
            self.shapes[node.id] = ids_shape + self.shape(table)[1:]
            return self.e.op("Gather", [self.value(table), ids_name], axis=0)
        name = table.attrs["name"]
        weight = self.backend.weight(name)
        self.shapes[node.id] = ids_shape + tuple(weight.shape[1:])
        if isinstance(weight, DenseWeight):
            return self.e.op("Gather", [self.e.external(f"w:{name}", weight.array), ids_name], axis=0)
        if weight.codes is None:
            raise ModelError(f"onnx backend: {name} was loaded for mul_mat only, but the graph looks up its rows")
        n_in = weight.shape[1]
        codes = self.e.op("Cast", [self.e.op("Gather", [self.e.external(f"c:{name}", weight.codes), ids_name],
                                              axis=0)], to=_ONNX_FLOAT)
        blocked = self.e.op("Reshape", [codes, self.e.const([-1, weight.n_blocks, weight.block])])
        scales = self.e.op("Gather", [self.e.external(f"s:{name}", weight.scales), ids_name], axis=0)
        scales = self.e.op("Reshape", [scales, self.e.const([-1, weight.n_blocks, 1])])
        rows = self.e.op("Mul", [blocked, scales])
        if weight.offsets is not None:
            offsets = self.e.op("Gather", [self.e.external(f"o:{name}", weight.offsets), ids_name], axis=0)
            rows = self.e.op("Add", [rows, self.e.op("Reshape", [offsets, self.e.const([-1, weight.n_blocks, 1])])])
        out_shape = self.e.op("Concat", [self.e.op("Shape", [ids_name]), self.e.const([n_in])], axis=0)
        return self.e.op("Reshape", [rows, out_shape], hint="rows")

    def _binary(self, node: Node, op_type: str) -> str:
        a, b = node.inputs
        self.shapes[node.id] = tuple(np.broadcast_shapes(self.shape(a), self.shape(b)))
        return self.e.op(op_type, [self.value(a), self.value(b)])

    def _op_add(self, node: Node) -> str:
        return self._binary(node, "Add")

    def _op_sub(self, node: Node) -> str:
        return self._binary(node, "Sub")

    def _op_mul(self, node: Node) -> str:
        return self._binary(node, "Mul")

    def _unary(self, node: Node, op_type: str, *extra: str, **attrs: Any) -> str:
        (x,) = node.inputs
        self.shapes[node.id] = self.shape(x)
        return self.e.op(op_type, [self.value(x), *extra], **attrs)

    def _op_scale(self, node: Node) -> str:
        return self._unary(node, "Mul", self.e.const(node.attrs["s"], F32))

    def _op_silu(self, node: Node) -> str:
        (x,) = node.inputs
        self.shapes[node.id] = self.shape(x)
        xv = self.value(x)
        return self.e.op("Mul", [xv, self.e.op("Sigmoid", [xv])], hint="silu")

    def _op_relu(self, node: Node) -> str:
        return self._unary(node, "Relu")

    def _op_gelu(self, node: Node) -> str:
        # com.microsoft FastGelu is exactly ggml's tanh approximation 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))
        return self._unary(node, "FastGelu", domain="com.microsoft")

    def _op_softcap(self, node: Node) -> str:
        (x,) = node.inputs
        self.shapes[node.id] = self.shape(x)
        return self._softcap(self.value(x), float(node.attrs["cap"]))

    def _softcap(self, x: str, cap: float) -> str:
        squashed = self.e.op("Tanh", [self.e.op("Mul", [x, self.e.const(1.0 / cap, F32)])])
        return self.e.op("Mul", [squashed, self.e.const(cap, F32)], hint="softcap")

    def _op_clamp(self, node: Node) -> str:
        return self._unary(node, "Clip", self.e.const(node.attrs["min"], F32), self.e.const(node.attrs["max"], F32))

    def _op_rms_norm(self, node: Node) -> str:
        # the canonical pattern (Pow, ReduceMean, Add, Sqrt, Div) that ORT fuses into SimplifiedLayerNormalization
        (x,) = node.inputs
        self.shapes[node.id] = self.shape(x)
        xv = self.value(x)
        mean_sq = self.e.op("ReduceMean", [self.e.op("Pow", [xv, self.e.const(2.0, F32)])], axes=[-1], keepdims=1)
        rms = self.e.op("Sqrt", [self.e.op("Add", [mean_sq, self.e.const(node.attrs["eps"], F32)])])
        return self.e.op("Div", [xv, rms], hint="rms_norm")

    def _op_norm(self, node: Node) -> str:
        (x,) = node.inputs
        self.shapes[node.id] = self.shape(x)
        xv = self.value(x)
        centred = self.e.op("Sub", [xv, self.e.op("ReduceMean", [xv], axes=[-1], keepdims=1)])
        var = self.e.op("ReduceMean", [self.e.op("Pow", [centred, self.e.const(2.0, F32)])], axes=[-1], keepdims=1)
        std = self.e.op("Sqrt", [self.e.op("Add", [var, self.e.const(node.attrs["eps"], F32)])])
        return self.e.op("Div", [centred, std], hint="norm")

    def _op_reshape(self, node: Node) -> str:
        (x,) = node.inputs
        shape = tuple(int(d) for d in node.attrs["shape"])
        self.shapes[node.id] = _reshaped(self.shape(x), shape)
        return self.e.op("Reshape", [self.value(x), self.e.const(shape)])

    def _op_slice(self, node: Node) -> str:
        (x,) = node.inputs
        axis = int(node.attrs.get("axis", -1))
        start, stop = node.attrs.get("start"), node.attrs.get("stop")
        x_shape = self.shape(x)
        shape = list(x_shape)
        shape[axis] = len(range(*slice(start, stop).indices(x_shape[axis])))
        self.shapes[node.id] = tuple(shape)
        big = np.iinfo(np.int64).max
        return self.e.op("Slice", [self.value(x), self.e.const([0 if start is None else start]),
                                   self.e.const([big if stop is None else stop]), self.e.const([axis])])

    # -- values shared by every layer of a split (computed once per run) -----------------------------------
    def shared(self, key: tuple, make: Callable[[], Any]) -> Any:
        value = self._shared.get(key)
        if value is None:
            value = self._shared[key] = make()
        return value

    # -- rope --------------------------------------------------------------------------------------------
    def _rope_table(self, pos: str, attrs: Mapping[str, Any], factors: Node | None) -> tuple[str, str, str]:
        """cos/sin [T, n_dims/2] for a position input and ``arange(T)`` as RotaryEmbedding's position ids:
        the table holds exactly this ubatch's rows (row t = position pos[t])."""
        rope_attrs = {k: v for k, v in attrs.items() if k not in ("layer", "cache")}
        key = ("rope", pos, _freeze(rope_attrs), None if factors is None else factors.attrs.get("name"))
        return self.shared(key, lambda: self._make_rope_table(pos, rope_attrs, factors))

    def _make_rope_table(self, pos: str, attrs: Mapping[str, Any], factors: Node | None) -> tuple[str, str, str]:
        ff = None if factors is None else self.backend.dense_copy(factors.attrs["name"])
        slope, mscale = rope_frequencies(attrs, ff)
        positions = self.e.op("Unsqueeze", [self.e.op("Cast", [pos], to=_ONNX_FLOAT), self.e.const([-1])])
        theta = self.e.op("Mul", [positions, self.e.const(slope, F32)], hint="theta")
        cos, sin = self.e.op("Cos", [theta], hint="cos"), self.e.op("Sin", [theta], hint="sin")
        if mscale != 1.0:
            cos = self.e.op("Mul", [cos, self.e.const(mscale, F32)], hint="cos")
            sin = self.e.op("Mul", [sin, self.e.const(mscale, F32)], hint="sin")
        n = self.e.op("Squeeze", [self.e.op("Shape", [pos], start=0, end=1)])
        row_ids = self.e.op("Unsqueeze", [self.e.op("Range", [self.e.const(0), n, self.e.const(1)]),
                                          self.e.const([0])], hint="rope_rows")
        return cos, sin, row_ids

    def _rotate(self, x: str, n_head: int, head_dim: int, table: tuple[str, str, str], attrs: Mapping[str, Any]
                ) -> str:
        """x [T, H, D] rotated on its first n_dims by com.microsoft RotaryEmbedding (interleaved = NORM mode's
        adjacent pairs, else NEOX halves; dims past n_dims pass through)."""
        cos, sin, row_ids = table
        n_dims = int(attrs["n_dims"])
        extra = {"rotary_embedding_dim": n_dims} if n_dims < head_dim else {}
        flat = self.e.op("Reshape", [x, self.e.const([1, -1, n_head * head_dim])])
        rotated = self.e.op("RotaryEmbedding", [flat, row_ids, cos, sin], domain="com.microsoft", hint="rope",
                            interleaved=int(attrs["mode"] != "neox"), num_heads=n_head, **extra)
        return self.e.op("Reshape", [rotated, self.e.const([-1, n_head, head_dim])])

    def _op_rope(self, node: Node) -> str:
        x, pos = node.inputs[0], node.inputs[1]
        factors = node.inputs[2] if len(node.inputs) > 2 else None
        x_shape = self.shape(x)
        if len(x_shape) != 3:
            raise ModelError(f"onnx backend: rope expects x [T, H, D], got shape {x_shape}")
        self.shapes[node.id] = x_shape
        table = self._rope_table(self.value(pos), node.attrs, factors)
        return self._rotate(self.value(x), x_shape[1], x_shape[2], table, node.attrs)

    # -- KV cache: [n_head_kv, n_cells, head_dim] per layer, updated in place ---------------------------------
    def _kv_input(self, key: tuple[str, int], which: str) -> str:
        """The current value of a cache tensor: the bound graph input, or the last in-place update of it."""
        current = self._kv_current.get((key, which))
        if current is not None:
            return current
        name = _kv_name(key, which)
        if name not in self._kv_declared:
            storage: OnnxKV = self.kv[key]
            array = storage.k if which == "k" else storage.v
            dims = [array.shape[0], f"{name}_cells", array.shape[2]]
            self.graph_inputs.append(self.e.helper.make_tensor_value_info(name, _ONNX_FLOAT, dims))
            self._kv_declared.add(name)
        return name

    def _kv_write(self, node: Node, key: tuple[str, int], which: str, index: str, rows: str) -> str:
        """ScatterND of ``rows`` [Hkv, T, D] at ``index`` [Hkv, T, 2] (head, cell) — in place: the last update
        of a cache is a graph output bound to the input's own buffer, so ORT skips ScatterND's copy."""
        current = self._kv_input(key, which)
        if self._last_kv_writer.get((key, which)) == node.id:
            updated = _kv_name(key, which) + "_out"
            self.e.nodes.append(self.e.helper.make_node("ScatterND", [current, index, rows], [updated]))
        else:
            updated = self.e.op("ScatterND", [current, index, rows], hint=f"kv_{which}")
        self._kv_current[(key, which)] = updated
        return updated

    def _kv_storage(self, node: Node) -> tuple[tuple[str, int], OnnxKV]:
        key = (node.attrs["cache"], int(node.attrs["layer"]))
        storage = self.kv.get(key)
        if not isinstance(storage, OnnxKV):
            raise ModelError(f"onnx backend: no KV storage of this backend for cache {key[0]!r} layer {key[1]}")
        return key, storage

    def _scatter_index(self, cells: str, n_head_kv: int) -> str:
        """[Hkv, T, 2] pairs (head, cell) for cells [T] (int), shared by the layers with n_head_kv heads."""
        def make() -> str:
            cells64 = self.e.op("Cast", [cells], to=_ONNX_INT64)
            n = self.e.op("Shape", [cells64])
            grid = self.e.op("Concat", [self.e.const([n_head_kv]), n, self.e.const([1])], axis=0)
            heads = self.e.op("Expand", [self.e.const(np.arange(n_head_kv).reshape(-1, 1, 1)), grid])
            cols = self.e.op("Expand", [self.e.op("Unsqueeze", [cells64, self.e.const([0, 2])]), grid])
            return self.e.op("Concat", [heads, cols], axis=-1, hint="kv_index")
        return self.shared(("kv_index", cells, n_head_kv), make)

    def _cached_prefix(self, cache: str, n_kv: str) -> str:
        """Cells 0 .. n_kv-1 of a cache tensor [Hkv, n_kv, D]."""
        return self.e.op("Slice", [cache, self.e.const([0]), n_kv, self.e.const([1])])

    def _op_attention(self, node: Node) -> str:
        q, k, v, kv_idx, mask = node.inputs
        key, storage = self._kv_storage(node)
        n_head_kv, _, head_dim_k = storage.k.shape
        head_dim_v = storage.v.shape[2]
        n_head = self.shape(q)[1]
        if n_head % n_head_kv:
            raise ModelError(f"onnx backend: {n_head} query heads are not a multiple of {n_head_kv} KV heads")
        group = n_head // n_head_kv
        self.shapes[node.id] = (self.shape(q)[0], n_head * head_dim_v)
        index = self._scatter_index(self.value(kv_idx), n_head_kv)
        heads_first = dict(perm=[1, 0, 2])  # [T, Hkv, D] → [Hkv, T, D]
        keys = self._kv_write(node, key, "k", index, self.e.op("Transpose", [self.value(k)], **heads_first))
        values = self._kv_write(node, key, "v", index, self.e.op("Transpose", [self.value(v)], **heads_first))
        mask_name = self.value(mask)
        n_kv = self.shared(("n_kv", mask_name), lambda: self.e.op("Shape", [mask_name], start=1, end=2))
        keys, values = self._cached_prefix(keys, n_kv), self._cached_prefix(values, n_kv)
        # query head h uses KV head h // G: [T, H, Dk] → [Hkv, G*T, Dk], row g*T + t
        qg = self.e.op("Reshape", [self.value(q), self.e.const([-1, n_head_kv, group, head_dim_k])])
        qg = self.e.op("Transpose", [qg], perm=[1, 2, 0, 3])
        qg = self.e.op("Reshape", [qg, self.e.const([n_head_kv, -1, head_dim_k])])
        scale = float(node.attrs["scale"])
        scores = self.e.op("FusedMatMul", [qg, keys], domain="com.microsoft", alpha=scale, transB=1, hint="kq")
        softcap = float(node.attrs.get("softcap", 0.0) or 0.0)
        if softcap:
            scores = self._softcap(scores, softcap)
        # the mask [T, n_kv] repeated for the G query heads of each KV head: rows g*T + t
        mask_rows = self.shared(("mask", mask_name, group),
                                lambda: self.e.op("Tile", [mask_name, self.e.const([group, 1])], hint="mask"))
        probs = self.e.op("Softmax", [self.e.op("Add", [scores, mask_rows])], axis=-1)
        out = self.e.op("MatMul", [probs, values], hint="kqv")                 # [Hkv, G*T, Dv]
        out = self.e.op("Reshape", [out, self.e.const([n_head_kv, group, -1, head_dim_v])])
        out = self.e.op("Transpose", [out], perm=[2, 0, 1, 3])                  # [T, Hkv, G, Dv]
        return self.e.op("Reshape", [out, self.e.const([-1, n_head * head_dim_v])], hint="attn")

    def _op_k_shift(self, node: Node) -> str:
        shift = node.inputs[0]
        factors = node.inputs[1] if len(node.inputs) > 1 else None
        key, storage = self._kv_storage(node)
        n_head_kv, _, head_dim = storage.k.shape
        shift_name = self.value(shift)
        n_kv = self.e.op("Shape", [shift_name])
        cached = self._cached_prefix(self._kv_input(key, "k"), n_kv)              # [Hkv, n_kv, D]
        table = self._rope_table(shift_name, node.attrs, factors)
        rotated = self._rotate(self.e.op("Transpose", [cached], perm=[1, 0, 2]), n_head_kv, head_dim, table,
                               node.attrs)
        cells = self.e.op("Range", [self.e.const(0), self.e.op("Squeeze", [n_kv]), self.e.const(1)])
        self._kv_write(node, key, "k", self._scatter_index(cells, n_head_kv),
                       self.e.op("Transpose", [rotated], perm=[1, 0, 2]))
        self.shapes[node.id] = (0,)
        return self.e.const(np.zeros(0, F32), F32)


def _kv_name(key: tuple[str, int], which: str) -> str:
    return f"kv_{which}_{key[0]}_{key[1]}"


def _reshaped(shape: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...]:
    size = int(np.prod(shape))
    known = int(np.prod([d for d in target if d != -1])) if target else 1
    return tuple(size // known if d == -1 else d for d in target)


def _external_tensor_proto(name: str, array: np.ndarray) -> Any:
    """An initializer declared with EXTERNAL data; its bytes come from add_external_initializers."""
    from onnx import TensorProto, helper

    proto = TensorProto()
    proto.name = name
    proto.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
    proto.dims.extend(array.shape)
    proto.data_location = TensorProto.EXTERNAL
    entry = proto.external_data.add()
    entry.key, entry.value = "location", "llmfw-in-memory"
    return proto


# ---------------------------------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------------------------------

class OnnxBackend(Backend):
    """ONNX Runtime execution of the graph IR (CPU execution provider; CUDA when asked and present)."""

    name = "onnx"
    supported_ops = OPS
    is_host = False
    requires = ("onnxruntime", "onnx")
    #: the default on a CPU: it decodes about twice as fast as numpy or torch there (README, Benchmarks)
    default_priority = {"cpu": 200}

    #: MatMulNBits accuracy level: 4 = int8 activations (llama.cpp's own quantized dot products)
    accuracy_level: int = 4

    def __init__(self, device: str | None = None, options: BackendOptions | None = None):
        super().__init__(device, options)
        self.providers = execution_providers(device)
        self._ort, _ = import_onnxruntime()
        self._ort_values: dict[str, Any] = {}
        self._fused: dict[tuple[str, ...], BlockWeight] = {}
        self._derived: dict[tuple[str, str], np.ndarray] = {}
        self._programs: OrderedDict[tuple, _Program] = OrderedDict()
        #: sessions built (tests read it to check that one session serves many ubatches)
        self.sessions_built = 0
        #: bumped when built sessions become stale (thread count changed); compiled splits then rebuild
        self.generation = 0

    @classmethod
    def check_available(cls, device: str | None = None) -> None:
        execution_providers(device)

    def set_n_threads(self, n_threads: int | None) -> None:
        """Sessions fix their thread count when built: a change drops them (rebuilt on the next run)."""
        if n_threads != self.n_threads:
            super().set_n_threads(n_threads)
            self._programs.clear()
            self.generation += 1

    # -- weights ------------------------------------------------------------------------------------------
    def load_weight(self, source: WeightSource) -> Weight:
        return convert_weight(source)

    def free_weights(self) -> None:
        super().free_weights()
        self._ort_values.clear()
        self._fused.clear()
        self._derived.clear()
        self._programs.clear()

    def weight(self, name: str) -> Weight:
        try:
            return self.weights[name]
        except KeyError:
            raise ModelError(f"onnx backend holds no weight named {name!r}") from None

    def fused_weight(self, names: tuple[str, ...]) -> BlockWeight:
        fused = self._fused.get(names)
        if fused is None:
            parts = [self.weight(n) for n in names]
            fused = self._fused[names] = fuse_block_weights(parts)
            _share_rows(fused, parts)
        return fused

    def _derive(self, name: str, kind: str, make: Callable[[], np.ndarray]) -> np.ndarray:
        array = self._derived.get((name, kind))
        if array is None:
            array = self._derived[(name, kind)] = np.ascontiguousarray(make())
        return array

    def transposed(self, name: str) -> np.ndarray:
        return self._derive(name, "T", lambda: self.weight(name).array.T)

    def offsets_transposed(self, key: str, weight: BlockWeight) -> np.ndarray:
        return self._derive(key, "offsets.T", lambda: weight.offsets.T)

    def dense_copy(self, name: str) -> np.ndarray:
        weight = self.weight(name)
        if isinstance(weight, DenseWeight):
            return weight.array
        return self._derive(name, "dense", lambda: dequantize_block_weight(weight))

    def ort_value(self, name: str, array: np.ndarray) -> Any:
        """One OrtValue per weight array, shared by every session (ORT reads the numpy memory directly)."""
        cached = self._ort_values.get(name)
        if cached is None or cached[0] is not array:
            cached = self._ort_values[name] = (array, self._ort.OrtValue.ortvalue_from_numpy(array))
        return cached[1]

    # -- KV storage ---------------------------------------------------------------------------------------
    def alloc_kv(self, shape: KVLayerShape) -> OnnxKV:
        storage = OnnxKV(k=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_k), dtype=F32),
                         v=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_v), dtype=F32))
        storage.k_value = self._ort.OrtValue.ortvalue_from_numpy(storage.k)
        storage.v_value = self._ort.OrtValue.ortvalue_from_numpy(storage.v)
        return storage

    # -- values -------------------------------------------------------------------------------------------
    def from_numpy(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    # -- compile ------------------------------------------------------------------------------------------
    def compile(self, split: Split, kv: Mapping[tuple[str, int], Any]) -> CompiledSplit:
        return _CompiledSplit(self, split, kv)

    def program(self, split: Split, inputs: Sequence[np.ndarray], kv: Mapping[tuple[str, int], Any]) -> _Program:
        """The session for a split structure, built on first use and cached (LRU)."""
        key = split_signature(split, inputs)
        program = self._programs.get(key)
        if program is not None:
            self._programs.move_to_end(key)
            return program
        program = self._build_program(split, inputs, kv)
        self._programs[key] = program
        while len(self._programs) > MAX_SESSIONS:
            self._programs.popitem(last=False)
        return program

    def _build_program(self, split: Split, inputs: Sequence[np.ndarray],
                       kv: Mapping[tuple[str, int], Any]) -> _Program:
        translator = _SplitTranslator(self, split, inputs, kv)
        model, output_names = translator.translate()
        externals = translator.e.externals
        options = self._session_options()
        if externals:
            options.add_external_initializers(list(externals),
                                              [self.ort_value(n, a) for n, a in externals.items()])
        try:
            session = self._ort.InferenceSession(model.SerializeToString(), options, providers=self.providers)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise ModelError(f"onnx backend: onnxruntime rejected the model of a {len(split.nodes)}-node split: "
                             f"{exc}") from exc
        self.sessions_built += 1
        log.debug("onnx: session %d for a split of %d nodes (%d ONNX nodes)", self.sessions_built,
                  len(split.nodes), len(model.graph.node))
        return _Program(session, [f"in_{i}" for i in split.input_ids], output_names, translator.kv_bindings,
                        len(model.graph.node))

    def _session_options(self) -> Any:
        options = self._ort.SessionOptions()
        options.graph_optimization_level = self._ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = self._ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        if self.n_threads:
            options.intra_op_num_threads = int(self.n_threads)
        if os.environ.get("LLMFW_ONNX_SPIN") == "0":
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # unused-initializer notes are expected (e.g. weights of fused matmuls)
        profile_prefix = os.environ.get("LLMFW_ONNX_PROFILE")
        if profile_prefix:  # ORT's per-node timings, a JSON trace per session (see the README section)
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        optimized_path = os.environ.get("LLMFW_ONNX_DUMP")
        if optimized_path:  # the graph after ORT's fusions, to check what it made of a split
            options.optimized_model_filepath = f"{optimized_path}-{self.sessions_built}.onnx"
        return options


class _CompiledSplit:
    """The callable the scheduler runs: binds inputs and the KV buffers, runs the session."""

    def __init__(self, backend: OnnxBackend, split: Split, kv: Mapping[tuple[str, int], Any]):
        self.backend = backend
        self.split = split
        self.kv = kv
        self.program: _Program | None = None
        self.binding: Any = None
        self._signature: tuple | None = None

    def _prepare(self, arrays: list[np.ndarray]) -> None:
        signature = (self.backend.generation, tuple((a.dtype.str, a.ndim) for a in arrays))
        if self.program is not None and signature == self._signature:
            return
        self.program = self.backend.program(self.split, arrays, self.kv)
        self._signature = signature
        self.binding = self.program.session.io_binding()
        for input_name, _, key, which in self.program.kv_bindings:
            self.binding.bind_ortvalue_input(input_name, self._kv_value(key, which))

    def _kv_value(self, key: tuple[str, int], which: str) -> Any:
        storage: OnnxKV = self.kv[key]
        return storage.k_value if which == "k" else storage.v_value

    def _bind_outputs(self) -> None:
        """Bind the outputs afresh each run: a kept output buffer would pin its shape (the token count).
        Binding order is output order: the split's outputs first, then the caches (bound to their own memory,
        which is what makes ScatterND update them in place)."""
        binding = self.binding
        binding.clear_binding_outputs()
        for name in self.program.output_names:
            binding.bind_output(name)
        for _, output_name, key, which in self.program.kv_bindings:
            binding.bind_ortvalue_output(output_name, self._kv_value(key, which))

    def __call__(self, inputs: Mapping[int, Any]) -> dict[int, np.ndarray]:
        arrays = [np.ascontiguousarray(inputs[i]) for i in self.split.input_ids]
        self._prepare(arrays)
        program, binding = self.program, self.binding
        for name, array in zip(program.input_names, arrays):
            binding.bind_cpu_input(name, array)  # zero-copy: ORT reads the array during the run
        self._bind_outputs()
        program.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        # copies: the OrtValues behind these views belong to the binding, which the next run rebinds
        return {node_id: np.array(outputs[k].numpy()) for k, node_id in enumerate(self.split.output_ids)}
