"""Weights repacked for the native kernels, values exact: every GGUF block type becomes 8-bit (or 4- or 5-bit
indexed) codes with a float scale (and offset) per 16 or 32 elements, computed with the oracle's own float32 operations, so
``scale * code + offset`` is the value ``llmfw.core.format.quants.dequantize`` gives, bit for bit — no requantization.
The K-quants and IQ4_XS keep their scales factored as the file has them: an integer factor of at most 8 bits per
sub-block times a multiplier per 256 elements (the super-block's f16 ``d``, or ``-dmin`` for a minimum), whose
product the kernels form in float32, exactly.
Rows are interleaved in groups of 8, four codes of each row at a time (csrc/native.h), so one 32-byte vector of
codes times one broadcast activation word gives the eight rows' partial sums in eight lanes. A paired weight lays
groups side by side in pairs, taking turns block by block, for the kernels that multiply two groups at a time."""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable

import numpy as np

from llmfw.core.errors import QuantError
from llmfw.core.format.mapped_pages import drop_mapped_pages
from llmfw.core.format.quants import (IQ4_LEVELS, MXFP4_VALUES, GGMLType, _f16_at, _five_bit_quants, _k4_scales_mins,
                                      _q3_k_scales, _unpack_fields, block_view, iq4_xs_scales, mxfp4_codes,
                                      mxfp4_scales)

ROWS = 8  # NAT_ROWS
BLOCK = 32  # NAT_BLOCK
SUPER = 256  # elements of a super-block (NAT_SUPER blocks)
KIND_QNIB, KIND_QBYTE, KIND_F32, KIND_F16, KIND_BF16, KIND_QNIB5 = range(6)
#: the kinds of quantized codes (the others are float rows)
QUANTIZED_KINDS = frozenset({KIND_QNIB, KIND_QBYTE, KIND_QNIB5})
FLOAT_KINDS = {GGMLType.F32: KIND_F32, GGMLType.F16: KIND_F16, GGMLType.BF16: KIND_BF16}
#: rows decoded per step while repacking: bounds the temporaries of a large table (Gemma-3's 262144-row head);
#: whole pairs of row groups (16 rows), so a paired weight's pairs lie within one step
_CHUNK_ROWS = 4096

_IDENTITY = np.arange(16, dtype=np.int8)


@dataclass(frozen=True)
class Codes:
    """One chunk of rows decoded into the kernels' terms: ``value = scales * table[codes] + offsets`` (QNIB),
    ``scales * (table[0] + codes) + offsets`` (QNIB5) or ``scales * codes + offsets`` (QBYTE), scales/offsets per
    ``16 * (2 // n_scales)`` elements."""

    codes: np.ndarray  # (rows, n_cols) uint8 nibble (QNIB) or 5-bit (QNIB5) indices, or int8 values (QBYTE)
    scales: np.ndarray  # (rows, n_cols // 32, n_scales) float32 (factored: int8 factors)
    offsets: np.ndarray | None  # same shape, or None
    #: factored layouts: (rows, n_cols // 256, 1 + has offsets) float32, the multipliers of each super-block's
    #: scale factors and offset factors
    mults: np.ndarray | None = None


@dataclass(frozen=True)
class Layout:
    kind: int
    n_scales: int
    has_offsets: bool
    table: np.ndarray  # 16 int8 (QNIB)
    decode: Callable[[np.ndarray], Codes]  # (rows, blocks, type_size) uint8 -> Codes
    #: the scales (and offsets) are f16 values in the file, one per block: stored as f16 (csrc/native.h), exact
    half_params: bool = False
    #: the scales (and offsets) are int8 factors times a float32 multiplier per super-block (csrc/native.h)
    factored: bool = False


def _flat(blocks: np.ndarray) -> tuple[np.ndarray, int, int]:
    rows, n_blocks, size = blocks.shape
    return blocks.reshape(rows * n_blocks, size), rows, n_blocks


