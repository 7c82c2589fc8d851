"""ggml's reference block quantizers, vectorised (the tables and :func:`~llmfw.core.format.quants.quantize`
that call them are :mod:`llmfw.core.format.quants`)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

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
