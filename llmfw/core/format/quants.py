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
from .block_decoders import (_BlockDecoder, _decode_iq4_nl, _decode_iq4_xs, _decode_mxfp4, _decode_q2_k, _decode_q3_k,
                             _decode_q4_0, _decode_q4_1, _decode_q4_k, _decode_q5_0, _decode_q5_1, _decode_q5_k,
                             _decode_q6_k, _decode_q8_0, _k4_sub_block_params)
# the block decoders' public names and those the native backend repacks with, importable from here as before
from .block_decoders import (IQ4_LEVELS as IQ4_LEVELS, MXFP4_VALUES as MXFP4_VALUES, _f16_at as _f16_at,
                             _five_bit_quants as _five_bit_quants, _k4_scales_mins as _k4_scales_mins,
                             _q3_k_scales as _q3_k_scales, _unpack_fields as _unpack_fields,
                             iq4_xs_scales as iq4_xs_scales, mxfp4_codes as mxfp4_codes, mxfp4_scales as mxfp4_scales)
from .block_encoders import (_BlockEncoder, _encode_q4_0, _encode_q4_1, _encode_q5_0, _encode_q5_1, _encode_q8_0)


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
# Dequantization: the block decoders are in block_decoders.py
# ---------------------------------------------------------------------------------------------------------------

RawBytes = np.ndarray | bytes | bytearray | memoryview

# Blocks are decoded in chunks of about this many elements: large enough that per-call numpy overhead vanishes,
# small enough that the few temporaries per chunk stay in cache and a 167M-element table needs no extra GiBs.
_CHUNK_ELEMENTS = 1 << 18


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
# Quantization: the block encoders (ggml's reference quantizers) are in block_encoders.py
# ---------------------------------------------------------------------------------------------------------------

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
