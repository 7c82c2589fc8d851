"""Weight forms of the onnx backend: GGUF tensors repacked, once at load, into what ONNX Runtime runs fastest.

* A quantized matrix becomes ``MatMulNBits`` blocks (com.microsoft, ``accuracy_level=4``: the activations are
  quantized to int8 per block, as llama.cpp does inside its quantized matmuls). The map is exact for every type
  of the real models: Q4_0 → 4-bit codes; Q8_0, Q5_0 → 8-bit codes; Q4_1, Q4_K → 4-bit codes plus a per-block
  *offset* applied as ``blocksum(x) @ offsets.T`` (llama.cpp's Q8_1 block sums do the same; ORT's float zero
  points take a much slower path); Q5_1, Q5_K → 8-bit codes plus offsets; Q6_K → 8-bit codes in blocks of 16
  (its sub-block scales); MXFP4 → 8-bit codes (its E2M1 values doubled are the integers -12..12). Other
  quantized types (Q2_K, Q3_K, IQ...) are requantized once to 8-bit blocks of 32, an error far below the type's
  own quantization step.
* Float matrices stay float32 (``Gemm`` / ``MatMul``); norms, biases and rope factors are float32 initializers.
* An embedding table used by ``get_rows`` keeps one byte per element (int8 codes + per-block scales) and rows
  are decoded in the graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmfw.core.exec.backend import WeightSource
from llmfw.core.errors import ModelError
from llmfw.core.format.quants import (TYPE_INFO, GGMLType, MXFP4_VALUES, block_view, dequantize, k4_sub_block_params,
                               mxfp4_codes, mxfp4_scales)

F32 = np.float32

#: elements per MatMulNBits block (ggml's 32-element blocks map onto it one to one)
BLOCK = 32
TYPE_SIZE_MXFP4 = TYPE_INFO[GGMLType.MXFP4].type_size


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
    #: ``offsets.T`` C-contiguous [n_blocks, n_out]: the B of the block-sum Gemm that adds the offsets to a
    #: MatMulNBits product, made at load so the cache stores (and ORT maps) it like the other arrays
    offsets_t: np.ndarray | None = None
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
    if qtype == GGMLType.MXFP4:
        return _mxfp4_block_weight(source, shape)
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


def _mxfp4_block_weight(source: WeightSource, shape: tuple[int, int]) -> BlockWeight:
    """MXFP4 exactly as 8-bit codes: ggml's doubled E2M1 values are the integers -12..12, times the block's
    halved power-of-two scale."""
    blocks = block_view(source.raw, source.ggml_type, source.ne).reshape(-1, TYPE_SIZE_MXFP4)
    codes = MXFP4_VALUES[mxfp4_codes(blocks)].astype(np.int8)
    scales = mxfp4_scales(blocks[:, 0]).reshape(shape[0], -1)
    return _finish(shape, 8, codes, scales, None, True, "MXFP4", BLOCK)


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
        return with_offsets_transposed(block_weight_of_packed(source, packed))
    weight = block_codes(source)
    if "mul_mat" in usage or not usage:
        weight.packed = pack_nbits(weight.codes, weight.bits, weight.block)
    if not lookups:
        weight.codes = None  # only the packed form is needed; halves the memory of 4-bit matrices
    return with_offsets_transposed(weight)


def with_offsets_transposed(weight: BlockWeight) -> BlockWeight:
    """``weight`` with :attr:`BlockWeight.offsets_t` set when it is multiplied (packed) and has offsets."""
    if weight.packed is not None and weight.offsets is not None:
        weight.offsets_t = np.ascontiguousarray(weight.offsets.T)
    return weight


def fuse_block_weights(parts: Sequence[BlockWeight]) -> BlockWeight:
    """Stack matrices that multiply the same input into one [sum n_out, n_in] (one MatMulNBits call)."""
    bits = parts[0].bits
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in parts])
    return with_offsets_transposed(BlockWeight(
        shape=(sum(p.shape[0] for p in parts), parts[0].shape[1]), bits=bits,
        scales=np.concatenate([p.scales for p in parts]), offsets=offsets,
        packed=np.concatenate([p.packed for p in parts]), exact=all(p.exact for p in parts),
        source_type="+".join(sorted({p.source_type for p in parts})), block=parts[0].block))


def share_rows(fused: BlockWeight, parts: Sequence[BlockWeight]) -> None:
    """Point each part's arrays at its rows of the fused copy, so the fusion costs no memory (sessions built
    earlier keep the old arrays alive through their OrtValues). A part's transposed offsets would be columns of
    the fused ones, not a contiguous view: dropped (the backend transposes a part's offsets when a graph
    multiplies the part alone)."""
    start = 0
    for part in parts:
        rows = slice(start, start + part.shape[0])
        part.packed, part.scales, part.offsets_t = fused.packed[rows], fused.scales[rows], None
        if part.offsets is not None:
            part.offsets = fused.offsets[rows]
        start = rows.stop
