"""The native backend's matmul kernels against the numpy oracle (llmfw.core.quants dequantizers), for every block
type x every ISA path this CPU runs: exact repacking, error within the 8-bit activation bound, NaN/inf blocks,
and the kernels' own construction properties (every ISA path and every batch/thread split give the same bits)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from llmfw.core.errors import ConfigError, QuantError
from llmfw.core.quants import TYPE_INFO, GGMLType, dequantize
from llmfw.plugins.backends.native import repack as rp

from support.native import (BLOCK_TYPES, F16_FIELDS, FLOAT_TYPES, MXFP4_OVERFLOW, kernels_or_skip, random_blocks,
                            random_float_tensor)

kernels = kernels_or_skip()
ISAS = kernels.available_isas()


@pytest.fixture(scope="module")
def pools():
    made = {n: kernels.ThreadPool(n) for n in (1, 2, 3)}
    yield made
    for pool in made.values():
        pool.close()


def unpaired_groups(packed: rp.PackedWeight) -> np.ndarray:
    """[group][bytes] of a repacked weight as they lie unpaired: a paired weight's pairs (csrc/native.h: block b of
    the first group, block b of the second, ..., then the first's multipliers and the second's) taken apart."""
    nb, n_groups = packed.n_cols // rp.BLOCK, -(-packed.n_rows // rp.ROWS)
    groups = packed.data.reshape(n_groups, -1)
    if not packed.paired:
        return groups
    bb = rp.block_bytes(packed.kind, packed.n_scales, packed.has_offsets, packed.half_params, packed.factored)
    n_pairs = n_groups // 2
    pairs = groups[:2 * n_pairs].reshape(n_pairs, -1)
    blocks = pairs[:, :2 * nb * bb].reshape(n_pairs, nb, 2, bb).transpose(0, 2, 1, 3).reshape(n_pairs, 2, nb * bb)
    mults = pairs[:, 2 * nb * bb:].reshape(n_pairs, 2, -1)
    apart = groups.copy()
    apart[:2 * n_pairs] = np.concatenate([blocks, mults], axis=2).reshape(2 * n_pairs, -1)
    return apart


def unpack_values(packed: rp.PackedWeight) -> np.ndarray:
    """The values the kernels multiply with, read back from the repacked layout in numpy: scale*code + offset."""
    nb, n_groups = packed.n_cols // rp.BLOCK, -(-packed.n_rows // rp.ROWS)
    cb = rp.code_bytes(packed.kind)
    groups = unpaired_groups(packed)
    n_par = 1 + packed.has_offsets
    mult_bytes = rp.group_mult_bytes(packed.n_cols, packed.has_offsets, packed.factored)
    blocks = groups[:, :groups.shape[1] - mult_bytes].reshape(n_groups, nb, -1)
    chunked = blocks[:, :, :rp.ROWS * cb].reshape(n_groups, nb, cb // 4, rp.ROWS, 4)  # [chunk][row][4 codes]
    codes = chunked.transpose(0, 1, 3, 2, 4).reshape(n_groups, nb, rp.ROWS, cb)
    if packed.kind == rp.KIND_QNIB:
        nibbles = np.concatenate([codes & 15, codes >> 4], axis=-1)
        values = packed.table[nibbles].astype(np.float32)
    elif packed.kind == rp.KIND_QNIB5:  # the nibbles, then 4 bytes of fifth bits a row (bit c of byte i: 4c+i)
        nibbles = np.concatenate([codes[..., :16] & 15, codes[..., :16] >> 4], axis=-1)
        by_byte = np.unpackbits(codes[..., 16:, None], axis=-1, bitorder="little")  # [..., byte i, bit c]
        fifth = np.swapaxes(by_byte, -1, -2).reshape(*codes.shape[:-1], 32)
        values = (packed.table[0] + (nibbles | (fifth << 4)).astype(np.int32)).astype(np.float32)
    else:
        values = codes.view(np.int8).astype(np.float32)
    stored = np.int8 if packed.factored else np.float16 if packed.half_params else np.float32
    params = blocks[:, :, rp.ROWS * cb:].copy().view(stored).astype(np.float32).reshape(
        n_groups, nb, -1, packed.n_scales, rp.ROWS)
    if packed.factored:  # [group][super-block][scale, offset][row] multipliers, one super-block per 8 blocks
        mults = groups[:, groups.shape[1] - mult_bytes:].copy().view(np.float32).reshape(n_groups, -1, n_par, rp.ROWS)
        params = params * np.repeat(mults, rp.SUPER // rp.BLOCK, axis=1)[:, :, :, None, :]
    halves = values.reshape(n_groups, nb, rp.ROWS, 2, 16)
    scale = params[:, :, 0].transpose(0, 1, 3, 2)  # [g, b, row, n_scales]
    scale = np.repeat(scale, 2 // packed.n_scales, axis=-1)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        out = scale * halves
        if packed.has_offsets:
            offset = np.repeat(params[:, :, 1].transpose(0, 1, 3, 2), 2 // packed.n_scales, axis=-1)[..., None]
            out = out + offset
    return out.transpose(0, 2, 1, 3, 4).reshape(n_groups * rp.ROWS, packed.n_cols)[:packed.n_rows]


def activation_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|x·w - x̂·w| <= Σ_blocks (amax/254) Σ|w| (round to nearest of 127 levels), plus float32 accumulation."""
    m, k = x.shape
    amax = np.abs(x.reshape(m, k // 32, 32)).max(axis=-1).astype(np.float64)
    wsum = np.abs(w).reshape(w.shape[0], k // 32, 32).sum(axis=-1)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w).T
    return (amax / 254.0) @ wsum.T * 1.001 + magnitude * 1e-5 + 1e-30


@pytest.mark.parametrize("paired", (False, True), ids=("apart", "paired"))
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_repacking_keeps_every_value_bit_exact(qtype, paired):
    """21 rows: three row groups, so a paired weight holds one pair and a last group alone."""
    rng = np.random.default_rng(int(qtype))
    n_blocks = 2 if TYPE_INFO[qtype].block_size == 256 else 5
    raw = random_blocks(qtype, 21, n_blocks, rng)
    ne = (n_blocks * TYPE_INFO[qtype].block_size, 21)
    packed = rp.repack(raw, qtype, ne, paired)
    assert packed.paired == paired
    np.testing.assert_array_equal(unpack_values(packed), dequantize(raw, qtype, ne))


def test_pairing_moves_the_bytes_of_whole_pairs_only():
    """The paired layout is a permutation of the unpaired one within each pair of groups: the same bytes in all."""
    rng = np.random.default_rng(12)
    raw = random_blocks(GGMLType.Q4_K, 37, 2, rng)
    apart, paired = (rp.repack(raw, GGMLType.Q4_K, (512, 37), p) for p in (False, True))
    assert paired.nbytes == apart.nbytes
    np.testing.assert_array_equal(unpaired_groups(paired), apart.data.reshape(5, -1))
    group = apart.nbytes // 5
    np.testing.assert_array_equal(paired.data[4 * group:], apart.data[4 * group:])  # the fifth group stays alone
    assert not np.array_equal(paired.data[:4 * group], apart.data[:4 * group])


def test_the_avx2_path_pairs_the_groups_of_4_bit_indices_under_one_f16_scale():
    assert {t for t in BLOCK_TYPES if rp.pairable(t)} == {GGMLType.Q4_0, GGMLType.Q4_1}


#: the block types whose scales (and offsets) are one f16 per 32 values in the file
F16_PARAM_TYPES = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.IQ4_NL}
#: the types whose scales (and minimums) are integer factors of a super-block's f16 d (and dmin) in the file
FACTORED_TYPES = {GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_XS}
#: bytes per 32 weights as repacked: codes (Q2_K's and Q3_K's 2- and 3-bit codes take 4 bits), one int8 factor a
#: scale (and offset), and the float32 multipliers of a 256-element super-block
FACTORED_BYTES_PER_32 = {GGMLType.Q2_K: 16 + 4 + 1, GGMLType.Q3_K: 16 + 2 + 0.5, GGMLType.Q4_K: 16 + 2 + 1,
                         GGMLType.Q5_K: 20 + 2 + 1, GGMLType.Q6_K: 32 + 2 + 0.5, GGMLType.IQ4_XS: 16 + 1 + 0.5}


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_parameters_keep_the_files_form_so_a_weight_streams_little_more_than_its_file(qtype):
    """A decode step reads every byte of every weight: the types whose parameters are f16 in the file keep them
    so (4-, 5- and 8-bit codes then take exactly the file's bytes); the K-quants and IQ4_XS keep their integer
    factors (one byte each) and their super-blocks' multipliers; MXFP4's exact power-of-two scales are float32."""
    rng = np.random.default_rng(int(qtype) + 100)
    n_blocks = 2 if TYPE_INFO[qtype].block_size == 256 else 5
    raw = random_blocks(qtype, 16, n_blocks, rng)
    packed = rp.repack(raw, qtype, (n_blocks * TYPE_INFO[qtype].block_size, 16))
    assert packed.half_params == (qtype in F16_PARAM_TYPES)
    assert packed.factored == (qtype in FACTORED_TYPES)
    if qtype in F16_PARAM_TYPES:
        assert packed.nbytes == raw.nbytes
    elif qtype in FACTORED_TYPES:
        assert packed.nbytes == FACTORED_BYTES_PER_32[qtype] * 16 * packed.n_cols // 32
    else:  # MXFP4
        assert packed.nbytes == 2 * packed.n_cols // rp.BLOCK * (rp.ROWS * rp.code_bytes(packed.kind) + rp.ROWS * 4)


def test_mxfp4_subnormal_and_largest_exponents_repack_bit_exact():
    """E8M0 exponents at both ends: 2**-128 (a subnormal float32 scale) up to 2**127 (values overflow to inf)."""
    rng = np.random.default_rng(39)
    raw = random_blocks(GGMLType.MXFP4, 19, 3, rng).reshape(19, 3, -1)
    raw[..., 0] = rng.choice(np.array([0, 1, 2, 127, 128, 253, 254, 255], dtype=np.uint8), (19, 3))
    raw = raw.reshape(-1)
    with np.errstate(over="ignore"):
        expected = dequantize(raw, GGMLType.MXFP4, (96, 19))
    np.testing.assert_array_equal(unpack_values(rp.repack(raw, GGMLType.MXFP4, (96, 19))), expected)


@pytest.mark.parametrize("paired", (False, True), ids=("apart", "paired"))
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_quantized_matmul_within_the_activation_rounding_bound(qtype, isa, paired, pools):
    rng = np.random.default_rng(100 + int(qtype))
    n_rows, n_blocks = 37, 3 if TYPE_INFO[qtype].block_size == 32 else 2  # a partial row group, odd block counts
    k = n_blocks * TYPE_INFO[qtype].block_size
    raw = random_blocks(qtype, n_rows, n_blocks, rng)
    w = dequantize(raw, qtype, (k, n_rows)).astype(np.float64)
    # 7 rows: one tile of each size the x86 paths use (4, 2, 1)
    x = (rng.standard_normal((7, k)) * rng.uniform(0.1, 10, (7, 1))).astype(np.float32)
    got = kernels.mul_mat(rp.repack(raw, qtype, (k, n_rows), paired), x, pools[2], isa)
    err = np.abs(got - x.astype(np.float64) @ w.T)
    assert (err <= activation_bound(x, w)).all(), float(err.max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_weight_matmul_matches_the_oracle(qtype, isa, pools):
    rng = np.random.default_rng(7)
    n_rows, k = 13, 77  # no multiple of 8 or 16 anywhere
    raw = random_float_tensor(qtype, n_rows, k, rng)
    w = dequantize(raw, qtype, (k, n_rows)).astype(np.float64)
    x = rng.standard_normal((3, k)).astype(np.float32)
    got = kernels.mul_mat(rp.repack(raw, qtype, (k, n_rows)), x, pools[1], isa)
    bound = (np.abs(x.astype(np.float64)) @ np.abs(w).T) * 1e-6
    assert (np.abs(got - x.astype(np.float64) @ w.T) <= bound).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_nan_and_inf_blocks_give_non_finite_results_where_the_oracle_does(qtype, isa, pools):
    rng = np.random.default_rng(300 + int(qtype))
    info = TYPE_INFO[qtype]
    n_rows, n_blocks = 11, 2
    k = n_blocks * info.block_size
    raw = random_blocks(qtype, n_rows, n_blocks, rng).reshape(n_rows, n_blocks, info.type_size)
    if qtype == GGMLType.MXFP4:  # no NaN exponent (ggml's E8M0 decoding): the largest one overflows the values
        raw[2, 1, 0] = raw[9, 0, 0] = MXFP4_OVERFLOW
    else:
        offset = F16_FIELDS[qtype][-1]  # the offset/min field where there is one, else the scale
        raw[2, 1, offset:offset + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
        raw[9, 0, offset:offset + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    raw = raw.reshape(-1)
    x = rng.standard_normal((4, k)).astype(np.float32)
    x[1, 5] = np.inf
    x[3, k - 1] = np.nan
    with np.errstate(invalid="ignore", over="ignore"):
        expected = x.astype(np.float64) @ dequantize(raw, qtype, (k, n_rows)).astype(np.float64).T
    got = kernels.mul_mat(rp.repack(raw, qtype, (k, n_rows)), x, pools[2], isa)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected))
    assert np.isfinite(got).sum() == 2 * (n_rows - 2)  # rows 0 and 2 of x, minus the two bad weight rows


@pytest.mark.parametrize("paired", (False, True), ids=("apart", "paired"))
# 7: a tile of each size the x86 paths use (4, 2, 1), the four rows from their tile copy (native.h: nat_qact tiles);
# 35: the AMX path's 16 too; 21: past the AMX path's 16, four rows from a tile copy that starts there
@pytest.mark.parametrize("m", (1, 7, 21, 35))
@pytest.mark.parametrize("qtype", BLOCK_TYPES + FLOAT_TYPES, ids=lambda t: t.name)
def test_every_isa_path_gives_the_same_bits(qtype, m, paired, pools):
    """By construction (csrc/native.h: one order of float operations, the same explicit fused multiply-adds and no
    others): scalar, AVX2 and AVX-512 differ in instructions, not in results. One thread takes every row group in one
    call (AVX-512 pairs them: 6 groups, the last pair's second group partial; 7 groups, one left alone); 2 threads
    split them."""
    rng = np.random.default_rng(500 + int(qtype))
    for n_rows in (45, 53):
        raw, ne = _weight(qtype, rng, n_rows)
        packed = rp.repack(raw, qtype, ne, paired)
        x = rng.standard_normal((m, ne[0])).astype(np.float32)
        for n_threads in (1, 2):
            _assert_every_isa_gives_the_same_bits(packed, x, pools[n_threads], (n_rows, n_threads))


@pytest.mark.parametrize("paired", (False, True), ids=("apart", "paired"))
@pytest.mark.parametrize("k", (256, 2048))
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_four_row_tiles_give_the_same_bits_with_short_and_long_rows(qtype, k, paired, pools):
    """Four rows, one tile of them, and sixteen (the AMX path's tile), over short rows and long ones (many blocks a
    row: each block's integer sums start again, the prefetches run on past the row group into the next, and the AMX
    path prepares a row's blocks in runs of 32): the scalar path's bits."""
    rng = np.random.default_rng(700 + int(qtype) + k)
    n_blocks = k // TYPE_INFO[qtype].block_size
    raw = random_blocks(qtype, 21, n_blocks, rng)
    packed = rp.repack(raw, qtype, (k, 21), paired)
    for m in (4, 16):
        x = rng.standard_normal((m, k)).astype(np.float32)
        _assert_every_isa_gives_the_same_bits(packed, x, pools[2], (k, m))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_paired_groups_give_the_bits_of_groups_apart(qtype, isa, pools):
    """Pairing is a layout, not arithmetic: every tile the paths run on a paired weight (two groups at a time from
    one stream, where they do) gives the bits the groups apart give, for decode-sized calls and prompt-sized ones,
    with a last group alone (45 rows) and without (48)."""
    rng = np.random.default_rng(1100 + int(qtype))
    for n_rows in (45, 48):
        raw, ne = _weight(qtype, rng, n_rows)
        apart, paired = (rp.repack(raw, qtype, ne, p) for p in (False, True))
        for m in (1, 2, 4, 7):
            x = rng.standard_normal((m, ne[0])).astype(np.float32)
            for n_threads in (1, 2):
                want = kernels.mul_mat(apart, x, pools[n_threads], isa)
                assert np.array_equal(kernels.mul_mat(paired, x, pools[n_threads], isa), want), (n_rows, m, n_threads)


def codes_at_an_extreme(packed: rp.PackedWeight, low: bool) -> rp.PackedWeight:
    """``packed`` with every code at its largest index (``low``: its smallest; 8-bit codes 127, or -128), laid out
    as before (paired again where it was): each block's integer sums then reach the bounds the x86 paths rely on."""
    nb, cb = packed.n_cols // rp.BLOCK, rp.code_bytes(packed.kind)
    bb = rp.block_bytes(packed.kind, packed.n_scales, packed.has_offsets, packed.half_params, packed.factored)
    groups = unpaired_groups(packed).copy()
    extreme = (0x80 if low else 0x7F) if packed.kind == rp.KIND_QBYTE else (0x00 if low else 0xFF)
    for b in range(nb):
        groups[:, b * bb:b * bb + rp.ROWS * cb] = extreme
    if packed.paired:
        rp._pair_groups(groups[:len(groups) // 2 * 2], nb, bb)
    return dataclasses.replace(packed, data=groups.reshape(-1))


@pytest.mark.parametrize("paired", (False, True), ids=("apart", "paired"))
@pytest.mark.parametrize("low", (False, True), ids=("largest", "smallest"))
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_integer_sums_at_their_extremes_neither_wrap_nor_saturate(qtype, low, paired, pools):
    """Every code at an extreme against activations whose codes are all +127 or all -127 (rows of one value): the
    16-bit sums of nibble indices, |w| <= 128 under vpsignb and a base added as a float at their bounds, one row, two
    and four (a tile of each size), on every path: the scalar path's bits, and the oracle's values."""
    rng = np.random.default_rng(1100 + int(qtype))
    raw, ne = _weight(qtype, rng, 21)
    packed = codes_at_an_extreme(rp.repack(raw, qtype, ne, paired), low)
    w = unpack_values(packed).astype(np.float64)
    x = np.repeat(np.array([[1.0], [-1.0], [3.0], [-0.5], [1.0], [-2.0], [0.25]], np.float32), ne[0], axis=1)
    _assert_every_isa_gives_the_same_bits(packed, x, pools[2], low)
    got = kernels.mul_mat(packed, x, pools[2], ISAS[0])
    finite = np.isfinite(w).all(axis=1)  # MXFP4's largest codes may overflow to inf with its largest exponents
    err = np.abs(got[:, finite] - x.astype(np.float64) @ w[finite].T)
    assert (err <= activation_bound(x, w[finite])).all(), float(err.max())


def _assert_every_isa_gives_the_same_bits(packed, x: np.ndarray, pool, context: object) -> None:
    results = [kernels.mul_mat(packed, x, pool, isa) for isa in ISAS]
    for isa, result in zip(ISAS, results):
        assert np.array_equal(result, results[0]), (isa, context)


@pytest.mark.parametrize("paired", (False, True), ids=("apart", "paired"))
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", (GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F16), ids=lambda t: t.name)
def test_a_row_is_bit_identical_alone_and_inside_any_batch_and_thread_split(qtype, isa, paired, pools):
    rng = np.random.default_rng(900 + int(qtype))
    raw, ne = _weight(qtype, rng)
    packed = rp.repack(raw, qtype, ne, paired)
    row = rng.standard_normal((1, ne[0])).astype(np.float32)
    alone = kernels.mul_mat(packed, row, pools[1], isa)
    for batch, place in ((2, 1), (3, 0), (8, 5), (17, 16), (40, 21)):
        x = rng.standard_normal((batch, ne[0])).astype(np.float32)
        x[place] = row[0]
        for n_threads, pool in pools.items():
            got = kernels.mul_mat(packed, x, pool, isa)
            assert np.array_equal(got[place], alone[0]), (batch, place, n_threads)


def _weight(qtype: GGMLType, rng: np.random.Generator, n_rows: int = 45) -> tuple[np.ndarray, tuple[int, int]]:
    if qtype in FLOAT_TYPES:
        return random_float_tensor(qtype, n_rows, 100, rng), (100, n_rows)
    n_blocks = 4 if TYPE_INFO[qtype].block_size == 32 else 2
    return random_blocks(qtype, n_rows, n_blocks, rng), (n_blocks * TYPE_INFO[qtype].block_size, n_rows)


def test_unsupported_types_and_shapes_are_refused():
    with pytest.raises(QuantError, match="no kernel for IQ2_XXS"):
        rp.repack(np.zeros(66, np.uint8), GGMLType.IQ2_XXS, (256, 1))
    with pytest.raises(QuantError):
        rp.repack(np.zeros(17, np.uint8), GGMLType.Q4_0, (32, 1))  # one byte short


def test_isa_option_picks_a_path_this_cpu_runs_and_refuses_others():
    assert kernels.resolve_isa("auto") in ISAS
    assert kernels.resolve_isa("scalar") == "scalar"
    for isa in set(kernels.ISAS) - set(ISAS):
        with pytest.raises(ConfigError, match="cannot run on this CPU"):
            kernels.resolve_isa(isa)


@pytest.mark.parametrize("k", (96, 672))  # 672: 21 blocks a row, past the 16 the AVX-512 path divides at once
@pytest.mark.parametrize("isa", ISAS)
def test_activation_codes_round_half_to_even_bit_exactly(isa, k, pools):
    """The activation quantization's bits, read through a one-hot Q8_0 weight (row j picks element j with scale 1,
    so y[j] = d * q[j] exactly): q = round-half-even(x * 127 / amax) in double, d = amax / 127 in float32; the
    scalar path and the vector one (AVX2 and AVX-512) alike."""
    raw = np.zeros((k, k // 32, 34), dtype=np.uint8)
    raw[:, :, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    for j in range(k):
        raw[j, j // 32, 2 + j % 32] = 1
    rng = np.random.default_rng(17)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, :32] = np.arange(32) - 15.5
    x[0, 0] = 127.0  # amax 127: the scale is 1, so each of the first block's x.5 values is a tie
    x[0, 64:] *= np.float32(1e-39)  # subnormal inputs: the reciprocal in double does not overflow
    x[1, :32] = -0.0  # an all-zero block: scale 0, codes 0
    x[1, 32:64] *= np.float32(1e37)  # the largest magnitudes still taken as finite
    x[2] = (rng.standard_normal(k) * 2.0 ** rng.integers(-30, 30, k)).astype(np.float32)  # exponents apart
    blocks = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(x.reshape(-1, 32)).max(axis=1)
    inv = np.divide(127.0, amax.astype(np.float64), out=np.zeros(amax.shape), where=amax > 0)
    codes = np.clip(np.rint(blocks * inv[:, None]), -127, 127).astype(np.float32)
    expected = ((amax / np.float32(127))[:, None] * codes).reshape(x.shape)
    got = kernels.mul_mat(rp.repack(raw.reshape(-1), GGMLType.Q8_0, (k, k)), x, pools[1], isa)
    np.testing.assert_array_equal(got, expected)
