"""The native backend's row-wise ops (RMS norm, attention over the KV cache) against the numpy backend's kernels
(the oracle), and the property they are built for: a row's result is the same bits alone or in any batch, on any
thread split and on every ISA path (csrc/attention.c's canonical arithmetic)."""
from __future__ import annotations

import numpy as np
import pytest

from llmfw.plugins.backends.numpy.kernels import NumpyKV, attention, rms_norm

from support.native import kernels_or_skip

kernels = kernels_or_skip()
#: every ISA path this CPU runs (the portable C one everywhere)
ISAS = kernels.available_isas()


@pytest.fixture(scope="module")
def pool():
    made = kernels.ThreadPool(3)
    yield made
    made.close()


@pytest.mark.parametrize("with_weight", [False, True])
def test_rms_norm_matches_the_oracle(pool, with_weight):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 3, 45)) * 5).astype(np.float32)
    w = rng.standard_normal(45).astype(np.float32) if with_weight else None
    np.testing.assert_allclose(kernels.rms_norm(x, 1e-6, w, pool), rms_norm(x, 1e-6, w), rtol=2e-6, atol=1e-7)


def causal_case(rng, n_tokens, n_head, n_head_kv, dk, dv, n_cells, n_kv, start):
    """q for tokens at positions start.., a cache whose first start+n_tokens cells are filled, a causal mask."""
    q = rng.standard_normal((n_tokens, n_head, dk)).astype(np.float32)
    kv = NumpyKV(np.zeros((n_head_kv, n_cells, dk), np.float32), np.zeros((n_head_kv, n_cells, dv), np.float32))
    kv.k[:, :start + n_tokens] = rng.standard_normal((n_head_kv, start + n_tokens, dk))
    kv.v[:, :start + n_tokens] = rng.standard_normal((n_head_kv, start + n_tokens, dv))
    cells = np.arange(n_kv)[None, :]
    mask = np.where(cells <= start + np.arange(n_tokens)[:, None], 0.0, -np.inf).astype(np.float32)
    return q, kv, mask


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_attention_matches_the_oracle(pool, softcap):
    rng = np.random.default_rng(2)
    q, kv, mask = causal_case(rng, n_tokens=9, n_head=6, n_head_kv=2, dk=16, dv=12, n_cells=64, n_kv=32, start=5)
    got = kernels.attention(q, kv.k, kv.v, mask, 0.25, softcap, pool)
    expected = attention(q, kv, mask.shape[1], mask, 0.25, softcap)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_fully_masked_row_gives_nan_like_the_oracle(pool):
    rng = np.random.default_rng(3)
    q, kv, mask = causal_case(rng, n_tokens=2, n_head=2, n_head_kv=1, dk=8, dv=8, n_cells=16, n_kv=8, start=0)
    mask[1] = -np.inf
    got = kernels.attention(q, kv.k, kv.v, mask, 1.0, 0.0, pool)
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()
    with np.errstate(invalid="ignore"):  # the oracle's -inf - -inf
        assert np.isnan(attention(q, kv, 8, mask, 1.0, 0.0)[1]).all()


def test_attention_of_a_row_is_bit_identical_alone_and_in_a_batch(pool):
    rng = np.random.default_rng(4)
    q, kv, mask = causal_case(rng, n_tokens=12, n_head=4, n_head_kv=2, dk=16, dv=16, n_cells=64, n_kv=48, start=3)
    batch = kernels.attention(q, kv.k, kv.v, mask, 0.5, 0.0, pool)
    one_thread = kernels.ThreadPool(1)
    for row in (0, 7, 11):
        # the same query alone, with only the cells it sees (what a one-token decode step hands over)
        visible = int(np.isfinite(mask[row]).sum())
        alone = kernels.attention(q[row:row + 1], kv.k, kv.v, mask[row:row + 1, :visible], 0.5, 0.0, one_thread)
        assert np.array_equal(alone[0], batch[row]), row
    one_thread.close()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dk,dv", [(64, 72), (40, 72), (64, 20)])
