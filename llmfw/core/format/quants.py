"""ggml tensor types: block sizes and byte sizes, vectorised numpy (de)quantization.

Shapes follow ggml: ``ne = (ne0, ne1, ...)`` with ``ne0`` the contiguous dimension; a tensor of ``ne`` is the
numpy array of shape ``tuple(reversed(ne))``. Quantized types pack ``block_size`` consecutive elements of a row
into ``type_size`` bytes, so ``ne0`` must be a multiple of ``block_size``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from math import prod

import numpy as np

from ..errors import QuantError


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


@dataclass(frozen=True)
class TypeInfo:
    block_size: int  # elements per block
    type_size: int  # bytes per block


QK_K = 256

TYPE_INFO: dict[GGMLType, TypeInfo] = {
    GGMLType.F32: TypeInfo(1, 4),
    GGMLType.F16: TypeInfo(1, 2),
    GGMLType.BF16: TypeInfo(1, 2),
    GGMLType.F64: TypeInfo(1, 8),
    GGMLType.I8: TypeInfo(1, 1),
    GGMLType.I16: TypeInfo(1, 2),
    GGMLType.I32: TypeInfo(1, 4),
    GGMLType.I64: TypeInfo(1, 8),
    GGMLType.Q4_0: TypeInfo(32, 2 + 16),
    GGMLType.Q4_1: TypeInfo(32, 2 + 2 + 16),
    GGMLType.Q5_0: TypeInfo(32, 2 + 4 + 16),
    GGMLType.Q5_1: TypeInfo(32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: TypeInfo(32, 2 + 32),
    GGMLType.Q8_1: TypeInfo(32, 4 + 4 + 32),
    GGMLType.Q2_K: TypeInfo(QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    GGMLType.Q3_K: TypeInfo(QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    GGMLType.Q4_K: TypeInfo(QK_K, 2 + 2 + QK_K // 2 + 12),
    GGMLType.Q5_K: TypeInfo(QK_K, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    GGMLType.Q6_K: TypeInfo(QK_K, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    GGMLType.Q8_K: TypeInfo(QK_K, 4 + QK_K + QK_K // 16 * 2),
    GGMLType.IQ2_XXS: TypeInfo(QK_K, 2 + QK_K // 4),
    GGMLType.IQ2_XS: TypeInfo(QK_K, 2 + QK_K // 4 + QK_K // 32),
    GGMLType.IQ3_XXS: TypeInfo(QK_K, 2 + QK_K // 4 + QK_K // 8),
    GGMLType.IQ1_S: TypeInfo(QK_K, 2 + QK_K // 8 + QK_K // 16),
    GGMLType.IQ4_NL: TypeInfo(32, 2 + 16),
    GGMLType.IQ3_S: TypeInfo(QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    GGMLType.IQ2_S: TypeInfo(QK_K, 2 + QK_K // 4 + QK_K // 16),
    GGMLType.IQ4_XS: TypeInfo(QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    GGMLType.IQ1_M: TypeInfo(QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    GGMLType.TQ1_0: TypeInfo(QK_K, 2 + 4 * 13),
    GGMLType.TQ2_0: TypeInfo(QK_K, 2 + 64),
    GGMLType.MXFP4: TypeInfo(32, 1 + 16),
}


def ggml_type(value: int | GGMLType) -> GGMLType:
    """The GGMLType for a raw type id, or QuantError naming the unknown id."""
    try:
        return GGMLType(int(value))
    except ValueError:
        raise QuantError(f"unknown ggml tensor type id {value}") from None


def type_info(t: int | GGMLType) -> TypeInfo:
    return TYPE_INFO[ggml_type(t)]


def tensor_nbytes(t: int | GGMLType, ne: tuple[int, ...] | list[int]) -> int:
    """Bytes of a tensor of type ``t`` and ggml shape ``ne``; QuantError if ``ne0`` is not whole blocks."""
    info = type_info(t)
    n_elements = 1
    for dim in ne:
        n_elements *= int(dim)
    if ne and int(ne[0]) % info.block_size:
        raise QuantError(f"{ggml_type(t).name}: row length {ne[0]} is not a multiple of the block size "
                         f"{info.block_size}")
    return n_elements // info.block_size * info.type_size


# ---------------------------------------------------------------------------------------------------------------
# Dequantization
#
# Every quantized type is decoded by a function that turns a 2-D array of raw blocks, shape (n, type_size) uint8,
# into their values, writing (n, block_size) float32 into ``out``. The float32 arithmetic follows ggml's
# ``dequantize_row_*`` (ggml-quants.c) operation by operation -- e.g. ``(d * sc) * q - dmin * m`` -- so results
# agree with ggml (and the gguf package) to the last bit, not merely approximately.
# ---------------------------------------------------------------------------------------------------------------

RawBytes = np.ndarray | bytes | bytearray | memoryview
_BlockDecoder = Callable[[np.ndarray, np.ndarray], None]

# Blocks are decoded in chunks of about this many elements: large enough that per-call numpy overhead vanishes,
# small enough that the few temporaries per chunk stay in cache and a 167M-element table needs no extra GiBs.
_CHUNK_ELEMENTS = 1 << 18


def _f16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian f16 at byte ``offset`` of every block, as float32 of shape (n, 1)."""
    return blocks[:, offset:offset + 2].view(np.float16).astype(np.float32)


