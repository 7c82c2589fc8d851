"""The interleaved sliding-window KV cache (memory module ``kv_cache_iswa``, llama.cpp's ``llama_kv_cache_iswa``)
on the real Gemma-3-270M hyperparameters (18 layers, every 6th global, window 512).

These tests drive the cells, slots, masks and sequence operations directly (no graph is computed, so they are
fast): the cache sizes follow llama.cpp, a local layer's cache stays bounded by the window while the global one
keeps everything, every token sees exactly its window of positions (nothing it needs was evicted) and every
sequence operation reaches both caches.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import llmfw
from llmfw.core.batch import BatchAllocator, split_simple
from llmfw.core.errors import ContextError
from llmfw.core.memory import ISWA_BASE_CACHE, ISWA_SWA_CACHE, KVCache, KVCacheISWA, swa_cache_size
from llmfw.core.plugins import registry

N_SWA = 512
GLOBAL_LAYERS = [5, 11, 17]
CELL_BYTES = 4 * (256 + 256)  # one KV head of 256 for K and for V, float32


@pytest.fixture(scope="module")
def model(shared_models):
    # the hyperparameters are all these tests need: no weights
    return shared_models.get("gemma3", vocab_only=True)


def pad(n: int) -> int:
    return (n + 255) // 256 * 256


def iswa(model, n_ctx=2048, n_seq_max=1, n_ubatch=512, **kw) -> KVCacheISWA:
    return KVCacheISWA(model, n_ctx, n_seq_max, n_ubatch, **kw)


def reserve_steps(model, memory, n_tokens, *, seq_id=0, n_ubatch=512, n_seq_max=1):
    """Reserve cells for ``n_tokens`` continuing ``seq_id``, then commit the ubatches one by one, yielding
    (ubatch, inputs) right after each is committed (as decode does before computing it)."""
    allocated = BatchAllocator(model.n_vocab, model.n_embd, n_seq_max).init(
        llmfw.Batch([2] * n_tokens, seq_id=seq_id), memory)
    ubatches = split_simple(allocated, n_ubatch)
    reserved = memory.prepare(ubatches)
    assert reserved is not None, f"no slot for {n_tokens} tokens"
    for i, ub in enumerate(ubatches):
        reserved.apply(i)
        inputs: dict[str, np.ndarray] = {}
        reserved.set_inputs(i, ub, inputs)
        yield ub, inputs


def reserve(model, memory, n_tokens, **kw):
    """All of :func:`reserve_steps` (the inputs of earlier ubatches refer to cells as they were then)."""
    return list(reserve_steps(model, memory, n_tokens, **kw))


def visible_positions(cache: KVCache, mask_row: np.ndarray) -> np.ndarray:
    return np.sort(cache.cells.pos[: mask_row.shape[0]][mask_row == 0])


def snapshot(memory: KVCacheISWA):
    return [(p.cells.pos.copy(), p.cells.seq.copy(), p.cells.head) for p in memory.parts]


# -- construction ----------------------------------------------------------------------------------------------

def test_registered_and_chosen_by_gemma3(model):
    assert registry("memory").get("kv_cache_iswa") is KVCacheISWA
    assert model.arch.memory == "kv_cache_iswa"
    hp = model.hparams
    assert hp.n_swa == N_SWA and hp.swa_type == "standard"
    assert [il for il in range(hp.n_layer) if not hp.is_swa(il)] == GLOBAL_LAYERS


@pytest.mark.parametrize("n_ctx, n_seq_max, n_ubatch, base, swa", [
    (4096, 1, 512, 4096, 1024),   # window + one ubatch
    (4096, 1, 64, 4096, 768),     # 512 + 64 padded to 256
    (4096, 4, 512, 4096, 2560),   # one window per sequence (unified cache)
    (512, 1, 512, 512, 512),      # never more than the whole context
    (1000, 1, 1, 1024, 768),      # n_ctx padded to 256 first
])
def test_sizes_follow_llama_cpp(model, n_ctx, n_seq_max, n_ubatch, base, swa):
    memory = iswa(model, n_ctx, n_seq_max, n_ubatch)
    assert (memory.base.n_cells, memory.swa.n_cells) == (base, swa)
    assert memory.cache_names == [ISWA_BASE_CACHE, ISWA_SWA_CACHE]
    assert memory.base.layers == GLOBAL_LAYERS and len(memory.swa.layers) == 15
    assert all(memory.cache_of_layer(il) == ISWA_BASE_CACHE for il in GLOBAL_LAYERS)
    assert memory.cache_of_layer(0) == memory.cache_of_layer(16) == ISWA_SWA_CACHE
    assert memory.nbytes == CELL_BYTES * (3 * base + 15 * swa)
    assert swa_cache_size(pad(n_ctx), N_SWA, n_seq_max, n_ubatch) == swa


def test_swa_full_and_create_from_context_params(model):
    assert iswa(model, 4096, swa_full=True).swa.n_cells == 4096
    memory = KVCacheISWA.create(model, SimpleNamespace(n_ctx=4096, n_seq_max=2, n_ubatch=128))
    assert isinstance(memory, KVCacheISWA) and memory.swa.n_cells == pad(2 * N_SWA + 128)


def test_without_a_window_the_plain_cache_is_used(gemma3_path):
    # a Gemma 3 file without attention.sliding_window: every layer global, one KVCache (llama.cpp does the same)
    model = llmfw.load_model(gemma3_path, vocab_only=True, kv_overrides={"gemma3.attention.sliding_window": 0})
    assert model.hparams.swa_type == "none" and not any(model.hparams.swa_layers)
    memory = KVCacheISWA.create(model, SimpleNamespace(n_ctx=1024, n_seq_max=1, n_ubatch=512))
    assert type(memory) is KVCache and memory.n_cells == 1024 and memory.swa_type == "none"
    with pytest.raises(ContextError, match="sliding-window layers"):
        KVCacheISWA(model, 1024)


# -- the window -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_ubatch", [512, 64])
def test_every_token_sees_exactly_its_window(model, n_ubatch):
    """1,500 tokens through a 2,048-cell context: the SWA cache (1,024 / 768 cells) reuses cells that left the
    window, yet each token sees positions max(0, p-511)..p in the local mask and 0..p in the global one."""
    memory = iswa(model, 2048, n_ubatch=n_ubatch)
    n_tokens = 1500
    for ub, inputs in reserve_steps(model, memory, n_tokens, n_ubatch=n_ubatch):
        assert memory.swa.n_used <= memory.swa.n_cells
        swa_mask, base_mask = inputs[f"kq_mask:{ISWA_SWA_CACHE}"], inputs[f"kq_mask:{ISWA_BASE_CACHE}"]
        assert swa_mask.shape == (ub.n_tokens, memory.swa.get_n_kv())
        assert base_mask.shape[1] <= memory.base.n_cells
        assert memory.swa.get_n_kv() <= memory.swa.n_cells
        # each ubatch writes its tokens into distinct cells of each cache
        for name in (ISWA_SWA_CACHE, ISWA_BASE_CACHE):
            assert np.unique(inputs[f"kv_idx:{name}"]).size == ub.n_tokens
        for row, p in enumerate(ub.pos.tolist()):
            local = visible_positions(memory.swa, swa_mask[row])
            np.testing.assert_array_equal(local, np.arange(max(0, p - N_SWA + 1), p + 1))
            if row % 97 == 0 or row == ub.n_tokens - 1:  # the global rule is simple: spot-check it
                np.testing.assert_array_equal(visible_positions(memory.base, base_mask[row]), np.arange(p + 1))
    # the global cache keeps every position, the local one dropped the oldest
    assert memory.base.seq_pos_min(0) == 0 and memory.base.n_used == n_tokens
    assert memory.swa.seq_pos_min(0) > 0 and memory.swa.n_used <= memory.swa.n_cells
    assert memory.seq_pos_max(0) == n_tokens - 1
    assert memory.seq_pos_min(0) == memory.swa.seq_pos_min(0)  # llama.cpp answers from the SWA cache


def test_one_token_steps_past_the_window_reuse_cells(model):
    memory = iswa(model, 2048, n_ubatch=512)
    reserve(model, memory, 600)
    for _ in range(700):
        ((ub, inputs),) = reserve(model, memory, 1)
        p = int(ub.pos[0])
        local = visible_positions(memory.swa, inputs[f"kq_mask:{ISWA_SWA_CACHE}"][0])
        np.testing.assert_array_equal(local, np.arange(p - N_SWA + 1, p + 1))
    assert memory.seq_pos_max(0) == 1299
    assert memory.swa.n_used <= memory.swa.n_cells == 1024
    assert memory.base.n_used == 1300


# -- sequence operations reach both caches ------------------------------------------------------------------------

def test_sequence_operations_apply_to_both_caches(model):
    memory = iswa(model, 2048, n_seq_max=3)
    reserve(model, memory, 700, seq_id=0, n_seq_max=3)
    memory.seq_cp(0, 1, -1, -1)
    for part in memory.parts:
        assert part.seq_pos_max(1) == 699
    assert memory.base.seq_pos_min(1) == 0 and memory.swa.seq_pos_min(1) == memory.swa.seq_pos_min(0)

    memory.seq_rm(1, 650, -1)
    assert [p.seq_pos_max(1) for p in memory.parts] == [649, 649]
    assert memory.seq_pos_max(1) == 649 and memory.seq_pos_max(0) == 699

    memory.seq_add(1, -1, -1, 10)
    assert [p.seq_pos_max(1) for p in memory.parts] == [659, 659]
    assert memory.base.has_shift and memory.swa.has_shift

    memory.seq_keep(1)
    assert memory.seq_pos_max(0) == -1 and all(p.seq_pos_max(0) == -1 for p in memory.parts)
    assert memory.seq_pos_max(1) == 659

    # continue sequence 1 past its window after the shift: still exactly the window
    ((ub, inputs),) = reserve(model, memory, 1, seq_id=1, n_seq_max=3)
    assert int(ub.pos[0]) == 660
    local = visible_positions(memory.swa, inputs[f"kq_mask:{ISWA_SWA_CACHE}"][0])
    np.testing.assert_array_equal(local, np.arange(660 - N_SWA + 1, 661))

    memory.clear()
    assert all(p.n_used == 0 and p.seq_pos_max(1) == -1 for p in memory.parts)


def test_no_slot_in_one_cache_changes_neither(model):
    memory = iswa(model, 1024, n_ubatch=512)
    reserve(model, memory, 900)
    before = snapshot(memory)
    allocated = BatchAllocator(model.n_vocab, model.n_embd, 1).init(llmfw.Batch([2] * 200), memory)
    # the global cache has 124 free cells left: the batch must be refused in both caches
    assert memory.prepare(split_simple(allocated, 512)) is None
    for (pos, seq, head), part in zip(before, memory.parts):
        np.testing.assert_array_equal(pos, part.cells.pos)
        np.testing.assert_array_equal(seq, part.cells.seq)
        assert head == part.cells.head