def test_an_f16_cache_attends_with_the_bits_of_its_values_widened(pool, isa, dk, dv):
    """f16 K and V widen exactly, and a chunk of widened values continues the same sums: an f16 cache gives the
    bits a float32 cache holding the same values gives, prefill tiles and decode rows, on every ISA path (read in
    place by the AVX2 kernels when dk is whole 16s and dv whole 8s, else widened into a buffer; a prefill whose rows
    see most cells widens them all once, tiles of rows that each see their own few cells read them in place)."""
    rng = np.random.default_rng(5)
    q, kv, mask = causal_case(rng, n_tokens=20, n_head=6, n_head_kv=2, dk=dk, dv=dv, n_cells=160, n_kv=150,
                              start=130)
    own_cells = np.full_like(mask, -np.inf)  # 20 rows of 20 sequences, a few cells each (a batched decode step)
    for row in range(20):
        own_cells[row, row::20] = 0.0
    k16, v16 = kv.k.astype(np.float16), kv.v.astype(np.float16)
    # a prefill's tiles; one decode row (past 64 values: two chunks); tiles of rows seeing disjoint cells
    for rows, rows_mask in ((slice(0, 20), mask), (slice(19, 20), mask), (slice(0, 20), own_cells)):
        got = kernels.attention(q[rows], k16, v16, rows_mask[rows], 0.3, 0.0, pool, isa)
        widened = kernels.attention(q[rows], k16.astype(np.float32), v16.astype(np.float32), rows_mask[rows], 0.3,
                                    0.0, pool, isa)
        assert np.array_equal(got, widened)
    with pytest.raises(ValueError, match="K and V alike"):
        kernels.attention(q, k16, kv.v, mask, 0.3, 0.0, pool, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
def test_decode_rows_over_an_f16_cache_have_the_bits_of_any_head_grouping(isa, group):
    """A decode step's rows score a GQA group's heads together against each key, widened once (AVX-512: up to
    three heads a call): whatever the group's size and however the heads are split into work items (one thread
    takes a whole group, three split it), the bits are those of the float32 cache and of the portable path."""
    rng = np.random.default_rng(11)
    n_seqs, n_kv, n_head_kv = 3, 3 * 45, 2
    q = rng.standard_normal((n_seqs, group * n_head_kv, 64)).astype(np.float32)
    kv = random_cache(rng, n_head_kv, n_kv, 64, 64)
    k16, v16 = kv.k.astype(np.float16), kv.v.astype(np.float16)
    mask = np.full((n_seqs, n_kv), -np.inf, np.float32)
    for s in range(n_seqs):
        mask[s, s::n_seqs] = 0.0  # 45 cells each: two whole blocks of 16 and a cut one
    expected = kernels.attention(q, k16.astype(np.float32), v16.astype(np.float32), mask, 0.3, 0.0,
                                 kernels.ThreadPool(1), "scalar")
    for threads in (1, 3):
        pool = kernels.ThreadPool(threads)
        for rows in (slice(0, n_seqs), slice(1, 2)):
            got = kernels.attention(q[rows], k16, v16, mask[rows], 0.3, 0.0, pool, isa)
            assert np.array_equal(got, expected[rows]), (threads, rows)
        pool.close()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n_head,n_head_kv", [(2, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("cache", ["f16", "f32"])
def test_long_decode_rows_split_over_the_threads_keep_their_bits(isa, n_head, n_head_kv, cache):
    """A decode row that sees over a thousand cells is scored in ranges of cells, its softmax per head and its
    weighted sums in parts of the value dimensions, spread over every thread: the bits of one thread's whole-row
    items, with sinks and soft-caps, beside a row that sees fewer cells and one that sees none (NaN)."""
    rng = np.random.default_rng(12)
    n_kv, dk, dv = 1400, 64, 64
    q = rng.standard_normal((3, n_head, dk)).astype(np.float32)
    kv = random_cache(rng, n_head_kv, n_kv, dk, dv)
    if cache == "f16":
        kv = NumpyKV(kv.k.astype(np.float16), kv.v.astype(np.float16))
    mask = np.full((3, n_kv), -np.inf, np.float32)
    mask[0, :1300] = 0.0
    mask[0, 7] = -np.inf  # a hidden cell inside the run
    mask[1, 1000:1100] = rng.standard_normal(100).astype(np.float32)  # an additive mask
    sinks = rng.standard_normal(n_head).astype(np.float32)
    one_thread = kernels.ThreadPool(1)
    for softcap, row_sinks in ((0.0, None), (20.0, sinks)):
        expected = kernels.attention(q, kv.k, kv.v, mask, 0.3, softcap, one_thread, isa, sinks=row_sinks)
        assert np.isnan(expected[2]).all() and not np.isnan(expected[:2]).any()
        for threads in (2, 3):
            pool = kernels.ThreadPool(threads)
            for rows in (slice(0, 3), slice(0, 1)):
                got = kernels.attention(q[rows], kv.k, kv.v, mask[rows], 0.3, softcap, pool, isa, sinks=row_sinks)
                assert np.array_equal(got, expected[rows], equal_nan=True), (softcap, threads, rows)
            pool.close()
    one_thread.close()


def test_attention_refuses_shapes_that_do_not_fit(pool):
    q = np.zeros((1, 4, 8), np.float32)
    k = np.zeros((2, 16, 8), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.attention(q, k, k, np.zeros((1, 32), np.float32), 1.0, 0.0, pool)  # more cells than the cache
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.attention(q, k[:, ::2], k[:, ::2], np.zeros((1, 4), np.float32), 1.0, 0.0, pool)


def random_cache(rng, n_head_kv, n_cells, dk, dv):
    return NumpyKV(rng.standard_normal((n_head_kv, n_cells, dk)).astype(np.float32),
                   rng.standard_normal((n_head_kv, n_cells, dv)).astype(np.float32))


def window_mask(n_tokens, n_kv, start, window):
    """Causal with a sliding window: row t (at position start + t) sees cells (pos - window, pos]."""
    pos = start + np.arange(n_tokens)[:, None]
    cells = np.arange(n_kv)[None, :]
    return np.where((cells <= pos) & (cells > pos - window), 0.0, -np.inf).astype(np.float32)


# (T, H, Hkv, dk, dv, n_kv, start): odd head sizes (tails of 16 / 8 lanes), GQA groups of 1-8, a decode step's
# few rows and a prefill's tiles, key counts that end mid-block and at the cache's end
SHAPES = [(1, 8, 1, 64, 64, 40, 39), (3, 4, 4, 7, 33, 19, 16), (21, 6, 2, 20, 13, 45, 24), (37, 9, 3, 64, 64, 64, 27),
          (17, 4, 1, 256, 256, 50, 33), (18, 16, 2, 24, 40, 70, 52)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_matches_the_oracle_on_every_path(pool, isa, shape):
    n_tokens, n_head, n_head_kv, dk, dv, n_kv, start = shape
    rng = np.random.default_rng(sum(shape))
    q = rng.standard_normal((n_tokens, n_head, dk)).astype(np.float32)
    kv = random_cache(rng, n_head_kv, n_kv + 3 * (n_kv % 2), dk, dv)  # odd n_kv: the cache ends past the mask
    mask = window_mask(n_tokens, n_kv, start, n_kv)
    scale = dk ** -0.5
    got = kernels.attention(q, kv.k, kv.v, mask, scale, 0.0, pool, isa)
    np.testing.assert_allclose(got, attention(q, kv, n_kv, mask, scale, 0.0), rtol=2e-5, atol=2e-6)


def masks_of_every_kind(rng, n_tokens, n_kv):
    """A sliding window, finite additive values (ALiBi-like) with holes, and rows of a batch of two sequences."""
    window = window_mask(n_tokens, n_kv, n_kv - n_tokens, 9)
    biased = np.where(rng.random((n_tokens, n_kv)) < 0.3, -np.inf, rng.standard_normal((n_tokens, n_kv)))
    biased[:, 0] = 0.0  # every row sees a cell
    two = np.full((n_tokens, n_kv), -np.inf)
    for t in range(n_tokens):  # sequence t % 2 owns the cells of its parity, causally
        two[t, t % 2:n_kv - n_tokens + t + 1:2] = 0.0
    return {"window": window, "biased": biased.astype(np.float32), "two sequences": two.astype(np.float32)}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["window", "biased", "two sequences"])
def test_attention_honours_windows_additive_masks_and_sequences(pool, isa, kind):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((20, 6, 32)).astype(np.float32)
    kv = random_cache(rng, 3, 48, 32, 24)
    mask = masks_of_every_kind(rng, 20, 48)[kind]
    got = kernels.attention(q, kv.k, kv.v, mask, 0.2, 0.0, pool, isa)
    np.testing.assert_allclose(got, attention(q, kv, 48, mask, 0.2, 0.0), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_attention_with_sinks_and_softcaps(pool, isa, softcap):
    rng = np.random.default_rng(6)
    q = (rng.standard_normal((19, 8, 40)) * 3).astype(np.float32)
    kv = random_cache(rng, 2, 40, 40, 40)
    mask = window_mask(19, 40, 21, 12)
    sinks = rng.standard_normal(8).astype(np.float32) * 2
    got = kernels.attention(q, kv.k, kv.v, mask, 0.4, softcap, pool, isa, sinks=sinks)
    np.testing.assert_allclose(got, attention(q, kv, 40, mask, 0.4, softcap, sinks=sinks), rtol=2e-5, atol=2e-6)


def test_every_isa_path_gives_the_same_bits(pool):
    rng = np.random.default_rng(7)
    q = (rng.standard_normal((23, 8, 72)) * 4).astype(np.float32)
    kv = random_cache(rng, 2, 80, 72, 56)
    for mask in masks_of_every_kind(rng, 23, 80).values():
        for softcap, sinks in ((0.0, None), (15.0, rng.standard_normal(8).astype(np.float32))):
            outs = [kernels.attention(q, kv.k, kv.v, mask, 0.25, softcap, pool, isa, sinks=sinks) for isa in ISAS]
            for isa, out in zip(ISAS, outs):
                assert np.array_equal(out, outs[0], equal_nan=True), isa


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_bits_do_not_depend_on_the_batch_its_cells_or_the_threads(pool, isa):
    """A query row gives the same bits in a prefill's tile, alone (a decode step), with its cells moved elsewhere
    in the cache (a sequence beside another one), and on one thread or three."""
    rng = np.random.default_rng(8)
    n_tokens, n_kv = 30, 50
    q = rng.standard_normal((n_tokens, 6, 48)).astype(np.float32)
    kv = random_cache(rng, 2, 64, 48, 48)
    mask = window_mask(n_tokens, n_kv, n_kv - n_tokens, 40)
    batch = kernels.attention(q, kv.k, kv.v, mask, 0.5, 0.0, pool, isa)
    one_thread = kernels.ThreadPool(1)
    shift = 11  # the same cells' contents 11 cells later, with other data before them
    moved = NumpyKV(np.roll(kv.k, shift, axis=1).copy(), np.roll(kv.v, shift, axis=1).copy())
    for row in (0, 13, 29):
        alone = kernels.attention(q[row:row + 1], kv.k, kv.v, mask[row:row + 1], 0.5, 0.0, one_thread, isa)
        assert np.array_equal(alone[0], batch[row]), row
        moved_mask = np.full((1, n_kv + shift), -np.inf, np.float32)
        moved_mask[0, shift:] = mask[row]
        elsewhere = kernels.attention(q[row:row + 1], moved.k, moved.v, moved_mask, 0.5, 0.0, pool, isa)
        assert np.array_equal(elsewhere[0], batch[row]), row
    one_thread.close()


@pytest.mark.parametrize("isa", ISAS)
def test_a_decode_step_of_sequences_with_interleaved_cells(pool, isa):
    """Four sequences decoding together own every fourth cell each: a step scores only its own cells (gathered),
    matches the oracle, and gives each row the bits it has among a prefill's rows."""
    rng = np.random.default_rng(9)
    n_kv, n_seqs = 70, 4
    q = rng.standard_normal((n_seqs, 6, 36)).astype(np.float32)
    kv = random_cache(rng, 3, n_kv, 36, 20)
    mask = np.full((n_seqs, n_kv), -np.inf, np.float32)
    for s in range(n_seqs):
        mask[s, s::n_seqs] = 0.0
    step = kernels.attention(q, kv.k, kv.v, mask, 0.3, 0.0, pool, isa)
    np.testing.assert_allclose(step, attention(q, kv, n_kv, mask, 0.3, 0.0), rtol=2e-5, atol=2e-6)
    # an order listing one sequence's cells after another's keeps each row's own cells in cell order: the same
    # bits through the order's gathered visibility scan
    by_sequence = np.lexsort((np.arange(n_kv) // n_seqs, np.arange(n_kv) % n_seqs)).astype(np.int32)
    assert np.array_equal(kernels.attention(q, kv.k, kv.v, mask, 0.3, 0.0, pool, isa, order=by_sequence), step)
    among = np.concatenate([q, rng.standard_normal((20, 6, 36)).astype(np.float32)])
    among_mask = np.concatenate([mask, window_mask(20, n_kv, n_kv - 20, 30)])
    assert np.array_equal(kernels.attention(among, kv.k, kv.v, among_mask, 0.3, 0.0, pool, isa)[:n_seqs], step)


@pytest.mark.parametrize("layout", ["ring", "scattered"])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_cells_summed_in_the_orders_place_give_the_bits_of_position_order(pool, layout, softcap):
    """A sliding window's ring that wrapped (or cells reused anywhere) holds positions out of cell order: with the
    order (the cells by position) a row has the bits of the same keys laid out one cell per position, in a
    prefill's tile and alone, on every ISA path; an order naming a cell past n_kv is refused before C reads it."""
    rng = np.random.default_rng(10)
    n_pos, n_ring, window, n_tokens = 100, 72, 40, 30  # the ring holds every position a row sees
    q = rng.standard_normal((n_tokens, 4, 40)).astype(np.float32)
    straight = random_cache(rng, 2, n_pos, 40, 24)  # cell = position
    kept = np.arange(n_pos - n_ring, n_pos)  # the positions the ring still holds
    cell_of = kept % n_ring if layout == "ring" else rng.permutation(n_ring)
    ring = NumpyKV(np.empty((2, n_ring, 40), np.float32), np.empty((2, n_ring, 24), np.float32))
    ring.k[:, cell_of], ring.v[:, cell_of] = straight.k[:, kept], straight.v[:, kept]
    order = cell_of.astype(np.int32)  # the cells by position
    straight_mask = window_mask(n_tokens, n_pos, n_pos - n_tokens, window)
    ring_mask = np.full((n_tokens, n_ring), -np.inf, np.float32)
    ring_mask[:, cell_of] = straight_mask[:, kept]
    expected = kernels.attention(q, straight.k, straight.v, straight_mask, 0.3, softcap, pool, "scalar")
    for isa in ISAS:
        assert np.array_equal(kernels.attention(q, ring.k, ring.v, ring_mask, 0.3, softcap, pool, isa, order=order),
                              expected), isa
        for row in (0, 17, 29):
            alone = kernels.attention(q[row:row + 1], ring.k, ring.v, ring_mask[row:row + 1], 0.3, softcap, pool,
                                      isa, order=order)
            assert np.array_equal(alone[0], expected[row]), (isa, row)
    with pytest.raises(kernels.NativeError, match="outside"):
        kernels.attention(q, ring.k, ring.v, ring_mask, 0.3, softcap, pool, order=np.full(n_ring, n_ring, np.int32))