def _unpack_fields(packed: np.ndarray, width: int, group: int) -> np.ndarray:
    """Split bytes into ``8 // width`` bit fields, the layout ggml uses for its packed quants.

    ``packed`` (n, k) is read as runs of ``group`` bytes; each run yields ``group`` values from bits 0..width-1 of
    its bytes, then ``group`` values from the next ``width`` bits, and so on. Returns (n, k * 8 // width) uint8.
    """
    n = packed.shape[0]
    # One contiguous copy first: each shift below then runs over a flat buffer, several times faster than
    # broadcasting over the strided block slices.
    runs = np.ascontiguousarray(packed).reshape(n, -1, group)
    n_fields = 8 // width
    fields = np.empty((n, runs.shape[1], n_fields, group), dtype=np.uint8)
    mask = np.uint8((1 << width) - 1)
    np.bitwise_and(runs, mask, out=fields[:, :, 0])
    for k in range(1, n_fields - 1):
        np.bitwise_and(runs >> np.uint8(k * width), mask, out=fields[:, :, k])
    np.right_shift(runs, np.uint8(8 - width), out=fields[:, :, n_fields - 1])  # the top field needs no mask
    return fields.reshape(n, -1)


def _bits_bytewise(packed: np.ndarray) -> np.ndarray:
    """Bit ``j`` of a little-endian bit string (Q5_0/Q5_1's ``qh``) as element ``j``: (n, 8 * k) uint8."""
    return np.unpackbits(packed, axis=1, bitorder="little")


def _scale_blocks(out: np.ndarray, scales: np.ndarray, q: np.ndarray, mins: np.ndarray | None = None) -> None:
    """out = scales * q (- mins), each scale applying to an equal run of consecutive elements of a block."""
    n, n_sub = scales.shape
    out3 = out.reshape(n, n_sub, -1)
    np.multiply(scales[:, :, None], q.reshape(n, n_sub, -1), out=out3)
    if mins is not None:
        out3 -= mins[:, :, None]


def _decode_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # d (f16) | 16 bytes: element j in the low nibble of byte j, element j+16 in its high nibble; value (q-8)*d
    q = _unpack_fields(blocks[:, 2:], 4, 16).view(np.int8)
    q -= np.int8(8)
    np.multiply(q, _f16_at(blocks, 0), out=out)


