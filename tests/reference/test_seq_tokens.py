"""The context owns what is in its cache: ``ctx.seq_tokens`` follows every decode and every sequence operation,
so a caller who rewrites a sequence (even to the same length) never leaves generate a stale prefix to reuse."""
from __future__ import annotations

import pytest

import llmfw
from llmfw.core.batch import Batch
from llmfw.core.generate import GenerationStats


@pytest.fixture(scope="module")
def model(shared_models):
    return shared_models.get("smollm2", "numpy")


def test_decode_and_every_sequence_operation_update_the_records(model) -> None:
    ctx = model.new_context(n_ctx=256, n_seq_max=3, n_threads=1)
    records = ctx.seq_tokens
    assert ctx.decode(Batch([1, 422, 1115, 314])) == 0
    assert records == [[1, 422, 1115, 314], [], []]
    assert ctx.memory.seq_rm(0, 2, -1)
    assert records[0] == [1, 422]
    assert ctx.decode(Batch([7])) == 0
    assert records[0] == [1, 422, 7]
    ctx.memory.seq_cp(0, 1)
    ctx.memory.seq_cp(0, 2, 0, 2)
    assert records == [[1, 422, 7], [1, 422, 7], [1, 422]]
    assert ctx.memory.seq_rm(1, 1, -1)
    assert records[1] == [1]
    ctx.memory.seq_add(0, 2, -1, 5)  # positions from 2 on moved
    assert records[0] == [1, 422]
    ctx.memory.seq_keep(2)
    assert records == [[], [], [1, 422]]
    assert ctx.decode(Batch([5, 6], seq_id=2)) == 0
    assert records[2] == [1, 422, 5, 6]
    ctx.memory.clear()
    assert records == [[], [], []]


def test_an_aborted_decode_cuts_the_records_where_it_began(model) -> None:
    polls: list[int] = []

    def abort_on_second_ubatch() -> bool:
        polls.append(1)
        return len(polls) == 2

    ctx = model.new_context(n_ctx=256, n_batch=8, n_ubatch=2, n_threads=1, abort_callback=abort_on_second_ubatch)
    assert ctx.decode(Batch([1, 422])) == 0 and ctx.seq_tokens[0] == [1, 422]
    polls.clear()
    assert ctx.decode(Batch([9, 8, 7, 6])) == 2  # one ubatch ran, then the abort
    assert ctx.memory.seq_pos_max(0) == 3  # the first ubatch's cells are in the cache ...
    assert ctx.seq_tokens[0] == [1, 422]  # ... but nothing from where the batch began is claimed


def test_generate_never_reuses_a_sequence_rewritten_to_the_same_length(model) -> None:
    ctx = model.new_context(n_ctx=256, n_threads=1)
    prompt = "The capital of France is"
    first = "".join(llmfw.generate(ctx, prompt, max_tokens=6))
    n = len(ctx.seq_tokens[0])
    other = model.vocab.tokenize("A list of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37")
    assert ctx.memory.seq_rm(0, -1, -1)
    assert ctx.decode(Batch(other[:n])) == 0  # the sequence rewritten to the same length with other tokens
    assert ctx.seq_tokens[0] == other[:n]
    stats = GenerationStats()
    again = "".join(llmfw.generate(ctx, prompt, max_tokens=6, stats=stats))
    assert again == first and stats.n_cached <= 1  # only the BOS can match the rewritten sequence
