"""The candidates samplers work on (llama.cpp's ``llama_token_data_array``) and the helpers samplers share over
them: temperature, top-k, a bounded token history, looking tokens up in an id → value table."""
from __future__ import annotations

from collections import deque
from typing import Any, Mapping

import numpy as np

from ..errors import SamplerError


class Candidates:
    """The token candidates a sampler works on (llama.cpp's ``llama_token_data_array``).

    ``ids`` (int32), ``logits`` (float32) and ``probs`` (float32, or None until a sampler computes them) are
    parallel arrays; ``sorted`` says they are ordered by descending logit; ``selected`` is the index (into
    these arrays) a selecting sampler chose, -1 before that. Samplers replace the arrays rather than resize
    them in place, so slicing and fancy indexing are fine.
    """

    __slots__ = ("ids", "logits", "probs", "sorted", "selected")

    def __init__(self, ids: np.ndarray, logits: np.ndarray, probs: np.ndarray | None = None,
                 sorted: bool = False, selected: int = -1):  # llama.cpp's field name
        self.ids = np.asarray(ids, dtype=np.int32)
        self.logits = np.asarray(logits, dtype=np.float32)
        self.probs = None if probs is None else np.asarray(probs, dtype=np.float32)
        if self.ids.shape != self.logits.shape or self.ids.ndim != 1:
            raise SamplerError(f"candidates need 1-D ids and logits of one length, got {self.ids.shape} "
                               f"and {self.logits.shape}")
        self.sorted = sorted
        self.selected = selected

    @classmethod
    def from_logits(cls, logits: Any) -> "Candidates":
        """Every token of the vocabulary with its logit (a copy: samplers modify the logits)."""
        values = vocabulary_logits(logits)
        return cls(np.arange(values.size, dtype=np.int32), values)

    def __len__(self) -> int:
        return int(self.ids.size)

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def take(self, index: np.ndarray | slice) -> None:
        """Keep (and reorder to) the given positions."""
        self.ids = self.ids[index]
        self.logits = self.logits[index]
        if self.probs is not None:
            self.probs = self.probs[index]

    def truncate(self, n: int) -> None:
        self.take(slice(0, n))

    def sort(self, k: int | None = None) -> None:
        """Order by descending logit; with ``k``, keep only the best ``k`` (llama.cpp's partial sort)."""
        n = self.size
        if k is not None and k < n:
            part = np.argpartition(-self.logits, k - 1)[:k]
            order = part[np.argsort(-self.logits[part], kind="stable")]
        else:
            order = np.argsort(-self.logits, kind="stable")
        self.take(order)
        self.sorted = True

    def softmax(self, sort: bool = False) -> None:
        """llama_sampler_softmax_impl: probabilities from the logits (sorting first if asked)."""
        if self.size == 0:
            raise SamplerError("no candidates left to compute probabilities for")
        if sort and not self.sorted:
            self.sort()
        max_l = self.logits[0] if self.sorted else self.logits.max()
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.exp(self.logits - max_l).astype(np.float32)
        total = np.cumsum(p, dtype=np.float32)[-1]  # sequential float sum, like the C loop
        self.probs = (p / total).astype(np.float32)

    @property
    def computed_probs(self) -> np.ndarray:
        """``probs`` once a sampler computed them (:meth:`softmax`); a SamplerError before."""
        if self.probs is None:
            raise SamplerError("the candidates' probabilities were read before any sampler computed them")
        return self.probs

    @property
    def selected_token(self) -> int:
        if not 0 <= self.selected < self.size:
            raise SamplerError(
                "the sampler chain ended without selecting a token; end it with a selecting sampler "
                "(greedy, dist, mirostat or mirostat_v2)"
            )
        return int(self.ids[self.selected])


def vocabulary_logits(logits: Any) -> np.ndarray:
    """A float32 copy of a logits vector, every token in id order (samplers modify it)."""
    values = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
    if values.size == 0:
        raise SamplerError("cannot sample from an empty logits vector")
    return values


def apply_temperature(cur: Candidates, temp: float) -> None:
    """llama_sampler_temp_impl: divide the logits by ``temp``; ``temp <= 0`` keeps only the best token."""
    if temp <= 0.0:
        best = int(np.argmax(cur.logits))
        kept = cur.logits[best]
        cur.logits = np.full_like(cur.logits, -np.inf)
        cur.logits[best] = kept
        return
    cur.logits = (cur.logits / np.float32(temp)).astype(np.float32)


def keep_top_k(cur: Candidates, k: int) -> None:
    """llama_sampler_top_k_impl: ``k <= 0`` does nothing."""
    if k <= 0:
        return
    k = min(k, cur.size)
    if not cur.sorted:
        cur.sort(k)
    cur.truncate(k)


class RingHistory:
    """A bounded token history (llama.cpp's ring_buffer); ``rat(0)`` is the most recent token."""

    def __init__(self, capacity: int):
        self.capacity = max(int(capacity), 0)
        self.tokens: deque[int] = deque()

    def push(self, token: int) -> int | None:
        """Append; return the token pushed out when full (nothing is kept when the capacity is 0)."""
        if self.capacity == 0:
            return None
        dropped = self.tokens.popleft() if len(self.tokens) >= self.capacity else None
        self.tokens.append(token)
        return dropped

    def rat(self, i: int) -> int:
        return self.tokens[-1 - i]

    def __len__(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.tokens.clear()


def _table_arrays(table: Mapping[int, float]) -> tuple[np.ndarray, np.ndarray]:
    keys = np.fromiter(table.keys(), dtype=np.int64, count=len(table))
    values = np.fromiter(table.values(), dtype=np.float64, count=len(table))
    return keys, values


def vocab_lookup(n_vocab: int, table: Mapping[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ids_lookup` for the whole vocabulary in id order (position == id): the keys of ``table`` inside
    it, and their values."""
    keys, values = _table_arrays(table)
    inside = (keys >= 0) & (keys < n_vocab)
    return (keys, values) if inside.all() else (keys[inside], values[inside])


def ids_lookup(ids: np.ndarray, table: Mapping[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """Positions in ``ids`` whose token is a key of ``table``, and the table values for them."""
    if not table:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
    keys, values = _table_arrays(table)
    inside = (keys >= 0) & (keys < len(ids))
    if inside.all() and np.array_equal(ids[keys], keys):
        return keys, values  # the usual case: candidates still in vocabulary order (position == id)
    order = np.argsort(keys)
    keys, values = keys[order], values[order]
    where = np.searchsorted(keys, ids)
    where_clipped = np.minimum(where, len(keys) - 1)
    hit = keys[where_clipped] == ids
    positions = np.nonzero(hit)[0]
    return positions, values[where_clipped[positions]]