def _decode_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    # d | m | 16 nibble bytes as Q4_0; value q*d + m
    np.multiply(_unpack_fields(blocks[:, 4:], 4, 16), _f16_at(blocks, 0), out=out)
    out += _f16_at(blocks, 2)


def _five_bit_quants(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: low four bits from the nibbles of ``qs``, the fifth from bit j of the 32-bit ``qh``."""
    q = _unpack_fields(qs, 4, 16)
    q |= _bits_bytewise(qh) << np.uint8(4)
    return q


def _decode_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # d | qh (4 bytes) | qs (16 bytes); value (q-16)*d
    q = _five_bit_quants(blocks[:, 2:6], blocks[:, 6:]).view(np.int8)
    q -= np.int8(16)
    np.multiply(q, _f16_at(blocks, 0), out=out)


def _decode_q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    # d | m | qh | qs; value q*d + m
    np.multiply(_five_bit_quants(blocks[:, 4:8], blocks[:, 8:]), _f16_at(blocks, 0), out=out)
    out += _f16_at(blocks, 2)


def _decode_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # d | 32 int8; value q*d
    np.multiply(blocks[:, 2:].view(np.int8), _f16_at(blocks, 0), out=out)


def _decode_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # scales[16] (low nibble: scale, high: min, one pair per 16 elements) | qs[64] (2-bit) | d | dmin
    scales = blocks[:, :16]
    d, dmin = _f16_at(blocks, 80), _f16_at(blocks, 82)
    dl = d * (scales & np.uint8(0x0F)).astype(np.float32)
    ml = dmin * (scales >> np.uint8(4)).astype(np.float32)
    _scale_blocks(out, dl, _unpack_fields(blocks[:, 16:80], 2, 32), ml)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's sixteen 6-bit signed scales from 12 bytes: low nibbles from bytes 0-7 (scales 0-7 low, 8-15 high
    nibble), the top two bits of scale i from bits 2*(i//4) of byte 8 + i%4. Returns (n, 16) int8, minus 32."""
    low = _unpack_fields(packed[:, :8], 4, 8)
    high = _unpack_fields(packed[:, 8:12], 2, 4)
    scales = (low | (high << np.uint8(4))).view(np.int8)
    scales -= np.int8(32)
    return scales


def _decode_q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # hmask[32] | qs[64] (2-bit) | scales[12] | d; value d*(scale-32) * (q - (hmask bit ? 0 : 4))
    high_bit_clear = _unpack_fields(blocks[:, :32], 1, 32) ^ np.uint8(1)
    q = _unpack_fields(blocks[:, 32:96], 2, 32).view(np.int8)
    q -= (high_bit_clear << np.uint8(2)).view(np.int8)
    dl = _f16_at(blocks, 108) * _q3_k_scales(blocks[:, 96:108]).astype(np.float32)
    _scale_blocks(out, dl, q)


def _k4_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for all eight sub-blocks: 12 bytes -> (n, 8) 6-bit scales and (n, 8) 6-bit mins."""
    first, second, third = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([first & np.uint8(63), (third & np.uint8(0x0F)) | ((first >> np.uint8(6)) << np.uint8(4))],
                            axis=1)
    mins = np.concatenate([second & np.uint8(63), (third >> np.uint8(4)) | ((second >> np.uint8(6)) << np.uint8(4))],
                          axis=1)
    return scales, mins


def _k4_sub_block_params(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: d | dmin | 12 bytes of scales -> per-sub-block (d * scale, dmin * min), each (n, 8) float32."""
    scales, mins = _k4_scales_mins(blocks[:, 4:16])
    return _f16_at(blocks, 0) * scales.astype(np.float32), _f16_at(blocks, 2) * mins.astype(np.float32)


def _decode_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # d | dmin | scales[12] | qs[128]: runs of 32 bytes give 32 low-nibble then 32 high-nibble elements
    d1, m1 = _k4_sub_block_params(blocks)
    _scale_blocks(out, d1, _unpack_fields(blocks[:, 16:], 4, 32), m1)


def _decode_q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # d | dmin | scales[12] | qh[32] (bit k of byte l -> element 32k+l) | qs[128] as Q4_K
    d1, m1 = _k4_sub_block_params(blocks)
    q = _unpack_fields(blocks[:, 48:], 4, 32)
    q |= _unpack_fields(blocks[:, 16:48], 1, 32) << np.uint8(4)
    _scale_blocks(out, d1, q, m1)


def _decode_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # ql[128] (low 4 bits, runs of 64) | qh[64] (high 2 bits, runs of 32) | scales[16] int8 | d; value d*sc*(q-32)
    q = _unpack_fields(blocks[:, :128], 4, 64)
    q |= _unpack_fields(blocks[:, 128:192], 2, 32) << np.uint8(4)
    q = q.view(np.int8)
    q -= np.int8(32)
    dl = _f16_at(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    _scale_blocks(out, dl, q)


#: MXFP4's E2M1 code → value, doubled as ggml stores it (ggml's ``kvalues_mxfp4``); the block scale is halved
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def mxfp4_scales(exponents: np.ndarray) -> np.ndarray:
    """E8M0 block exponents → float32 scales ``2**(e - 127) / 2`` (ggml_e8m0_to_fp32_half; exact, denormals too)."""
    return np.ldexp(np.float64(1.0), exponents.astype(np.int32) - 128).astype(np.float32)


def mxfp4_codes(blocks: np.ndarray) -> np.ndarray:
    """The 4-bit codes of MXFP4 blocks [n, 17] (e | 16 bytes: element j in the low nibble of byte j, element j+16
    in its high nibble), uint8 [n, 32]."""
    qs = blocks[:, 1:]
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _decode_mxfp4(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = MXFP4_VALUES[mxfp4_codes(blocks)] * mxfp4_scales(blocks[:, 0])[:, None]


#: the 16 non-uniform levels of IQ4_NL / IQ4_XS codes (ggml's kvalues_iq4nl)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _decode_iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    # d | 16 nibble bytes as Q4_0, each nibble an index into IQ4_LEVELS; value d * level
    levels = IQ4_LEVELS[_unpack_fields(blocks[:, 2:], 4, 16)].astype(np.float32)
    np.multiply(levels, _f16_at(blocks, 0), out=out)


def iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS's eight 6-bit sub-block scales, minus 32: low nibbles from scales_l (bytes 4-7, two a byte), the top
    two bits from the 16-bit scales_h (bytes 2-3, two bits a sub-block). Returns (n, 8) int8."""
    low = _unpack_fields(blocks[:, 4:8], 4, 1)  # byte i -> sub-blocks 2i (low nibble), 2i+1 (high)
    high = _unpack_fields(blocks[:, 2:4], 2, 1)  # bits 2i..2i+1 of the little-endian uint16 -> sub-block i
    scales = (low | (high << np.uint8(4))).view(np.int8)
    scales -= np.int8(32)
    return scales


def _decode_iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    # d | scales_h (u16) | scales_l[4] | qs[128]: eight sub-blocks of 32 as IQ4_NL's, each scaled by d * (ls - 32)
    dl = _f16_at(blocks, 0) * iq4_xs_scales(blocks).astype(np.float32)
    levels = IQ4_LEVELS[_unpack_fields(blocks[:, 8:].reshape(-1, 16), 4, 16)].astype(np.float32)
    _scale_blocks(out, dl, levels.reshape(blocks.shape[0], -1))


_BLOCK_DECODERS: dict[GGMLType, _BlockDecoder] = {
    GGMLType.MXFP4: _decode_mxfp4,
    GGMLType.Q4_0: _decode_q4_0,
    GGMLType.Q4_1: _decode_q4_1,
    GGMLType.Q5_0: _decode_q5_0,
    GGMLType.Q5_1: _decode_q5_1,
    GGMLType.Q8_0: _decode_q8_0,
    GGMLType.Q2_K: _decode_q2_k,
    GGMLType.Q3_K: _decode_q3_k,
    GGMLType.Q4_K: _decode_q4_k,
    GGMLType.Q5_K: _decode_q5_k,
    GGMLType.Q6_K: _decode_q6_k,
    GGMLType.IQ4_NL: _decode_iq4_nl,
    GGMLType.IQ4_XS: _decode_iq4_xs,
}


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32
    return (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


# Plain element types: raw bytes -> float32 values (always a new, writable array).
_ELEMENT_DECODERS: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.F32: lambda raw: raw.view(np.float32).copy(),
    GGMLType.F16: lambda raw: raw.view(np.float16).astype(np.float32),
    GGMLType.BF16: _bf16_to_f32,
    GGMLType.F64: lambda raw: raw.view(np.float64).astype(np.float32),
    GGMLType.I8: lambda raw: raw.view(np.int8).astype(np.float32),
    GGMLType.I16: lambda raw: raw.view(np.int16).astype(np.float32),
    GGMLType.I32: lambda raw: raw.view(np.int32).astype(np.float32),
    GGMLType.I64: lambda raw: raw.view(np.int64).astype(np.float32),
}

SUPPORTED_DEQUANT: frozenset[GGMLType] = frozenset(_BLOCK_DECODERS) | frozenset(_ELEMENT_DECODERS)


def _as_byte_array(raw: RawBytes) -> np.ndarray:
    """A flat uint8 view of ``raw`` (a copy only when an ndarray is not contiguous)."""
    if isinstance(raw, np.ndarray):
        if raw.dtype.hasobject:
            raise QuantError(f"tensor data must be raw bytes, got a numpy array of dtype {raw.dtype}")
        return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(raw, dtype=np.uint8)
    except TypeError as exc:
        raise QuantError(f"tensor data must be bytes or a numpy array, got {type(raw).__name__}") from exc


def _checked_shape(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    try:
        ne = tuple(int(dim) for dim in shape)
    except (TypeError, ValueError) as exc:
        raise QuantError(f"tensor shape must be a sequence of integers, got {shape!r}") from exc
    if not ne or any(dim < 0 for dim in ne):
        raise QuantError(f"tensor shape must have at least one dimension and no negative ones, got {ne}")
    # 2**48 elements is past any file; numpy refuses views whose non-zero dimensions (with the block's bytes) overflow
    # 63 bits even when a zero dimension empties them
    if prod(max(dim, 1) for dim in ne) >= 1 << 48:
        raise QuantError(f"tensor shape {ne} is larger than any tensor a file holds")
    return ne


def _supported_type(t: int | GGMLType, supported: frozenset[GGMLType], action: str) -> GGMLType:
    qtype = ggml_type(t)
    if qtype not in supported:
        names = ", ".join(sorted(s.name for s in supported))
        raise QuantError(f"{action} of {qtype.name} tensors is not supported (supported: {names})")
    return qtype


def _checked_tensor(raw: RawBytes, t: int | GGMLType, shape: tuple[int, ...] | list[int], supported: frozenset[GGMLType],
                    action: str
                    ) -> tuple[np.ndarray, GGMLType, tuple[int, ...]]:
    """Validate type, shape and byte length; return (flat uint8 bytes, type, ne)."""
    qtype = _supported_type(t, supported, action)
    ne = _checked_shape(shape)
    data = _as_byte_array(raw)
    expected = tensor_nbytes(qtype, ne)
    if data.size != expected:
        raise QuantError(f"{qtype.name} tensor of shape {ne} needs {expected} bytes, got {data.size}")
    return data, qtype, ne


def _decode_flat(data: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """Decode validated flat bytes into a flat float32 array."""
    element_decoder = _ELEMENT_DECODERS.get(qtype)
    if element_decoder is not None:
        return element_decoder(data)
    info = TYPE_INFO[qtype]
    blocks = data.reshape(-1, info.type_size)
    out = np.empty((blocks.shape[0], info.block_size), dtype=np.float32)
    decode = _BLOCK_DECODERS[qtype]
    step = max(1, _CHUNK_ELEMENTS // info.block_size)
    # A NaN or inf scale in the data (ggml does not forbid them) yields NaN/inf values, as in ggml; numpy's
    # warnings about it would only be noise.
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, blocks.shape[0], step):
            decode(blocks[start:start + step], out[start:start + step])
    return out.reshape(-1)


def dequantize(raw: RawBytes, ggml_type: int | GGMLType,
               shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """Decode a whole tensor to float32.

    ``raw`` holds the tensor's bytes exactly as stored in a GGUF file; ``shape`` is ggml's ``ne`` (``ne0`` first).
    Returns a new float32 array of numpy shape ``tuple(reversed(shape))``. Raises QuantError for an unknown or
    unsupported type, a row length that is not whole blocks, or a byte length that does not match the shape.
    """
    data, qtype, ne = _checked_tensor(raw, ggml_type, shape, SUPPORTED_DEQUANT, "dequantization")
    return _decode_flat(data, qtype).reshape(tuple(reversed(ne)))


def dequantize_rows(raw: RawBytes, ggml_type: int | GGMLType,
                    shape: tuple[int, ...] | list[int], rows: np.ndarray | list[int]) -> np.ndarray:
    """Decode only the selected rows (ggml's get_rows, e.g. a token-embedding lookup in a quantized table).

    Rows are numbered over all dimensions but ``ne0`` (the row-major flattening of ``ne1, ne2, ...``). Returns
    float32 of shape ``rows.shape + (ne0,)``; QuantError for indices outside ``[0, n_rows)`` or non-integer ones.
    """
    data, qtype, ne = _checked_tensor(raw, ggml_type, shape, SUPPORTED_DEQUANT, "dequantization")
    index = np.asarray(rows)
    if index.size and not np.issubdtype(index.dtype, np.integer):
        raise QuantError(f"row indices must be integers, got dtype {index.dtype}")
    n_rows = prod(ne[1:])
    if index.size and (index.min() < 0 or index.max() >= n_rows):
        raise QuantError(f"row index out of range: tensor has {n_rows} rows, asked for rows "
                         f"{int(index.min())}..{int(index.max())}")
    selected = data.reshape(n_rows, -1)[index.reshape(-1).astype(np.intp)] if data.size else data
    return _decode_flat(selected.reshape(-1), qtype).reshape(*index.shape, ne[0])


def block_view(raw: RawBytes, ggml_type: int | GGMLType,
               shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """Zero-copy uint8 view of a tensor's blocks: numpy shape ``reversed(ne[1:]) + (ne0 // block_size, type_size)``.

    For backends that repack blocks into their own formats (int8 per row, MatMulNBits, ...) without decoding.
    """
    data, qtype, ne = _checked_tensor(raw, ggml_type, shape, frozenset(TYPE_INFO), "block view")
    info = TYPE_INFO[qtype]
    return data.reshape(*reversed(ne[1:]), ne[0] // info.block_size, info.type_size)


def k4_sub_block_params(raw: RawBytes, ggml_type: int | GGMLType,
                        shape: tuple[int, ...] | list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: each 32-element sub-block's ``(d * scale, dmin * min)``, float32 ``(n_rows, ne0 // 32)`` each,
    so that an element is ``scale * q - min`` with ``q`` its stored 4/5-bit code (for exact repacking)."""
    qtype = _supported_type(ggml_type, frozenset({GGMLType.Q4_K, GGMLType.Q5_K}), "sub-block parameters")
    blocks = block_view(raw, qtype, shape)
    n_rows = prod(blocks.shape[:-2])
    d1, m1 = _k4_sub_block_params(blocks.reshape(-1, blocks.shape[-1]))
    return d1.reshape(n_rows, -1), m1.reshape(n_rows, -1)


# ---------------------------------------------------------------------------------------------------------------
# Quantization: ggml's reference quantizers (quantize_row_*_ref), vectorised over blocks. Every step is float32,
# as in the C code, so the bytes match ggml's and the gguf package's.
# ---------------------------------------------------------------------------------------------------------------

_BlockEncoder = Callable[[np.ndarray], np.ndarray]  # (n, block_size) float32 -> (n, type_size) uint8


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """(n, 1) float32 -> (n, 2) uint8 of their f16 (round to nearest even, like GGML_FP32_TO_FP16)."""
    return values.astype(np.float16).view(np.uint8)


def _reciprocal_or_zero(d: np.ndarray) -> np.ndarray:
    """ggml's ``id = d ? 1.0f/d : 0.0f``."""
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _signed_absmax(blocks: np.ndarray) -> np.ndarray:
    """Per block, the first value of largest magnitude, sign kept; +0.0 for an all-zero block (as ggml's loop)."""
    magnitudes = np.abs(blocks)
    first = np.take_along_axis(blocks, magnitudes.argmax(axis=1)[:, None], axis=1)
    return np.where(first == 0, np.float32(0), first)


def _c_float_to_int8(values: np.ndarray) -> np.ndarray:
    """C's ``(int8_t)v`` as compiled for x86: truncate to int32 (NaN and out-of-range values give INT32_MIN),
    keep the low byte. Only blocks whose scale underflows (1/d = inf) reach the NaN/inf cases."""
    in_range = np.abs(values) < np.float32(2 ** 31)  # False for NaN
    with np.errstate(invalid="ignore"):  # the NaNs are exactly what np.where replaces
        as_int32 = np.where(in_range, values, np.float32(-2 ** 31)).astype(np.int32)
    return as_int32.astype(np.int8)


def _truncate_clamped(values: np.ndarray, top: int) -> np.ndarray:
    """ggml's ``(uint8_t)MIN(top, (int8_t)v)``."""
    return np.asarray(np.minimum(_c_float_to_int8(values), np.int8(top))).view(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values < 16 -> (n, 16) bytes: element j in the low nibble of byte j, element j+16 in the high."""
    return (q[:, :16] & np.uint8(0x0F)) | (q[:, 16:] << np.uint8(4))


def _pack_fifth_bits(q: np.ndarray) -> np.ndarray:
    """(n, 32) 5-bit values -> (n, 4) bytes of the little-endian uint32 whose bit j is bit 4 of element j."""
    return np.packbits(q >> np.uint8(4), axis=1, bitorder="little")


def _symmetric_quants(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0: d = max / -levels, q = MIN(2*levels-1, (int)(x/d + levels + 0.5)) -> (d, q uint8)."""
    d = _signed_absmax(blocks) / np.float32(-levels)
    scaled = blocks * _reciprocal_or_zero(d)
    return d, _truncate_clamped(scaled + np.float32(levels + 0.5), 2 * levels - 1)


def _offset_quants(blocks: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1/Q5_1: d = (max - min) / top, q = MIN(top, (int)((x - min)/d + 0.5)) -> (d, min, q uint8)."""
    low = blocks.min(axis=1, keepdims=True)
    high = blocks.max(axis=1, keepdims=True)
    d = (high - low) / np.float32(top)
    scaled = (blocks - low) * _reciprocal_or_zero(d)
    return d, low, _truncate_clamped(scaled + np.float32(0.5), top)


def _encode_q4_0(blocks: np.ndarray) -> np.ndarray:
    d, q = _symmetric_quants(blocks, 8)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=1)


def _encode_q4_1(blocks: np.ndarray) -> np.ndarray:
    d, low, q = _offset_quants(blocks, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(low), _pack_nibbles(q)], axis=1)


def _encode_q5_0(blocks: np.ndarray) -> np.ndarray:
    d, q = _symmetric_quants(blocks, 16)
    return np.concatenate([_f16_bytes(d), _pack_fifth_bits(q), _pack_nibbles(q)], axis=1)


def _encode_q5_1(blocks: np.ndarray) -> np.ndarray:
    d, low, q = _offset_quants(blocks, 31)
    return np.concatenate([_f16_bytes(d), _f16_bytes(low), _pack_fifth_bits(q), _pack_nibbles(q)], axis=1)


def _round_half_away(values: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero); exact, unlike floor(|v| + 0.5) which misrounds 0.49999997."""
    magnitude = np.abs(values)
    whole = np.floor(magnitude)
    return np.asarray(np.copysign(whole + (magnitude - whole >= np.float32(0.5)), values))


def _encode_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    q = _c_float_to_int8(_round_half_away(blocks * _reciprocal_or_zero(d)))
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)


_BLOCK_ENCODERS: dict[GGMLType, _BlockEncoder] = {
    GGMLType.Q4_0: _encode_q4_0,
    GGMLType.Q4_1: _encode_q4_1,
    GGMLType.Q5_0: _encode_q5_0,
    GGMLType.Q5_1: _encode_q5_1,
    GGMLType.Q8_0: _encode_q8_0,
}


def _f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even; NaNs stay (quiet) NaNs."""
    bits = values.view(np.uint32)
    is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = (bits.astype(np.uint64) + (np.uint64(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint64(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(64)
    return np.where(is_nan, quiet_nan, rounded).astype(np.uint16)


_ELEMENT_ENCODERS: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.F32: lambda values: values.copy(),
    GGMLType.F16: lambda values: values.astype(np.float16),
    GGMLType.BF16: _f32_to_bf16_bits,
}

SUPPORTED_QUANT: frozenset[GGMLType] = frozenset(_BLOCK_ENCODERS) | frozenset(_ELEMENT_ENCODERS)


def quantize(data: np.ndarray, ggml_type: int | GGMLType) -> np.ndarray:
    """Encode float values as a ggml tensor type, byte for byte as ggml's reference quantizer.

    ``data``'s last axis is the row (``ne0``); it must be whole blocks of the type. Returns uint8 of shape
    ``data.shape[:-1] + (row_bytes,)``. Quantized (block) types need finite values: QuantError otherwise.
    """
    qtype = _supported_type(ggml_type, SUPPORTED_QUANT, "quantization")
    values = np.asarray(data)
    if values.ndim == 0:
        raise QuantError("quantize needs at least one dimension (the row), got a scalar")
    if not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
        raise QuantError(f"quantize needs real numbers, got dtype {values.dtype}")
    values = np.ascontiguousarray(values, dtype=np.float32)
    row_bytes = tensor_nbytes(qtype, values.shape[-1:])
    element_encoder = _ELEMENT_ENCODERS.get(qtype)
    if element_encoder is not None:
        return element_encoder(values).view(np.uint8).reshape(*values.shape[:-1], row_bytes)
    if not np.isfinite(values).all():
        raise QuantError(f"cannot quantize non-finite values (NaN or inf) to {qtype.name}")
    info = TYPE_INFO[qtype]
    blocks = values.reshape(-1, info.block_size)
    encode = _BLOCK_ENCODERS[qtype]
    out = np.empty((blocks.shape[0], info.type_size), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // info.block_size)
    # A block whose scale underflows makes 1/d overflow to inf (and 0 * inf = NaN); ggml carries on, and so do
    # we, with its integer conversion of those values (see _c_float_to_int8), so numpy's warnings are noise here.
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, blocks.shape[0], step):
            out[start:start + step] = encode(blocks[start:start + step])
    return out.reshape(*values.shape[:-1], row_bytes)
