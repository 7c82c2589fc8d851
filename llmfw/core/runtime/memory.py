"""Memory modules: what a context remembers between decodes. The built-in one is llama.cpp's KV cache.

:class:`Memory` is the plugin interface (registry kind ``"memory"``; an architecture names the module it
needs in ``Architecture.memory``). :class:`KVCache` is one unified KV cache:

* **cells** — ``n_cells`` slots, each with a position and a set of sequence ids (a bitmask, so at most 64
  sequences); a cell with no sequence is empty;
* **slots** — :meth:`Memory.init_batch` splits a batch into ubatches and :meth:`KVCache.prepare` finds cells for
  *every* ubatch of a batch before any runs (llama.cpp's
  ``find_slot`` on a scratch copy of the cells); if one does not fit nothing changes and decode returns 1;
* **inputs** — per ubatch the cells written (``kv_idx:<cache>``) and the attention mask
  (``kq_mask:<cache>``, [n_tokens, n_kv], 0 = visible / -inf = hidden): a token of sequence s at position p
  sees the cells of s at positions ≤ p (and, with a sliding window, not older than the window). ``n_kv``, the
  number of cells attended, is padded to :data:`KV_PAD` so graphs are reused across decode steps;
* **sequence operations** — ``seq_rm``, ``seq_cp``, ``seq_keep``, ``seq_add`` (positions shift; the cached K is
  re-roped lazily before the next decode: llama.cpp's K-shift), ``seq_div``, ``seq_pos_min/max``, ``clear``.
  The public operations also keep the context's token records (:class:`SeqTokens`, ``Context.seq_tokens``) in
  step; a memory module implements the ``_seq_*`` / ``_clear`` methods they call.

A sliding-window cache is the same class with ``n_swa`` / ``swa_type`` set (cells that fell out of every
sequence's window are reused, as in llama.cpp); an interleaved-SWA memory composes two KVCache instances with
different ``name`` and ``layers`` (see :class:`CompositeMemory`).
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

import numpy as np

from ..exec.backend import Backend, KVHandle, KVLayerShape
from ..errors import ContextError

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

log = logging.getLogger(__name__)

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
        """Fill ``kv_idx:<cache>`` and ``kq_mask:<cache>`` for ubatch ``i``."""

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


@dataclass
class CellsState:
    """Cell metadata (copied whole to simulate slot reservation)."""

    pos: np.ndarray  # int64 [n_cells], -1 = empty
    seq: np.ndarray  # uint64 [n_cells], bit s = cell belongs to sequence s
    shift: np.ndarray  # int64 [n_cells], accumulated seq_add deltas not yet applied to K
    head: int = 0

    def copy(self) -> "CellsState":
        return CellsState(self.pos.copy(), self.seq.copy(), self.shift.copy(), self.head)


class KVCache(Memory):
    """One KV cache over a set of layers (llama.cpp's ``llama_kv_cache``)."""

    def __init__(self, model: GraphModel, n_ctx: int, n_seq_max: int = 1, *, name: str = "kv",
                 layers: Iterable[int] | None = None, n_swa: int = 0, swa_type: str = "none",
                 n_pad: int = KV_PAD):
        if not 1 <= n_seq_max <= MAX_SEQ:
            raise ContextError(f"n_seq_max must be in 1..{MAX_SEQ}, got {n_seq_max}")
        if n_ctx <= 0:
            raise ContextError(f"the KV cache needs a positive size, got n_ctx = {n_ctx}")
        self.model = model
        self.hp = model.known_hparams
        self.name = name
        self.cache_names = [name]
        self.layers = list(range(self.hp.n_layer)) if layers is None else list(layers)
        self.n_seq_max = n_seq_max
        self.n_swa = int(n_swa)
        self.swa_type = swa_type if self.n_swa > 0 else "none"
        self.n_pad = n_pad
        self.n_cells = pad_to(n_ctx, n_pad)
        self.cells = CellsState(
            pos=np.full(self.n_cells, -1, dtype=np.int64),
            seq=np.zeros(self.n_cells, dtype=np.uint64),
            shift=np.zeros(self.n_cells, dtype=np.int64),
        )
        self.has_shift = False
        self.storage: dict[tuple[str, int], KVHandle] = {}
        self._backends: dict[int, Backend] = {}

    @classmethod
    def create(cls, model: GraphModel, cparams: MemoryParams) -> "KVCache":
        return cls(model, cparams.n_ctx, cparams.n_seq_max, n_swa=model.known_hparams.n_swa if _all_swa(model) else 0,
                   swa_type=model.known_hparams.swa_type)

    # -- storage -------------------------------------------------------------------------------------------
    def cache_of_layer(self, il: int) -> str:
        return self.name

    def layer_shape(self, il: int) -> KVLayerShape:
        hp = self.hp
        return KVLayerShape(self.name, il, self.n_cells, hp.n_head_kv(il), hp.head_dim_k(il), hp.head_dim_v(il))

    def allocate(self, backend_of_layer: Callable[[int], Backend]) -> dict[tuple[str, int], KVHandle]:
        for il in self.layers:
            backend = backend_of_layer(il)
            self._backends[il] = backend
            self.storage[(self.name, il)] = backend.alloc_kv(self.layer_shape(il))
        return self.storage

    @property
    def nbytes(self) -> int:
        hp = self.hp
        return sum(4 * self.n_cells * (hp.n_embd_k_gqa(il) + hp.n_embd_v_gqa(il)) for il in self.layers)

    # -- cell queries ---------------------------------------------------------------------------------------
    def _seq_bit(self, seq_id: int) -> np.uint64:
        if not 0 <= seq_id < self.n_seq_max:
            raise ContextError(f"sequence id {seq_id} is out of range 0..{self.n_seq_max - 1} (n_seq_max)")
        return np.uint64(np.uint64(1) << np.uint64(seq_id))

    def _has_seq(self, state: CellsState, seq_id: int) -> np.ndarray:
        return np.asarray((state.seq & self._seq_bit(seq_id)) != 0)

    def seq_pos_min(self, seq_id: int) -> int:
        pos = self.cells.pos[self._has_seq(self.cells, seq_id)]
        return int(pos.min()) if pos.size else -1

    def seq_pos_max(self, seq_id: int) -> int:
        return self._seq_pos_max(self.cells, seq_id)

    def _seq_pos_max(self, state: CellsState, seq_id: int) -> int:
        pos = state.pos[self._has_seq(state, seq_id)]
        return int(pos.max()) if pos.size else -1

    @property
    def n_used(self) -> int:
        return int(np.count_nonzero(self.cells.seq))

    def used_max_p1(self, state: CellsState | None = None) -> int:
        state = state or self.cells
        used = np.flatnonzero(state.seq)
        return int(used[-1]) + 1 if used.size else 0

    def get_n_kv(self, state: CellsState | None = None) -> int:
        """Cells attended: the used prefix padded to n_pad (llama.cpp's get_n_kv)."""
        return min(self.n_cells, max(self.n_pad, pad_to(self.used_max_p1(state), self.n_pad)))

    def is_masked_swa(self, cell_pos: np.ndarray, token_pos: np.ndarray | np.int64) -> np.ndarray:
        """llama.cpp's hparams.is_masked_swa, vectorised (cell_pos = p0, token_pos = p1)."""
        if self.swa_type == "none" or self.n_swa <= 0:
            return np.zeros(np.broadcast_shapes(np.shape(cell_pos), np.shape(token_pos)), dtype=bool)
        if self.swa_type == "standard":
            return np.asarray(token_pos - cell_pos >= self.n_swa)
        if self.swa_type == "chunked":
            return cell_pos < (token_pos // self.n_swa) * self.n_swa
        if self.swa_type == "symmetric":
            half = self.n_swa // 2
            diff = token_pos - cell_pos
            return np.asarray((diff < -half) | (diff > half))
        raise ContextError(f"unknown sliding-window type {self.swa_type!r}")

    # -- slots ----------------------------------------------------------------------------------------------
    def _find_slot(self, state: CellsState, ubatch: "UBatch") -> np.ndarray | None:
        """Free cells for the ubatch's tokens (not necessarily contiguous), searching from ``head``."""
        n_tokens = ubatch.n_tokens
        if n_tokens > self.n_cells:
            return None
        usable = state.seq == 0
        if self.swa_type != "none":
            usable = usable | self._swa_reusable(state)
        head = state.head
        if head > int(np.count_nonzero(state.seq)) + 2 * n_tokens:
            head = 0  # plenty of free cells before head: fill from the start (llama.cpp's heuristic)
        order = np.concatenate([np.arange(head, self.n_cells), np.arange(0, head)])
        free = order[usable[order]]
        if free.size < n_tokens:
            return None
        return np.asarray(free[:n_tokens], dtype=np.int64)

    def _swa_reusable(self, state: CellsState) -> np.ndarray:
        """Cells owned by a single sequence and already outside its window (they can be overwritten)."""
        reusable = np.zeros(self.n_cells, dtype=bool)
        for s in range(self.n_seq_max):
            bit = self._seq_bit(s)
            only_s = state.seq == bit
            if not only_s.any():
                continue
            pmax = self._seq_pos_max(state, s)
            reusable |= only_s & self.is_masked_swa(state.pos, np.int64(pmax + 1))
        return reusable

    def _apply_ubatch(self, state: CellsState, idx: np.ndarray, ubatch: "UBatch") -> None:
        """Write the ubatch's positions and sequences into cells ``idx`` of ``state``."""
        overwritten = state.seq[idx] != 0
        if overwritten.any():
            # a reused SWA cell: keep every sequence's positions contiguous by purging what lies before it
            for s in range(self.n_seq_max):
                bit = self._seq_bit(s)
                hit = idx[overwritten & ((state.seq[idx] & bit) != 0)]
                if hit.size:
                    pmax_rm = int(state.pos[hit].max())
                    self._seq_rm_state(state, s, -1, pmax_rm + 1)
        state.pos[idx] = ubatch.pos
        state.seq[idx] = ubatch.seq_bits
        state.shift[idx] = 0
        state.head = int(idx[-1]) + 1 if idx.size else state.head
        if state.head >= self.n_cells:
            state.head = 0

    def prepare(self, ubatches: list["UBatch"]) -> "KVCacheBatch | None":
        scratch = self.cells.copy()
        slots = []
        for ub in ubatches:
            idx = self._find_slot(scratch, ub)
            if idx is None:
                log.debug("KV cache %s: no slot for a ubatch of %d tokens (%d/%d cells used)", self.name,
                          ub.n_tokens, self.n_used, self.n_cells)
                return None
            self._apply_ubatch(scratch, idx, ub)
            slots.append(idx)
        return KVCacheBatch(self, ubatches, slots)

    def _mask(self, ubatch: "UBatch", n_kv: int) -> np.ndarray:
        """[n_tokens, n_kv] float32: 0 where token i may attend cell j, -inf elsewhere."""
        pos = self.cells.pos[:n_kv]
        seqs = self.cells.seq[:n_kv]
        first_seq = ubatch.seq_first.astype(np.uint64)
        same_seq = ((seqs[None, :] >> first_seq[:, None]) & np.uint64(1)) != 0
        visible = same_seq
        token_pos = ubatch.pos.astype(np.int64)[:, None]
        if self.hp.causal_attn:
            visible = visible & (pos[None, :] <= token_pos)
        if self.swa_type != "none":
            visible = visible & ~self.is_masked_swa(pos[None, :], token_pos)
        mask = np.full(visible.shape, NEG_INF, dtype=np.float32)
        mask[visible] = 0.0
        return mask

    # -- maintenance -----------------------------------------------------------------------------------------
    def update(self, run_graph: GraphRunner) -> None:
        if not self.has_shift:
            return
        from ..ir.graph import BuildParams, GraphBuilder

        # n_ctx_seq: Phi-3 re-ropes with the same long/short factors its graph uses
        builder = GraphBuilder(self.model, BuildParams(0, 0, n_ctx_seq=self.n_cells // self.n_seq_max),
                               self.cache_of_layer)
        graph = builder.build_k_shift(self.name, self.layers)
        run_graph(graph, {f"k_shift:{self.name}": self.cells.shift.astype(np.int32)})
        self.cells.shift[:] = 0
        self.has_shift = False

    # -- sequence operations ----------------------------------------------------------------------------------
    def _select(self, state: CellsState, seq_id: int, p0: int, p1: int) -> np.ndarray:
        lo, hi = _range(p0, p1)
        in_range = (state.pos >= lo) & (state.pos < hi)
        if seq_id < 0:
            return np.asarray(in_range & (state.seq != 0))
        return np.asarray(in_range & self._has_seq(state, seq_id))

    def _seq_rm_state(self, state: CellsState, seq_id: int, p0: int, p1: int) -> None:
        hit = self._select(state, seq_id, p0, p1)
        if seq_id < 0:
            state.seq[hit] = 0
        else:
            state.seq[hit] &= ~self._seq_bit(seq_id)
        freed = hit & (state.seq == 0)
        state.pos[freed] = -1
        state.shift[freed] = 0
        first_free = np.flatnonzero(freed)
        if first_free.size and first_free[0] < state.head:
            state.head = int(first_free[0])

    def _seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        self._seq_rm_state(self.cells, seq_id, p0, p1)
        return True

    def _seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        if seq_id_src == seq_id_dst:
            return
        hit = self._select(self.cells, seq_id_src, p0, p1)
        self.cells.seq[hit] |= self._seq_bit(seq_id_dst)

    def _seq_keep(self, seq_id: int) -> None:
        bit = self._seq_bit(seq_id)
        keep = (self.cells.seq & bit) != 0
        self.cells.seq[keep] = bit
        self.cells.seq[~keep] = 0
        self.cells.pos[~keep] = -1
        self.cells.shift[~keep] = 0
        self.cells.head = 0

    def _seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        if delta == 0:
            return
        hit = self._select(self.cells, seq_id, p0, p1)
        if not hit.any():
            return
        self.cells.pos[hit] += delta
        self.cells.shift[hit] += delta
        self.has_shift = True
        gone = hit & (self.cells.pos < 0)  # shifted before position 0: the cell is dropped
        self.cells.seq[gone] = 0
        self.cells.pos[gone] = -1
        self.cells.shift[gone] = 0

    def _seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        if d == 1:
            return
        if d <= 0:
            raise ContextError(f"seq_div needs a positive divisor, got {d}")
        hit = self._select(self.cells, seq_id, p0, p1)
        if not hit.any():
            return
        old = self.cells.pos[hit]
        new = old // d
        self.cells.pos[hit] = new
        self.cells.shift[hit] += new - old
        self.has_shift = True

    def _clear(self, data: bool) -> None:
        self.cells.pos[:] = -1
        self.cells.seq[:] = 0
        self.cells.shift[:] = 0
        self.cells.head = 0
        self.has_shift = False
        # ``data`` is accepted for llama.cpp parity; the buffers need no zeroing: every cell is masked until
        # written again, and written values are finite.


def _all_swa(model: GraphModel) -> bool:
    """A single cache may only be windowed when every layer uses the window."""
    hp = model.known_hparams
    return hp.n_swa > 0 and hp.swa_type != "none" and bool(hp.swa_layers) and all(hp.swa_layers)


class KVCacheBatch(MemoryBatch):
    """Slots reserved in one KVCache for each ubatch of a batch."""

    def __init__(self, cache: KVCache, ubatches: list["UBatch"], slots: list[np.ndarray]):
        self.cache = cache
        self.ubatches = ubatches
        self.slots = slots

    def apply(self, i: int) -> None:
        self.cache._apply_ubatch(self.cache.cells, self.slots[i], self.ubatches[i])

    def n_kv(self) -> dict[str, int]:
        return {self.cache.name: self.cache.get_n_kv()}

    def set_inputs(self, i: int, ubatch: "UBatch", inputs: dict[str, np.ndarray]) -> None:
        n_kv = self.cache.get_n_kv()
        inputs[f"kv_idx:{self.cache.name}"] = self.slots[i]
        inputs[f"kq_mask:{self.cache.name}"] = self.cache._mask(ubatch, n_kv)


class CompositeMemory(Memory):
    """Several KV caches side by side, each serving some layers (the base of llama.cpp's iSWA cache).

    Subclasses build ``self.parts`` in :meth:`create`; every sequence operation is applied to every part and a
    batch is reserved in all parts or in none.
    """

    def __init__(self, parts: list[KVCache]):
        self.parts = parts
        self.n_seq_max = parts[0].n_seq_max
        self.cache_names = [p.name for p in parts]
        self._layer_part = {il: p for p in parts for il in p.layers}

    @classmethod
    def create(cls, model: GraphModel, cparams: MemoryParams) -> Memory:
        raise NotImplementedError("subclasses decide how to split the layers into caches")

    def cache_of_layer(self, il: int) -> str:
        return self._layer_part[il].name

    def allocate(self, backend_of_layer: Callable[[int], Backend]) -> dict[tuple[str, int], KVHandle]:
        storage: dict[tuple[str, int], KVHandle] = {}
        for part in self.parts:
            storage.update(part.allocate(backend_of_layer))
        return storage

    def prepare(self, ubatches: list["UBatch"]) -> MemoryBatch | None:
        batches: list[MemoryBatch] = []
        for part in self.parts:
            mb = part.prepare(ubatches)
            if mb is None:
                return None
            batches.append(mb)
        return _CompositeBatch(batches)

    def update(self, run_graph: GraphRunner) -> None:
        for part in self.parts:
            part.update(run_graph)

    def seq_pos_min(self, seq_id: int) -> int:
        return max(p.seq_pos_min(seq_id) for p in self.parts)  # the window may have dropped old positions

    def seq_pos_max(self, seq_id: int) -> int:
        return min(p.seq_pos_max(seq_id) for p in self.parts)

    def _seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return all([p.seq_rm(seq_id, p0, p1) for p in self.parts])

    def _seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        for p in self.parts:
            p.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def _seq_keep(self, seq_id: int) -> None:
        for p in self.parts:
            p.seq_keep(seq_id)

    def _seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        for p in self.parts:
            p.seq_add(seq_id, p0, p1, delta)

    def _seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        for p in self.parts:
            p.seq_div(seq_id, p0, p1, d)

    def _clear(self, data: bool) -> None:
        for p in self.parts:
            p.clear(data)


class _CompositeBatch(MemoryBatch):
    def __init__(self, batches: list[MemoryBatch]):
        self.batches = batches

    def apply(self, i: int) -> None:
        for mb in self.batches:
            mb.apply(i)

    def n_kv(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for mb in self.batches:
            out.update(mb.n_kv())
        return out

    def set_inputs(self, i: int, ubatch: "UBatch", inputs: dict[str, np.ndarray]) -> None:
        for mb in self.batches:
            mb.set_inputs(i, ubatch, inputs)

    def take_outputs(self, i: int, ubatch: "UBatch", outputs: dict[str, np.ndarray]) -> None:
        for mb in self.batches:
            mb.take_outputs(i, ubatch, outputs)


# ---------------------------------------------------------------------------------------------------------
# interleaved sliding-window attention (iSWA): llama.cpp's llama_kv_cache_iswa
# ---------------------------------------------------------------------------------------------------------

#: cache of the global (full-context) layers and of the sliding-window layers
ISWA_BASE_CACHE = "kv"
ISWA_SWA_CACHE = "kv_swa"


def swa_cache_size(n_ctx: int, n_swa: int, n_seq_max: int, n_ubatch: int) -> int:
    """Cells of the sliding-window cache, as llama.cpp sizes it: every sequence's window plus one ubatch (the
    cells a ubatch writes cannot reuse cells its own tokens still see), at most the full context, padded to
    256 (``GGML_PAD(min(n_ctx, n_swa * n_seq_max + n_ubatch), 256)`` with a unified cache)."""
    return pad_to(min(n_ctx, n_swa * n_seq_max + n_ubatch), KV_PAD)


class KVCacheISWA(CompositeMemory):
    """Two KV caches side by side: ``"kv"`` for the global layers (the whole context) and ``"kv_swa"`` for the
    sliding-window layers, which keeps only about ``n_swa + n_ubatch`` cells and reuses the cells that fell out
    of every sequence's window (llama.cpp's ``llama_kv_cache_iswa``).

    Each cache has its own cells, slots, ``kv_idx:<cache>`` and ``kq_mask:<cache>`` inputs (the SWA mask also
    hides cells older than the window); a batch is reserved in both or in neither, and every sequence operation
    applies to both. ``swa_full=True`` gives the SWA cache the full context size (llama.cpp's ``--swa-full``).
    """

    def __init__(self, model: GraphModel, n_ctx: int, n_seq_max: int = 1, n_ubatch: int = 512, *, swa_full: bool = False):
        hp = model.known_hparams
        if hp.n_swa <= 0 or hp.swa_type == "none" or not any(hp.swa_layers):
            raise ContextError(f"the interleaved sliding-window cache needs sliding-window layers; arch "
                               f"{hp.arch!r} has n_swa = {hp.n_swa}, swa_type = {hp.swa_type!r}")
        if n_ubatch <= 0:
            raise ContextError(f"n_ubatch must be positive, got {n_ubatch}")
        n_ctx = pad_to(n_ctx, KV_PAD)
        size_swa = n_ctx if swa_full else swa_cache_size(n_ctx, hp.n_swa, n_seq_max, n_ubatch)
        kv_layers = [il for il in range(hp.n_layer) if model.known_arch.has_kv(hp, il)]
        self.base = KVCache(model, n_ctx, n_seq_max, name=ISWA_BASE_CACHE,
                            layers=[il for il in kv_layers if not hp.is_swa(il)])
        self.swa = KVCache(model, size_swa, n_seq_max, name=ISWA_SWA_CACHE,
                           layers=[il for il in kv_layers if hp.is_swa(il)],
                           n_swa=hp.n_swa, swa_type=hp.swa_type)
        super().__init__([self.base, self.swa])
        log.info("iSWA KV cache: %d cells for %d global layers, %d cells for %d sliding-window layers (n_swa %d)",
                 self.base.n_cells, len(self.base.layers), self.swa.n_cells, len(self.swa.layers), hp.n_swa)

    @classmethod
    def create(cls, model: GraphModel, cparams: MemoryParams) -> Memory:
        """The iSWA cache, or one plain :class:`KVCache` when the model has no sliding-window layer (llama.cpp
        picks its memory the same way)."""
        hp = model.known_hparams
        if hp.n_swa <= 0 or hp.swa_type == "none" or not any(hp.swa_layers):
            return KVCache.create(model, cparams)
        return cls(model, cparams.n_ctx, cparams.n_seq_max, cparams.n_ubatch)

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + self.swa.nbytes

    # the global cache holds a superset of the window's positions: llama.cpp answers from the SWA cache
    def seq_pos_min(self, seq_id: int) -> int:
        return self.swa.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.swa.seq_pos_max(seq_id)
