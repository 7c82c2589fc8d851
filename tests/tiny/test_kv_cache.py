"""The KV cache's cell bookkeeping on a real (tiny, random-weight) llama model: slot search, all-or-nothing
reservation, masks per sequence, llama.cpp's sliding-window rules and SWA cell reuse, the composite memory."""
from __future__ import annotations

import numpy as np
import pytest

import llmfw
from llmfw.core.batch import Batch, BatchAllocator
from llmfw.core.memory import CompositeMemory, KVCache
from llmfw.core.runtime.kv_cache import RUN_CELLS, RUN_TOKENS_MAX
from support.models import TINY_N_EMBD, TINY_N_VOCAB, write_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("kv") / "tiny.gguf")
    with llmfw.load_model(path, backend="numpy") as m:
        yield m


def reserve(cache, tokens, seq_id=0, n_ubatch=512, pos=None):
    """Allocate a batch against the cache, reserve and apply it; returns (ubatches, reservation)."""
    allocator = BatchAllocator(n_vocab=TINY_N_VOCAB, n_embd=TINY_N_EMBD, n_seq_max=cache.n_seq_max)
    batch = allocator.init(Batch(tokens, seq_id=seq_id, pos=pos), cache)
    ubatches, reserved = cache.init_batch(batch, n_ubatch)
    if reserved is not None:
        for i in range(len(ubatches)):
            reserved.apply(i)
    return ubatches, reserved


def test_slots_and_mask_per_sequence(tiny_model):
    cache = KVCache(tiny_model, n_ctx=256, n_seq_max=2)
    reserve(cache, [1, 2, 3], seq_id=0)
    ubatches, reserved = reserve(cache, [4, 5], seq_id=1)
    assert (cache.seq_pos_max(0), cache.seq_pos_max(1)) == (2, 1)
    assert cache.get_n_kv() == 256 and cache.n_used == 5
    inputs = {}
    reserved.set_inputs(0, ubatches[0], inputs)
    mask = inputs["kq_mask:kv"]
    assert mask.shape == (2, 256)
    visible = np.isfinite(mask)
    # seq 1's short prompt starts a run of its own: the next block of RUN_CELLS free cells
    assert np.flatnonzero(visible[0]).tolist() == [RUN_CELLS]  # seq 1 pos 0 sees itself only
    assert np.flatnonzero(visible[1]).tolist() == [RUN_CELLS, RUN_CELLS + 1]
    assert inputs["kv_idx:kv"].tolist() == [RUN_CELLS, RUN_CELLS + 1]


def decode_together(cache, seqs, steps):
    """``steps`` decode steps of one token for each of ``seqs`` together; returns each step's reservation."""
    allocator = BatchAllocator(n_vocab=TINY_N_VOCAB, n_embd=TINY_N_EMBD, n_seq_max=cache.n_seq_max)
    reservations = []
    for _ in range(steps):
        batch = allocator.init(Batch([1] * len(seqs), seq_id=list(seqs)), cache)
        ubatches, reserved = cache.init_batch(batch, 512)
        assert reserved is not None
        for i in range(len(ubatches)):
            reserved.apply(i)
        reservations.append(reserved)
    return reservations


def cells_of(cache, seq_id):
    """The cells of a sequence by ascending position."""
    cells = np.flatnonzero(cache._has_seq(cache.cells, seq_id))
    return cells[np.argsort(cache.cells.pos[cells])]


def runs_of(cells):
    """The maximal runs of consecutive cells."""
    return np.split(cells, np.flatnonzero(np.diff(cells) != 1) + 1)


