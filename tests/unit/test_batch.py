"""The batch allocator (llama.cpp's llama_batch_allocr rules) and the ubatch split, without a model."""
from __future__ import annotations

import numpy as np
import pytest

from llmfw.core.batch import Batch, BatchAllocator, BatchError, split_simple


class ListMemory:
    """The only thing the allocator reads from a memory: the last position of each sequence."""

    def __init__(self, last: dict[int, int]):
        self.last = last

    def seq_pos_max(self, seq_id: int) -> int:
        return self.last.get(seq_id, -1)


ALLOC = BatchAllocator(n_vocab=100, n_embd=8, n_seq_max=4)


def test_defaults_continue_each_sequence_and_output_last():
    batch = ALLOC.init(Batch([5, 6, 7, 8], seq_id=[0, 1, 0, 1]), ListMemory({0: 9}))
    assert batch.pos.tolist() == [10, 0, 11, 1]
    assert batch.output.tolist() == [False, False, False, True]
    assert batch.seq_first.tolist() == [0, 1, 0, 1]
    assert batch.seq_bits.tolist() == [1, 2, 1, 2]


def test_token_shared_by_sequences_advances_all_of_them():
    batch = ALLOC.init(Batch([5, 6, 7], seq_id=[[0, 2], 2, 0]))
    assert batch.pos.tolist() == [0, 1, 1]
    assert batch.seq_bits.tolist() == [0b101, 0b100, 0b001]


def test_a_shared_token_then_its_other_sequence_starting_elsewhere_is_refused():
    """Default positions of one sequence per token continue its memory by construction; a token shared by two
    sequences advances both from the first one's memory, so the second one's next token is still checked."""
    with pytest.raises(BatchError, match=r"sequence 2: the memory ends at position 8 .*\(expected 9\)"):
        ALLOC.init(Batch([5, 6], seq_id=[[0, 2], 2]), ListMemory({0: 3, 2: 8}))
    assert ALLOC.init(Batch([5, 6], seq_id=[0, 2]), ListMemory({0: 3, 2: 8})).pos.tolist() == [4, 9]


@pytest.mark.parametrize("logits, expected", [
    (None, [False, False, True]), (True, [True] * 3), (False, [False] * 3),
    ([1, 0, 1], [True, False, True]),
])
def test_output_flags(logits, expected):
    assert ALLOC.init(Batch([1, 2, 3], logits=logits)).output.tolist() == expected


def test_explicit_positions_must_continue_the_memory():
    assert ALLOC.init(Batch([1, 2], pos=[4, 5]), ListMemory({})).pos.tolist() == [4, 5]  # empty: any start
    with pytest.raises(BatchError, match="expected 3"):
        ALLOC.init(Batch([1, 2], pos=[4, 5]), ListMemory({0: 2}))
    with pytest.raises(BatchError, match="gaps"):
        ALLOC.init(Batch([1, 2], pos=[0, 2]))
    with pytest.raises(BatchError, match=">= 0"):
        ALLOC.init(Batch([1], pos=[-1]))


def test_a_decode_step_of_several_sequences_must_continue_each_one():
    memory = ListMemory({0: 6, 2: 3})
    step = ALLOC.init(Batch([1, 2, 3], pos=[7, 0, 4], seq_id=[0, 1, 2]), memory)  # sequence 1 holds nothing
    assert step.pos.tolist() == [7, 0, 4]
    with pytest.raises(BatchError, match=r"sequence 2: the memory ends at position 3 .*\(expected 4\)"):
        ALLOC.init(Batch([1, 2, 3], pos=[7, 0, 5], seq_id=[0, 1, 2]), memory)
    with pytest.raises(BatchError, match=r"sequence 0: .*\(expected 7\)"):  # the lowest sequence is named first
        ALLOC.init(Batch([1, 2], pos=[9, 9], seq_id=[2, 0]), memory)


def test_embeddings_and_type_errors():
    batch = ALLOC.init(Batch(embd=np.ones((3, 8))))
    assert batch.tokens is None and batch.embd.dtype == np.float32 and batch.n_tokens == 3
    with pytest.raises(BatchError, match=r"\[n_tokens, 8\]"):
        ALLOC.init(Batch(embd=np.ones((3, 7))))
    with pytest.raises(BatchError, match="integers"):
        ALLOC.init(Batch([1.5, 2.0]))
    with pytest.raises(BatchError, match="llmfw.Batch"):
        ALLOC.init([1, 2, 3])
    with pytest.raises(BatchError, match="empty list"):
        ALLOC.init(Batch([1], seq_id=[[]]))


def test_split_simple_keeps_order_and_outputs():
    batch = ALLOC.init(Batch(list(range(10)), logits=True))
    ubatches = split_simple(batch, 4)
    assert [u.n_tokens for u in ubatches] == [4, 4, 2]
    assert [u.start for u in ubatches] == [0, 4, 8]
    assert np.concatenate([u.tokens for u in ubatches]).tolist() == list(range(10))
    assert ubatches[2].out_ids.tolist() == [0, 1]
    assert sum(u.n_outputs for u in ubatches) == 10