def _q4_0(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    d = _f16_at(flat, 0).reshape(rows, nb, 1)
    return Codes(_unpack_fields(flat[:, 2:], 4, 16).reshape(rows, -1), d, None)


def _q4_1(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    d, m = _f16_at(flat, 0).reshape(rows, nb, 1), _f16_at(flat, 2).reshape(rows, nb, 1)
    return Codes(_unpack_fields(flat[:, 4:], 4, 16).reshape(rows, -1), d, m)


def _q5_0(blocks: np.ndarray) -> Codes:  # 5-bit indices: the table's table[0] = -16 centres them
    flat, rows, nb = _flat(blocks)
    q = _five_bit_quants(flat[:, 2:6], flat[:, 6:])
    return Codes(q.reshape(rows, -1), _f16_at(flat, 0).reshape(rows, nb, 1), None)


def _q5_1(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    q = _five_bit_quants(flat[:, 4:8], flat[:, 8:])
    return Codes(q.reshape(rows, -1), _f16_at(flat, 0).reshape(rows, nb, 1), _f16_at(flat, 2).reshape(rows, nb, 1))


def _q8_0(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    return Codes(np.ascontiguousarray(flat[:, 2:]).view(np.int8).reshape(rows, -1),
                 _f16_at(flat, 0).reshape(rows, nb, 1), None)


def _factors(values: np.ndarray, rows: int, nb: int) -> np.ndarray:
    """(rows * super-blocks, sub-blocks) integer factors -> (rows, n_cols // 32, n_scales) int8."""
    return np.ascontiguousarray(values.reshape(rows, nb * 256 // BLOCK, -1)).astype(np.int8)


def _multipliers(flat: np.ndarray, rows: int, *at: int) -> np.ndarray:
    """(rows, super-blocks, len(at)) float32: the f16 at each byte offset of a super-block, negated at a
    negative offset (a minimum enters as an offset factor times -dmin)."""
    mults = [-_f16_at(flat, -offset) if offset < 0 else _f16_at(flat, offset) for offset in at]
    return np.stack(mults, axis=-1).reshape(rows, -1, len(at)).astype(np.float32)


def _q2_k(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    scales = flat[:, :16]
    codes = _unpack_fields(flat[:, 16:80], 2, 32).reshape(rows, -1)
    return Codes(codes, _factors(scales & np.uint8(0x0F), rows, nb), _factors(scales >> np.uint8(4), rows, nb),
                 _multipliers(flat, rows, 80, -82))


def _q3_k(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    high_bit_clear = _unpack_fields(flat[:, :32], 1, 32) ^ np.uint8(1)
    q = _unpack_fields(flat[:, 32:96], 2, 32)
    q += np.uint8(4)
    q -= high_bit_clear << np.uint8(2)  # code + 4 in 0..7: the table subtracts the 4 again
    return Codes(q.reshape(rows, -1), _factors(_q3_k_scales(flat[:, 96:108]), rows, nb), None,
                 _multipliers(flat, rows, 108))


def _k4_params(flat: np.ndarray, rows: int, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, mins = _k4_scales_mins(flat[:, 4:16])
    return _factors(scales, rows, nb), _factors(mins, rows, nb), _multipliers(flat, rows, 0, -2)


def _q4_k(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    return Codes(_unpack_fields(flat[:, 16:], 4, 32).reshape(rows, -1), *_k4_params(flat, rows, nb))


def _q5_k(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    q = _unpack_fields(flat[:, 48:], 4, 32)
    q |= _unpack_fields(flat[:, 16:48], 1, 32) << np.uint8(4)
    return Codes(q.reshape(rows, -1), *_k4_params(flat, rows, nb))


def _q6_k(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    q = _unpack_fields(flat[:, :128], 4, 64)
    q |= _unpack_fields(flat[:, 128:192], 2, 32) << np.uint8(4)
    q = q.view(np.int8)
    q -= np.int8(32)
    return Codes(q.reshape(rows, -1), _factors(flat[:, 192:208].view(np.int8), rows, nb), None,
                 _multipliers(flat, rows, 208))


def _iq4_nl(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    return Codes(_unpack_fields(flat[:, 2:], 4, 16).reshape(rows, -1), _f16_at(flat, 0).reshape(rows, nb, 1), None)


def _iq4_xs(blocks: np.ndarray) -> Codes:
    flat, rows, nb = _flat(blocks)
    codes = _unpack_fields(flat[:, 8:].reshape(-1, 16), 4, 16).reshape(rows, -1)
    return Codes(codes, _factors(iq4_xs_scales(flat), rows, nb), None, _multipliers(flat, rows, 0))


def _mxfp4(blocks: np.ndarray) -> Codes:
    # E8M0 exponent | 16 nibble bytes: the E2M1 codes index MXFP4_VALUES (doubled, so integers -12..12) and the
    # exponent becomes its float scale exactly (halved to match), one per 32 values
    flat, rows, nb = _flat(blocks)
    return Codes(mxfp4_codes(flat).reshape(rows, -1), mxfp4_scales(flat[:, 0]).reshape(rows, nb, 1), None)


LAYOUTS: dict[GGMLType, Layout] = {
    GGMLType.Q4_0: Layout(KIND_QNIB, 1, False, _IDENTITY - np.int8(8), _q4_0, half_params=True),
    GGMLType.Q4_1: Layout(KIND_QNIB, 1, True, _IDENTITY, _q4_1, half_params=True),
    GGMLType.Q5_0: Layout(KIND_QNIB5, 1, False, _IDENTITY - np.int8(16), _q5_0, half_params=True),
    GGMLType.Q5_1: Layout(KIND_QNIB5, 1, True, _IDENTITY, _q5_1, half_params=True),
    GGMLType.Q8_0: Layout(KIND_QBYTE, 1, False, _IDENTITY, _q8_0, half_params=True),
    GGMLType.Q2_K: Layout(KIND_QNIB, 2, True, _IDENTITY, _q2_k, factored=True),
    GGMLType.Q3_K: Layout(KIND_QNIB, 2, False, _IDENTITY - np.int8(4), _q3_k, factored=True),
    GGMLType.Q4_K: Layout(KIND_QNIB, 1, True, _IDENTITY, _q4_k, factored=True),
    GGMLType.Q5_K: Layout(KIND_QNIB5, 1, True, _IDENTITY, _q5_k, factored=True),
    GGMLType.Q6_K: Layout(KIND_QBYTE, 2, False, _IDENTITY, _q6_k, factored=True),
    GGMLType.IQ4_NL: Layout(KIND_QNIB, 1, False, IQ4_LEVELS, _iq4_nl, half_params=True),
    GGMLType.IQ4_XS: Layout(KIND_QNIB, 1, False, IQ4_LEVELS, _iq4_xs, factored=True),
    GGMLType.MXFP4: Layout(KIND_QNIB, 1, False, MXFP4_VALUES.astype(np.int8), _mxfp4),
}

#: every GGML type the native matmul takes
SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(LAYOUTS) | frozenset(FLOAT_KINDS)


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the kernels' layout: ``data`` is what ``nat_weight.data`` points at (kept alive here)."""

    kind: int
    n_rows: int
    n_cols: int
    n_scales: int
    has_offsets: bool
    table: np.ndarray
    data: np.ndarray
    ggml_type: int
    #: scales and offsets stored as f16 (Layout.half_params)
    half_params: bool = False
    #: scales and offsets stored as int8 factors, each row group's multipliers after its blocks (Layout.factored)
    factored: bool = False
    #: row groups side by side in pairs, block by block (csrc/native.h: nat_weight.paired)
    paired: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_rows, self.n_cols)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def code_bytes(kind: int) -> int:
    """nat_code_bytes (csrc/native.h): the code bytes of one row of a block."""
    return {KIND_QNIB: 16, KIND_QNIB5: 20}.get(kind, 32)


def block_bytes(kind: int, n_scales: int, has_offsets: bool, half_params: bool = False, factored: bool = False) -> int:
    """nat_block_bytes (csrc/native.h): one block of one row group."""
    return ROWS * code_bytes(kind) + n_scales * (1 + int(has_offsets)) * ROWS * _param_bytes(half_params, factored)


def _param_bytes(half_params: bool, factored: bool = False) -> int:
    return 1 if factored else 2 if half_params else 4


def group_mult_bytes(n_cols: int, has_offsets: bool, factored: bool) -> int:
    """nat_group_mult_bytes (csrc/native.h): a factored weight's multipliers of one row group, after its blocks."""
    return n_cols // SUPER * (1 + int(has_offsets)) * ROWS * 4 if factored else 0


def packed_bytes(kind: int, n_rows: int, n_cols: int, n_scales: int, has_offsets: bool,
                 half_params: bool = False, factored: bool = False) -> int:
    """The bytes of a weight in the kernels' layout (csrc/native.h); QuantError for a description the kernels
    cannot take (what the C code reads is exactly this many bytes)."""
    if n_rows < 0 or n_cols < 0:
        raise QuantError(f"a weight of {n_rows} x {n_cols} values")
    if kind in FLOAT_KINDS.values():
        return n_rows * n_cols * (4 if kind == KIND_F32 else 2)
    if kind not in QUANTIZED_KINDS or n_scales not in (1, 2) or n_cols % (SUPER if factored else BLOCK):
        raise QuantError(f"no kernel layout of kind {kind} with {n_scales} scales and {n_cols} columns"
                         + (" (factored parameters need whole super-blocks of 256)" if factored else ""))
    group = (n_cols // BLOCK) * block_bytes(kind, n_scales, has_offsets, half_params, factored) + \
        group_mult_bytes(n_cols, has_offsets, factored)
    return -(-n_rows // ROWS) * group


def checked(weight: PackedWeight) -> PackedWeight:
    """``weight`` when its arrays are what its description says (contiguous bytes of :func:`packed_bytes`, a
    16-entry code table), else QuantError: the check before a stored weight reaches the kernels."""
    expected = packed_bytes(weight.kind, weight.n_rows, weight.n_cols, weight.n_scales, weight.has_offsets,
                            weight.half_params, weight.factored)
    data, table = weight.data, weight.table
    if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous or data.size != expected:
        raise QuantError(f"repacked weight of {data.size} bytes ({data.dtype}), its layout needs {expected}")
    if table.dtype != np.int8 or table.shape != (16,):
        raise QuantError(f"repacked weight with a code table of {table.dtype} {table.shape}")
    return weight


def pairable(ggml_type: int) -> bool:
    """Whether a ``ggml_type`` weight is laid out with its row groups in pairs where the AVX2 kernels run: those
    that multiply two groups at a time from one stream in every call (csrc/kernels_x86.c: ``avx2_pairs``), 4-bit
    indices into a linear table under one f16 scale per block (Q4_0, Q4_1). Q4_K takes that tile too, but with its
    factored parameters the paired stream made four rows slower; Q8_0 gained nothing paired (docs/benchmarks.md)."""
    layout = LAYOUTS.get(GGMLType(ggml_type))
    if layout is None or layout.kind != KIND_QNIB or layout.n_scales != 1 or not layout.half_params:
        return False
    return bool((layout.table.astype(np.int16) - int(layout.table[0]) == np.arange(16)).all())


def repack(raw: np.ndarray, ggml_type: int, ne: tuple[int, ...], paired: bool = False) -> PackedWeight:
    """The kernels' form of a 2-D weight of ggml shape ``ne`` (QuantError for a type or shape they do not take);
    ``paired``: its row groups side by side in pairs (float weights have no groups and ignore it)."""
    blocks = block_view(raw, ggml_type, ne)  # validates the type, the shape and the byte length
    qtype = GGMLType(ggml_type)
    if qtype not in SUPPORTED_TYPES:
        raise QuantError(f"the native backend has no kernel for {qtype.name} weights")
    n_cols, n_rows = int(ne[0]), prod(int(d) for d in ne[1:])
    if not n_cols or not n_rows:
        raise QuantError(f"{qtype.name} weight of shape {tuple(ne)} holds no values")
    if qtype in FLOAT_KINDS:
        data = np.array(blocks, dtype=np.uint8, copy=True).reshape(-1)
        return PackedWeight(FLOAT_KINDS[qtype], n_rows, n_cols, 0, False, _IDENTITY, data, int(qtype))
    layout = LAYOUTS[qtype]
    if n_cols % BLOCK:
        raise QuantError(f"{qtype.name}: row length {n_cols} is not a multiple of {BLOCK}")
    per_row = blocks.reshape(n_rows, -1, blocks.shape[-1])  # (rows, blocks of the file's type, type_size)
    n_groups = (n_rows + ROWS - 1) // ROWS
    nb = n_cols // BLOCK
    out = np.zeros(packed_bytes(layout.kind, n_rows, n_cols, layout.n_scales, layout.has_offsets, layout.half_params,
                                layout.factored), dtype=np.uint8).reshape(n_groups, -1)
    for start in range(0, n_rows, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, n_rows)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf scales stay NaN/inf, as in the oracle
            codes = layout.decode(per_row[start:stop])
        drop_mapped_pages(per_row[start:stop])  # read: a mapped file's pages need not stay resident
        _place(out, start, codes, layout, nb, paired)
    return PackedWeight(layout.kind, n_rows, n_cols, layout.n_scales, layout.has_offsets,
                        np.ascontiguousarray(layout.table, dtype=np.int8), out.reshape(-1), int(qtype),
                        layout.half_params, layout.factored, paired)


def _place(out: np.ndarray, start: int, codes: Codes, layout: Layout, nb: int, paired: bool) -> None:
    """Write the decoded rows ``start..`` (a multiple of 16) into their row groups of ``out`` ([group][bytes]: the
    group's blocks, then a factored layout's multipliers; ``paired``: each pair's blocks taking turns, then the
    two groups' multipliers)."""
    rows = codes.codes.shape[0]
    padded = (rows + ROWS - 1) // ROWS * ROWS
    code_bytes = _code_bytes(codes.codes, layout.kind, nb)  # (rows, nb, cb)
    params = [codes.scales] + ([codes.offsets] if layout.has_offsets and codes.offsets is not None else [])
    mults = codes.mults if layout.factored else None
    if padded != rows:
        pad = ((0, padded - rows), (0, 0), (0, 0))
        code_bytes = np.pad(code_bytes, pad)
        params = [np.pad(p, pad) for p in params]
        mults = None if mults is None else np.pad(mults, pad)
    groups = padded // ROWS
    g0 = start // ROWS
    cb = code_bytes.shape[-1]
    bb = block_bytes(layout.kind, layout.n_scales, layout.has_offsets, layout.half_params, layout.factored)
    blocks = np.zeros((groups, nb, bb), dtype=np.uint8)  # a layout's offsets the decoder did not give stay 0
    # codes: [group][block][chunk of 4 bytes][row][4]: one 32-byte chunk holds 4 codes of each of the 8 rows
    chunks = cb // 4
    blocks[:, :, :ROWS * cb] = code_bytes.reshape(groups, ROWS, nb, chunks, 4).transpose(
        0, 2, 3, 1, 4).reshape(groups, nb, ROWS * cb)
    at = ROWS * cb
    # f16 values of the file (exact either way), or int8 factors
    stored = np.int8 if layout.factored else np.float16 if layout.half_params else np.float32
    for p in params:  # each (padded, nb, n_scales) -> [group][block][half][row]
        n_scales = p.shape[-1]
        arranged = p.reshape(groups, ROWS, nb, n_scales).transpose(0, 2, 3, 1)
        width = n_scales * ROWS * _param_bytes(layout.half_params, layout.factored)
        blocks[:, :, at:at + width] = np.ascontiguousarray(arranged, dtype=stored).view(
            np.uint8).reshape(groups, nb, width)
        at += width
    region = out[g0:g0 + groups]
    region[:, :nb * bb] = blocks.reshape(groups, nb * bb)
    if mults is not None:  # (padded, n_super, n_par) -> [group][super-block][scale, offset][row]
        arranged = mults.reshape(groups, ROWS, mults.shape[1], mults.shape[2]).transpose(0, 2, 3, 1)
        region[:, nb * bb:] = np.ascontiguousarray(arranged, dtype=np.float32).view(np.uint8).reshape(groups, -1)
    if paired:
        _pair_groups(region[:groups // 2 * 2], nb, bb)  # a last group without a partner stays as it is


def _pair_groups(groups: np.ndarray, nb: int, bb: int) -> None:
    """Rearrange whole pairs of unpaired groups ([group][blocks, multipliers]) in place into the paired layout:
    [pair][block][group of the two][bb], then the first group's multipliers and the second's."""
    pairs = groups.reshape(groups.shape[0] // 2, 2, groups.shape[1])
    blocks = pairs[:, :, :nb * bb].reshape(pairs.shape[0], 2, nb, bb).transpose(0, 2, 1, 3).copy()
    mults = pairs[:, :, nb * bb:].copy()
    flat = groups.reshape(pairs.shape[0], -1)
    flat[:, :2 * nb * bb] = blocks.reshape(pairs.shape[0], -1)
    flat[:, 2 * nb * bb:] = mults.reshape(pairs.shape[0], -1)


def _code_bytes(codes: np.ndarray, kind: int, nb: int) -> np.ndarray:
    """(rows, n_cols) codes -> (rows, nb, 16) nibble bytes (element j low nibble of byte j, j+16 high), the same
    followed by 4 bytes of fifth bits (5-bit codes: bit c of byte i is element 4c+i's), or (rows, nb, 32) int8
    bytes."""
    rows = codes.shape[0]
    by_block = codes.reshape(rows, nb, BLOCK).view(np.uint8)
    if kind == KIND_QBYTE:
        return by_block
    nibbles = (by_block[:, :, :16] & np.uint8(15)) | (by_block[:, :, 16:] << np.uint8(4))
    if kind == KIND_QNIB:
        return nibbles
    by_chunk = (by_block >> np.uint8(4)).reshape(rows, nb, 8, 4) & np.uint8(1)  # [chunk c][byte i]
    fifth = by_chunk[:, :, 0].copy()
    for c in range(1, 8):
        fifth |= by_chunk[:, :, c] << np.uint8(c)
    return np.concatenate([nibbles, fifth], axis=-1)