def test_sequences_decoded_together_keep_their_cells_in_runs(tiny_model):
    """Each sequence's tokens go to the cell after its last one, a new run starting at the first wholly free block
    of RUN_CELLS cells: sequences decoded together do not take turns cell by cell. A prompt longer than
    RUN_TOKENS_MAX takes the cells from head; a sequence whose next cell it took goes on in a new run."""
    cache = KVCache(tiny_model, n_ctx=512, n_seq_max=4)
    reserve(cache, [1, 2, 3, 4, 5], seq_id=0)  # a short prompt: a run from block 0
    decode_together(cache, [0, 1, 2], steps=40)
    first_cells = [int(cells_of(cache, s)[0]) for s in range(3)]
    assert first_cells == [0, RUN_CELLS, 2 * RUN_CELLS]
    for s in range(3):
        runs = runs_of(cells_of(cache, s))
        assert len(runs) == 2, s  # a block filled, then a new run where the next cell was another's
        assert all(run[0] % RUN_CELLS == 0 for run in runs) and len(runs[0]) == RUN_CELLS, s
    # seq 3's long prompt fills cells from head (right after seq 2's last cell): seq 2 goes on in a new run
    tail_2 = int(cells_of(cache, 2)[-1])
    reserve(cache, list(range(RUN_TOKENS_MAX + 1)), seq_id=3)
    assert cells_of(cache, 3).tolist() == list(range(tail_2 + 1, tail_2 + 2 + RUN_TOKENS_MAX))
    decode_together(cache, [2], steps=1)
    last = int(cells_of(cache, 2)[-1])
    assert last % RUN_CELLS == 0 and last > tail_2 + 1 + RUN_TOKENS_MAX


def test_runs_leave_every_cell_usable(tiny_model):
    """When no block is wholly free, a step's tokens take the free cells from head: runs never cost capacity. After
    a 5-token prompt four sequences decoding together fill 253 of 256 cells; then only three tokens fit."""
    cache = KVCache(tiny_model, n_ctx=256, n_seq_max=4)
    reserve(cache, [1, 2, 3, 4, 5], seq_id=0)
    decode_together(cache, [0, 1, 2, 3], steps=62)
    assert cache.n_used == 253
    allocator = BatchAllocator(n_vocab=TINY_N_VOCAB, n_embd=TINY_N_EMBD, n_seq_max=4)
    assert cache.init_batch(allocator.init(Batch([1] * 4, seq_id=[0, 1, 2, 3]), cache), 512)[1] is None
    decode_together(cache, [0, 1, 2], steps=1)
    assert cache.n_used == 256


def test_reservation_is_all_or_nothing(tiny_model):
    cache = KVCache(tiny_model, n_ctx=256)
    reserve(cache, list(range(200)))
    before = (cache.cells.pos.copy(), cache.cells.seq.copy())
    _, reserved = reserve(cache, list(range(60)), n_ubatch=16)  # 4 ubatches, 56 free cells
    assert reserved is None
    assert np.array_equal(cache.cells.pos, before[0]) and np.array_equal(cache.cells.seq, before[1])
    cache.seq_rm(0, 0, 10)  # free 10 cells at the start: the search wraps around to them
    _, reserved = reserve(cache, list(range(60)), n_ubatch=16)
    assert reserved is not None and cache.n_used == 250


@pytest.mark.parametrize("swa_type, token_pos, expected_visible", [
    ("standard", 9, [6, 7, 8, 9]),  # p - cell_pos < n_swa
    ("chunked", 9, [8, 9]),  # same chunk of n_swa positions
    ("symmetric", 5, [3, 4, 5]),  # |p - cell_pos| <= n_swa / 2, causal on top
])
def test_sliding_window_masks(tiny_model, swa_type, token_pos, expected_visible):
    cache = KVCache(tiny_model, n_ctx=256, n_swa=4, swa_type=swa_type)
    reserve(cache, list(range(1, token_pos + 1)))
    ubatches, reserved = reserve(cache, [99])
    inputs = {}
    reserved.set_inputs(0, ubatches[0], inputs)
    visible_cells = np.flatnonzero(np.isfinite(inputs["kq_mask:kv"][0]))
    assert cache.cells.pos[visible_cells].tolist() == expected_visible


def test_sliding_window_reuses_cells(tiny_model):
    cache = KVCache(tiny_model, n_ctx=256, n_swa=8, swa_type="standard")
    for start in range(0, 600, 50):  # 600 tokens through 256 cells: cells out of the window are reused
        _, reserved = reserve(cache, list(range(start, start + 50)))
        assert reserved is not None, start
    assert cache.seq_pos_max(0) == 599
    # positions kept stay contiguous and cover at least the window
    assert cache.seq_pos_min(0) <= 599 - 8
    kept = np.sort(cache.cells.pos[cache.cells.seq != 0])
    assert np.array_equal(kept, np.arange(kept[0], 600))


