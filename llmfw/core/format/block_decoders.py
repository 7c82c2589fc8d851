"""ggml's block decoders: one function per quantized type, raw blocks in, float32 values out (the tables and
the tensor-level API that call them are :mod:`llmfw.core.format.quants`)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

# ---------------------------------------------------------------------------------------------------------------
# Dequantization
#
# Every quantized type is decoded by a function that turns a 2-D array of raw blocks, shape (n, type_size) uint8,
# into their values, writing (n, block_size) float32 into ``out``. The float32 arithmetic follows ggml's
# ``dequantize_row_*`` (ggml-quants.c) operation by operation -- e.g. ``(d * sc) * q - dmin * m`` -- so results
# agree with ggml (and the gguf package) to the last bit, not merely approximately.
# ---------------------------------------------------------------------------------------------------------------

_BlockDecoder = Callable[[np.ndarray, np.ndarray], None]


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
