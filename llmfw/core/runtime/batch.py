"""Batches: what the caller hands to ``ctx.decode``, how the allocator completes and validates it, and how it
is split into ubatches (llama.cpp's ``llama_batch`` / ``llama_batch_allocr`` / ``llama_ubatch``).

``Batch`` stores what the caller gave, unvalidated, so that ``decode`` can turn every problem into the
return code -1 instead of raising. :class:`BatchAllocator` fills what was left out — positions continue from
``memory.seq_pos_max(seq) + 1``, sequence 0, output only for the last token — and checks token ids,
sequence ids, lengths and position continuity. :func:`split_simple` cuts the result into ubatches of at most
``n_ubatch`` tokens in batch order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from ..errors import ContextError, LLMFWError

if TYPE_CHECKING:
    from ..tokenizer.vocab import Vocab


class SeqPositions(Protocol):
    """What a batch reads of the memory it goes into (:class:`~.memory.Memory` has it): where a sequence ends."""

    def seq_pos_max(self, seq_id: int) -> int: ...


class PromptModel(Protocol):
    """What tokenizing a prompt reads of a model."""

    @property
    def vocab(self) -> Vocab: ...

    @property
    def n_vocab(self) -> int: ...


class BatchError(LLMFWError, ValueError):
    """A batch that cannot be decoded (decode reports it as -1)."""


class Batch:
    """Tokens (or embeddings) to decode, with optional positions, sequence ids and output flags.

    ``tokens``: token ids; ``embd``: float32 [n_tokens, n_embd] instead of tokens; ``pos``: one position per
    token (default: continue each sequence); ``seq_id``: an int for every token, one int per token, or a list of
    ints per token (a token shared by several sequences); ``logits``: None = last token only, True = every
    token, False = none, or one bool per token.
    """

    __slots__ = ("tokens", "embd", "pos", "seq_id", "logits")

    def __init__(self, tokens: Sequence[int] | np.ndarray | None = None, *, embd: np.ndarray | None = None,
                 pos: Sequence[int] | np.ndarray | None = None, seq_id: Any = None, logits: Any = None):
        self.tokens = tokens
        self.embd = embd
        self.pos = pos
        self.seq_id = seq_id
        self.logits = logits

    @property
    def n_tokens(self) -> int:
        data = self.tokens if self.tokens is not None else self.embd
        try:
            return len(data) if data is not None else 0
        except TypeError:
            return 0

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        kind = "embd" if self.embd is not None else "tokens"
        return f"Batch({self.n_tokens} {kind})"


class _TokenRows:
    """Counts shared by allocated batches and ubatches (both have ``pos`` and ``output`` per token)."""

    pos: np.ndarray
    output: np.ndarray

    @property
    def n_tokens(self) -> int:
        return int(self.pos.shape[0])

    @property
    def n_outputs(self) -> int:
        return int(np.count_nonzero(self.output))


@dataclass
class AllocatedBatch(_TokenRows):
    """A validated batch with everything filled in."""

    tokens: np.ndarray | None  # int32 [T]
    embd: np.ndarray | None  # float32 [T, n_embd]
    pos: np.ndarray  # int32 [T]
    seq_ids: list[tuple[int, ...]]  # per token, first one decides the mask
    seq_first: np.ndarray  # int32 [T]
    seq_bits: np.ndarray  # uint64 [T]
    output: np.ndarray  # bool [T]


@dataclass
class UBatch(_TokenRows):
    """A slice of an allocated batch processed by one graph evaluation."""

    start: int  # index of the first token in the batch
    tokens: np.ndarray | None
    embd: np.ndarray | None
    pos: np.ndarray
    seq_first: np.ndarray
    seq_bits: np.ndarray
    output: np.ndarray
    #: batch index of each token when the ubatch is not a slice of the batch (an equal split regroups the
    #: tokens by sequence); None: tokens ``start, start + 1, ...``
    rows: np.ndarray | None = None
    #: an equal split's sequences, one block of ``n_tokens / len(seqs)`` tokens each, in this order
    seqs: tuple[int, ...] = ()

    @property
    def n_seqs(self) -> int:
        """Sequences laid out in equal blocks (1 for a slice ubatch, which is not laid out by sequence)."""
        return len(self.seqs) or 1

    @property
    def out_ids(self) -> np.ndarray:
        """Row indices (within the ubatch) of the output tokens, int32."""
        return np.flatnonzero(self.output).astype(np.int32)


def _n_rows(values: np.ndarray | None) -> int:
    if values is None:  # _tokens_or_embd returns exactly one of them
        raise BatchError("a batch needs exactly one of tokens or embd")
    return int(values.shape[0])


class BatchAllocator:
    """Completes and validates batches for one context (llama.cpp's llama_batch_allocr)."""

    def __init__(self, n_vocab: int, n_embd: int, n_seq_max: int):
        self.n_vocab = n_vocab
        self.n_embd = n_embd
        self.n_seq_max = n_seq_max

    def init(self, batch: Batch, memory: SeqPositions | None = None, *, output_all: bool = False) -> AllocatedBatch:
        if not isinstance(batch, Batch):
            raise BatchError(f"expected an llmfw.Batch, got {type(batch).__name__}")
        tokens, embd = self._tokens_or_embd(batch)
        n = _n_rows(tokens if tokens is not None else embd)
        if n == 0:
            raise BatchError("the batch is empty (n_tokens == 0)")
        seq_ids = self._seq_ids(batch.seq_id, n)
        seq_first = np.array([s[0] for s in seq_ids], dtype=np.int32)
        seq_bits = np.array([sum(1 << s for s in set(ids)) for ids in seq_ids], dtype=np.uint64)
        pos = self._positions(batch.pos, n, seq_ids, memory)
        output = self._outputs(batch.logits, n, output_all)
        allocated = AllocatedBatch(tokens, embd, pos, seq_ids, seq_first, seq_bits, output)
        if batch.pos is not None or any(len(ids) > 1 for ids in seq_ids):
            # positions the caller gave, or a token of several sequences (a later token may start one of them
            # elsewhere): checked; positions that each continue their one sequence's memory hold by construction
            self._check_continuity(allocated, memory)
        return allocated

    # -- pieces ---------------------------------------------------------------------------------------------
    def _tokens_or_embd(self, batch: Batch) -> tuple[np.ndarray | None, np.ndarray | None]:
        if (batch.tokens is None) == (batch.embd is None):
            raise BatchError("a batch needs exactly one of tokens or embd")
        if batch.tokens is not None:
            try:
                tokens = np.asarray(batch.tokens)
            except Exception as exc:  # noqa: BLE001 - anything unconvertible is a bad batch
                raise BatchError(f"tokens are not a sequence of integers: {exc}") from None
            if tokens.ndim != 1:
                raise BatchError(f"tokens must be one-dimensional, got shape {tokens.shape}")
            if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
                raise BatchError(f"tokens must be integers, got dtype {tokens.dtype}")
            tokens = tokens.astype(np.int64)
            bad = (tokens < 0) | (tokens >= self.n_vocab)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise BatchError(f"token id {int(tokens[i])} at batch index {i} is out of range 0..{self.n_vocab - 1}")
            return tokens.astype(np.int32), None
        embd = np.asarray(batch.embd, dtype=np.float32)
        if embd.ndim != 2 or embd.shape[1] != self.n_embd:
            raise BatchError(f"embd must be [n_tokens, {self.n_embd}], got shape {embd.shape}")
        return None, np.ascontiguousarray(embd)

    def _seq_ids(self, seq_id: Any, n: int) -> list[tuple[int, ...]]:
        ids: list[tuple[int, ...]]
        if seq_id is None:
            ids = [(0,)] * n
        elif isinstance(seq_id, (int, np.integer)):
            ids = [(int(seq_id),)] * n
        else:
            try:
                items = list(seq_id)
            except TypeError:
                raise BatchError(f"seq_id must be an int or one entry per token, got {type(seq_id).__name__}") from None
            if len(items) != n:
                raise BatchError(f"seq_id has {len(items)} entries for {n} tokens")
            ids = []
            for item in items:
                group = tuple(int(s) for s in item) if isinstance(item, (list, tuple, np.ndarray)) else (int(item),)
                if not group:
                    raise BatchError("a token has an empty list of sequence ids")
                ids.append(group)
        for i, group in enumerate(ids):
            for s in group:
                if not 0 <= s < self.n_seq_max:
                    raise BatchError(f"seq_id {s} at batch index {i} is out of range 0..{self.n_seq_max - 1} "
                                     f"(n_seq_max = {self.n_seq_max})")
        return ids

    def _positions(self, pos: Any, n: int, seq_ids: list[tuple[int, ...]], memory: SeqPositions | None) -> np.ndarray:
        if pos is not None:
            positions = np.asarray(pos)
            if positions.shape != (n,):
                raise BatchError(f"pos has shape {positions.shape}, expected ({n},)")
            if positions.size and not np.issubdtype(positions.dtype, np.integer):
                raise BatchError(f"pos must be integers, got dtype {positions.dtype}")
            if (positions < 0).any():
                raise BatchError("positions must be >= 0")
            return positions.astype(np.int32)
        # continue each sequence after what the memory holds (llama.cpp: p0 = seq_pos_max + 1)
        next_pos: dict[int, int] = {}
        out = np.empty(n, dtype=np.int32)
        for i, group in enumerate(seq_ids):
            first = group[0]
            if first not in next_pos:
                next_pos[first] = (memory.seq_pos_max(first) + 1) if memory is not None else 0
            out[i] = next_pos[first]
            for s in group:
                next_pos[s] = int(out[i]) + 1
        return out

    def _outputs(self, logits: Any, n: int, output_all: bool) -> np.ndarray:
        if output_all or logits is True:
            return np.ones(n, dtype=bool)
        if logits is None:
            out = np.zeros(n, dtype=bool)
            out[-1] = True
            return out
        if logits is False:
            return np.zeros(n, dtype=bool)
        flags = np.asarray(logits)
        if flags.shape != (n,):
            raise BatchError(f"logits has shape {flags.shape}, expected ({n},) or a bool")
        return flags.astype(bool)

    def _check_continuity(self, batch: AllocatedBatch, memory: SeqPositions | None) -> None:
        """llama.cpp's checks: a sequence continues right after its last cached position, without gaps."""
        firsts = batch.seq_first.tolist()
        if len(set(firsts)) == len(firsts):  # a token per sequence (a decode step): no gaps, one start each
            for s, p in sorted(zip(firsts, batch.pos.tolist())):
                _check_start(s, p, memory)
            return
        for s in sequences_of(batch.seq_first):
            mine = batch.pos[batch.seq_first == s]
            p_min, p_max = int(mine.min()), int(mine.max())
            _check_start(s, p_min, memory)
            if p_max - p_min + 1 > mine.size:
                raise BatchError(f"sequence {s}: positions {p_min}..{p_max} have gaps ({mine.size} tokens)")


def _check_start(s: int, p_min: int, memory: SeqPositions | None) -> None:
    """Sequence ``s``'s first position in a batch is the one after the last its memory holds (if it holds any)."""
    last = memory.seq_pos_max(s) if memory is not None else -1
    if last >= 0 and p_min != last + 1:
        raise BatchError(f"sequence {s}: the memory ends at position {last} but the batch starts at "
                         f"{p_min}; positions must stay consecutive (expected {last + 1})")


def sequences_of(seq_first: np.ndarray) -> list[int]:
    """The distinct sequence ids of a batch's tokens, ascending (``np.unique`` would import ``numpy.ma`` at a
    process's first decode, a good part of the first decode's own time)."""
    return sorted(set(seq_first.tolist()))


def split_simple(batch: AllocatedBatch, n_ubatch: int) -> list[UBatch]:
    """Consecutive slices of at most ``n_ubatch`` tokens, in batch order (llama.cpp's split_simple)."""
    ubatches = []
    for start in range(0, batch.n_tokens, n_ubatch):
        end = min(start + n_ubatch, batch.n_tokens)
        ubatches.append(UBatch(
            start=start,
            tokens=batch.tokens[start:end] if batch.tokens is not None else None,
            embd=batch.embd[start:end] if batch.embd is not None else None,
            pos=batch.pos[start:end],
            seq_first=batch.seq_first[start:end],
            seq_bits=batch.seq_bits[start:end],
            output=batch.output[start:end],
        ))
    return ubatches


def tokenize_prompt(model: PromptModel, prompt: str | Sequence[int], parse_special: bool = True,
                    add_special: bool = True) -> list[int]:
    """The prompt's token ids (a text tokenized, or ids checked to be in the vocabulary)."""
    if isinstance(prompt, str):
        return list(model.vocab.tokenize(prompt, add_special=add_special, parse_special=parse_special))
    tokens = [int(t) for t in prompt]
    n_vocab = model.n_vocab
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise ContextError(f"prompt token {bad[0]} is outside the vocabulary (n_vocab {n_vocab})")
    return tokens


def split_equal(batch: AllocatedBatch, n_ubatch: int) -> list[UBatch]:
    """Ubatches in which every sequence present has the same number of tokens, laid out sequence after sequence
    in position order (llama.cpp's ``split_equal``, which a recurrent state needs: its update runs over
    [n_seqs, n_seq_tokens]). Each ubatch takes the sequences that still have tokens (at most ``n_ubatch`` of
    them) and as many tokens of each as the shortest has left, within ``n_ubatch`` in all. A token shared by
    several sequences cannot be split this way (BatchError)."""
    shared = [i for i, bits in enumerate(batch.seq_bits.tolist()) if bits & (bits - 1)]
    if shared:
        raise BatchError(f"batch index {shared[0]} belongs to several sequences; a recurrent memory needs one "
                         "sequence per token (decode the shared tokens once per sequence, or copy the state "
                         "with seq_cp)")
    pending: dict[int, list[int]] = {}
    for s in sequences_of(batch.seq_first):
        rows = np.flatnonzero(batch.seq_first == s)
        pending[s] = rows[np.argsort(batch.pos[rows], kind="stable")].tolist()
    ubatches = []
    while pending:
        seqs = list(pending)[:n_ubatch]
        n_each = min(min(len(pending[s]) for s in seqs), max(n_ubatch // len(seqs), 1))
        rows = np.array([r for s in seqs for r in pending[s][:n_each]], dtype=np.int64)
        for s in seqs:
            del pending[s][:n_each]
            if not pending[s]:
                del pending[s]
        ubatches.append(UBatch(
            start=int(rows[0]),
            tokens=batch.tokens[rows] if batch.tokens is not None else None,
            embd=batch.embd[rows] if batch.embd is not None else None,
            pos=batch.pos[rows], seq_first=batch.seq_first[rows], seq_bits=batch.seq_bits[rows],
            output=batch.output[rows], rows=rows, seqs=tuple(seqs),
        ))
    return ubatches