def test_the_order_input_lists_the_cells_by_position(tiny_model):
    """kv_order: cell order while the cells fill in position order (the empty padding last), and the ring's cells
    by position once a sliding window reuses them."""
    cache = KVCache(tiny_model, n_ctx=256, n_seq_max=2, n_swa=8, swa_type="standard")
    ubatches, reserved = reserve(cache, list(range(100)))
    inputs = {}
    reserved.set_inputs(0, ubatches[0], inputs)
    assert np.array_equal(inputs["kv_order:kv"], np.arange(256)) and inputs["kv_order:kv"].dtype == np.int32
    for start in range(100, 300, 50):  # past 256 cells: the window reuses the oldest ones
        ubatches, reserved = reserve(cache, list(range(start, start + 50)), pos=list(range(start, start + 50)))
    inputs = {}
    reserved.set_inputs(0, ubatches[0], inputs)
    order = inputs["kv_order:kv"]
    assert sorted(order.tolist()) == list(range(256)) and not np.array_equal(order, np.arange(256))
    used = order[cache.cells.pos[order] >= 0]
    assert np.all(np.diff(cache.cells.pos[used]) > 0)  # one sequence: strictly by position
    assert np.all(cache.cells.pos[order[len(used):]] == -1)


def test_plain_cache_does_not_reuse_cells(tiny_model):
    cache = KVCache(tiny_model, n_ctx=256)
    reserve(cache, list(range(250)))
    _, reserved = reserve(cache, list(range(10)))
    assert reserved is None


def test_composite_memory_reserves_in_every_part(tiny_model):
    base = KVCache(tiny_model, n_ctx=512, name="base", layers=[0])
    swa = KVCache(tiny_model, n_ctx=256, name="swa", layers=[1], n_swa=4, swa_type="standard")
    memory = CompositeMemory([base, swa])
    assert memory.cache_of_layer(0) == "base" and memory.cache_of_layer(1) == "swa"
    ubatches, reserved = reserve(memory, list(range(300)), n_ubatch=64)  # the window part reuses cells
    assert reserved is not None
    inputs = {}
    reserved.set_inputs(0, ubatches[0], inputs)
    assert {"kq_mask:base", "kq_mask:swa", "kv_idx:base", "kv_idx:swa"} <= set(inputs)
    assert memory.seq_pos_max(0) == 299
    memory.seq_rm(0, 100, -1)
    assert base.seq_pos_max(0) == 99 and swa.seq_pos_max(0) == 99
    memory.clear()
    assert memory.seq_pos_max(0) == -1


def test_kept_decode_plans_stay_within_their_token_budget(tiny_model):
    """A context keeps its recent decode plans (at most one token per sequence) up to 3 tokens per sequence in all:
    with two sequences, decode shapes of 1 + 2 + 2 tokens over a short cache and 1 + 2 over a longer one (the
    cache's padded length is part of a plan) keep the last three; a kept shape is reused, the first one was let
    go and is built again."""
    ctx = tiny_model.new_context(n_ctx=512, n_seq_max=2)
    n_past = {0: 0, 1: 0}

    def decode(seqs, outputs=None):
        pos = []
        for s in seqs:
            pos.append(n_past[s])
            n_past[s] += 1
        assert ctx.decode(Batch([5] * len(seqs), pos=pos, seq_id=seqs, logits=outputs)) == 0

    decode([0] * 8)
    short = [([0], [True]), ([0, 1], [False, True]), ([0, 1], [True, True])]
    for shape in short:
        decode(*shape)
    decode([1] * 250)  # the cache now holds over 256 cells: the decode plans differ
    for shape in short[:2]:
        decode(*shape)
    builds = ctx.n_graph_builds
    decode(*short[0])
    assert ctx.n_graph_builds == builds  # the longer cache's one-token plan: kept
    ctx.memory.clear()  # back to the short cache
    n_past.update({0: 0, 1: 0})
    decode(*short[2])
    assert ctx.n_graph_builds == builds  # kept
    decode(*short[0])
    assert ctx.n_graph_builds == builds + 1  # let go for the budget: built again
