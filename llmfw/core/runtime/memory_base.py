"""The memory plugin interface (:class:`Memory`, :class:`MemoryBatch`), the settings a memory is sized by,
and the context's per-sequence token records (:class:`SeqTokens`). The modules that implement it are
:mod:`llmfw.core.runtime.kv_cache` and :mod:`llmfw.core.runtime.memory`, which re-exports this one."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from ..exec.backend import Backend, KVHandle

if TYPE_CHECKING:
    from .batch import AllocatedBatch, UBatch
    from ..ir.graph import Graph, GraphModel


class MemoryParams(Protocol):
    """The context settings a memory is sized by (:class:`~.context.Context`, one module up, has them)."""

    @property
    def n_ctx(self) -> int: ...

    @property
    def n_seq_max(self) -> int: ...

    @property
    def n_ubatch(self) -> int: ...


#: n_kv and the cell count are multiples of this (llama.cpp pads to 256)
KV_PAD = 256
#: the sequence-set bitmask holds this many sequences
MAX_SEQ = 64
NEG_INF = np.float32(-np.inf)

#: runs a maintenance graph (the K-shift) with numpy inputs; provided by the context
GraphRunner = Callable[["Graph", dict[str, np.ndarray]], None]


def pad_to(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class MemoryBatch(ABC):
    """The reserved state for one batch (llama.cpp's ``llama_memory_context``): per ubatch, apply then read
    the build parameters and the inputs."""

    @abstractmethod
    def apply(self, i: int) -> None:
        """Commit ubatch ``i``'s cells (positions and sequences) into the memory."""

    @abstractmethod
    def n_kv(self) -> dict[str, int]:
        """cache name → number of cells attended (padded), after :meth:`apply`."""

    @abstractmethod
    def set_inputs(self, i: int, ubatch: "UBatch", inputs: dict[str, np.ndarray]) -> None:
        """Fill ``kv_idx:<cache>``, ``kq_mask:<cache>`` and ``kv_order:<cache>`` for ubatch ``i``."""

    def take_outputs(self, i: int, ubatch: "UBatch", outputs: dict[str, np.ndarray]) -> None:
        """Read what ubatch ``i``'s graph computed for the memory (a recurrent state's ``rs:*`` outputs) once it
        ran; a KV cache has nothing to read (its ``attention`` nodes wrote the cells)."""


class Memory(ABC):
    """What a context keeps between decodes. Sequence operations follow llama.cpp's ``llama_memory_*``:
    ``seq_id < 0`` means every sequence, ``p0 < 0`` means 0 and ``p1 < 0`` means infinity."""

    @classmethod
    @abstractmethod
    def create(cls, model: GraphModel, cparams: MemoryParams) -> "Memory":
        """Build the memory for ``model`` with the context parameters (n_ctx, n_seq_max, ...)."""

    #: names of the KV caches (inputs ``kv_idx:<name>`` / ``kq_mask:<name>``)
    cache_names: list[str]

    @abstractmethod
    def cache_of_layer(self, il: int) -> str:
        """Name of the cache layer ``il`` reads and writes."""

    @abstractmethod
    def allocate(self, backend_of_layer: Callable[[int], Backend]) -> dict[tuple[str, int], KVHandle]:
        """Allocate storage on each layer's backend; returns (cache, layer) → backend KV handle."""

    def init_batch(self, batch: "AllocatedBatch", n_ubatch: int) -> tuple[list["UBatch"], MemoryBatch | None]:
        """Split a validated batch into ubatches (llama.cpp's simple split; override for another) and reserve
        cells for all of them (llama.cpp's ``init_batch``); the reservation is None when they do not fit."""
        from .batch import split_simple

        ubatches = split_simple(batch, n_ubatch)
        return ubatches, self.prepare(ubatches)

    @abstractmethod
    def prepare(self, ubatches: list["UBatch"]) -> MemoryBatch | None:
        """Reserve cells for every ubatch (without changing anything); None when they do not fit."""

    @abstractmethod
    def update(self, run_graph: GraphRunner) -> None:
        """Apply pending maintenance (the K-shift after ``seq_add``) before the next decode."""

    #: the context's token records (``Context.seq_tokens``), kept in step with every sequence operation below;
    #: None for a memory no context decodes into directly (the parts of a composite)
    records: "SeqTokens | None" = None

    # sequence operations: the public ones keep ``records`` in step, subclasses implement the ``_seq_*`` ones
    @abstractmethod
    def seq_pos_min(self, seq_id: int) -> int: ...

    @abstractmethod
    def seq_pos_max(self, seq_id: int) -> int: ...

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id``; False (nothing changed) when this memory cannot."""
        removed = self._seq_rm(seq_id, p0, p1)
        if removed and self.records is not None:
            self.records.cut(seq_id, p0)
        return removed

    def can_drop_suffix(self, n_tokens: int) -> bool:
        """Whether ``seq_rm(seq, p, -1)`` can drop a sequence's last ``n_tokens`` positions (what speculative
        decoding does with a rejected draft). A KV cache always can; a recurrent state only as far back as
        it keeps snapshots."""
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        self._seq_cp(seq_id_src, seq_id_dst, p0, p1)
        if self.records is not None:
            self.records.copy(seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self._seq_keep(seq_id)
        if self.records is not None:
            self.records.keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self._seq_add(seq_id, p0, p1, delta)
        if self.records is not None and delta:
            self.records.cut(seq_id, p0)  # the tokens from p0 on are at other positions now

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self._seq_div(seq_id, p0, p1, d)
        if self.records is not None and d != 1:
            self.records.cut(seq_id, p0)

    def clear(self, data: bool = True) -> None:
        self._clear(data)
        if self.records is not None:
            self.records.cut(-1, 0)

    @abstractmethod
    def _seq_rm(self, seq_id: int, p0: int, p1: int) -> bool: ...

    @abstractmethod
    def _seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None: ...

    @abstractmethod
    def _seq_keep(self, seq_id: int) -> None: ...

    @abstractmethod
    def _seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None: ...

    @abstractmethod
    def _seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None: ...

    @abstractmethod
    def _clear(self, data: bool) -> None: ...


class SeqTokens:
    """Per sequence, the tokens at positions 0, 1, ... whose KV is in the cache: what a new prompt's shared
    prefix is matched against (``generate``, the serving engine). The context updates it on every ``decode``
    and the memory on every sequence operation; where it cannot tell what a position holds any more it cuts
    the list there, so the list is always a true prefix (at worst a shorter one: a token decoded again)."""

    def __init__(self, n_seq_max: int):
        #: one list per sequence, changed in place (callers may hold them)
        self.lists: list[list[int]] = [[] for _ in range(n_seq_max)]

    def _seqs(self, seq_id: int) -> list[list[int]]:
        if seq_id < 0:
            return self.lists
        return [self.lists[seq_id]] if seq_id < len(self.lists) else []

    def cut(self, seq_id: int, p0: int) -> None:
        """Positions from ``p0`` on (of every sequence for ``seq_id < 0``) are no longer known."""
        for record in self._seqs(seq_id):
            del record[max(p0, 0):]

    def copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``seq_cp``: ``dst`` now holds ``src``'s positions [p0, p1) too."""
        if not 0 <= src < len(self.lists):
            return
        start, source = max(p0, 0), self.lists[src]
        stop = len(source) if p1 < 0 else min(p1, len(source))
        for record in self._seqs(dst):
            if record is source:
                continue
            if len(record) >= start and len(source) >= start:
                record[start:] = source[start:stop]
            else:
                del record[start:]

    def keep(self, seq_id: int) -> None:
        for s, record in enumerate(self.lists):
            if s != seq_id:
                record.clear()

    def decoded(self, tokens: np.ndarray | None, pos: np.ndarray, seq_ids: list[tuple[int, ...]]) -> None:
        """A decode wrote ``tokens`` (None: embeddings, whose tokens are unknown) at ``pos`` of ``seq_ids``."""
        for i, seqs in enumerate(seq_ids):
            p = int(pos[i])
            for s in seqs:
                record = self.lists[s]
                if p > len(record):  # a gap: the known prefix ends before it
                    continue
                del record[p:]
                if tokens is not None:
                    record.append(int(tokens[i]))


def _range(p0: int, p1: int) -> tuple[int, int]:
    return (0 if p0 < 0 else p0), (np.iinfo(np.int64).max if p1 < 0 else p1)
