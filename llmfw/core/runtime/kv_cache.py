"""llama.cpp's unified KV cache (:class:`KVCache`): its cells, slot search (keeping each sequence in runs of
cells, where llama.cpp interleaves sequences decoded together), attention mask, K-shift and sequence operations
(see :mod:`llmfw.core.runtime.memory` for the design)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from ..exec.backend import ArrayKV, Backend, KVHandle, KVLayerShape
from ..errors import ContextError
from .memory_base import KV_PAD, MAX_SEQ, NEG_INF, GraphRunner, Memory, MemoryBatch, MemoryParams, _range, pad_to

if TYPE_CHECKING:
    from .batch import UBatch
    from ..ir.graph import GraphModel

log = logging.getLogger(__name__)
#: the sort key of an empty cell in :meth:`KVCache._order` (after every position)
_EMPTY_LAST = np.iinfo(np.int64).max
#: cells of the block a sequence's new run starts at (see :meth:`KVCache._run_slots`)
RUN_CELLS = 32
#: the most tokens of a ubatch placed in runs one by one (a decode step of many sequences; longer ubatches, a
#: prompt's, take the search from ``head``)
RUN_TOKENS_MAX = 64


@dataclass
class CellsState:
    """Cell metadata (copied whole to simulate slot reservation)."""

    pos: np.ndarray  # int64 [n_cells], -1 = empty
    seq: np.ndarray  # uint64 [n_cells], bit s = cell belongs to sequence s
    shift: np.ndarray  # int64 [n_cells], accumulated seq_add deltas not yet applied to K
    head: int = 0
    #: sequence -> the cell its last placed token went to: a hint for the next token's cell, checked before use
    tails: dict[int, int] = field(default_factory=dict)

    def copy(self) -> "CellsState":
        return CellsState(self.pos.copy(), self.seq.copy(), self.shift.copy(), self.head, dict(self.tails))


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
        """Bytes of K and V: as the backends allocated them (a backend may keep f16), float32 before that."""
        hp = self.hp
        total = 0
        for il in self.layers:
            storage = self.storage.get((self.name, il))
            if isinstance(storage, ArrayKV):
                total += int(storage.k.nbytes) + int(storage.v.nbytes)
            else:
                total += 4 * self.n_cells * (hp.n_embd_k_gqa(il) + hp.n_embd_v_gqa(il))
        return total

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
        """Free cells for the ubatch's tokens (not necessarily contiguous): each sequence's tokens in runs of cells
        for a decode step (:meth:`_run_slots`), else searching from ``head``."""
        n_tokens = ubatch.n_tokens
        if n_tokens > self.n_cells:
            return None
        usable = state.seq == 0
        if self.swa_type != "none":
            usable = usable | self._swa_reusable(state)
        runs = self._run_slots(state, ubatch, usable)
        if runs is not None:
            return runs
        head = state.head
        if head > int(np.count_nonzero(state.seq)) + 2 * n_tokens:
            head = 0  # plenty of free cells before head: fill from the start (llama.cpp's heuristic)
        order = np.concatenate([np.arange(head, self.n_cells), np.arange(0, head)])
        free = order[usable[order]]
        if free.size < n_tokens:
            return None
        return np.asarray(free[:n_tokens], dtype=np.int64)

    def _run_slots(self, state: CellsState, ubatch: "UBatch", usable: np.ndarray) -> np.ndarray | None:
        """Cells that keep each sequence's cells in runs, for a ubatch of at most RUN_TOKENS_MAX tokens of one
        sequence each (a decode step): a token takes the cell after its sequence's last one when that is free,
        else the first cell of the first block of RUN_CELLS cells that is free as a whole. Sequences decoded
        together would otherwise take turns cell by cell, and attention would read each one's keys and values
        scattered over the cache, a few lines per cell, where a run streams. ``usable`` counts a sliding window's
        reusable cells as free, as the search from ``head`` does. None (that search): a cache of one sequence, a
        longer ubatch, a token shared by sequences, or no run left for a token."""
        n_tokens = ubatch.n_tokens
        if self.n_seq_max == 1 or n_tokens > RUN_TOKENS_MAX:
            return None
        bits = ubatch.seq_bits
        if np.any(bits & (bits - np.uint64(1))):
            return None
        free = usable.copy()
        placed: dict[int, int] = {}  # sequence -> the cell of its last token in this ubatch
        cells = np.empty(n_tokens, dtype=np.int64)
        for i, (seq, pos) in enumerate(zip(ubatch.seq_first.tolist(), ubatch.pos.tolist())):
            tail = placed[seq] if seq in placed else self._tail_cell(state, seq, int(pos))
            after = tail + 1 if tail is not None else self.n_cells
            cell = after if after < self.n_cells and free[after] else self._free_block(free)
            if cell is None:
                return None
            cells[i] = placed[seq] = cell
            free[cell] = False
        return cells

    def _tail_cell(self, state: CellsState, seq: int, pos: int) -> int | None:
        """The cell of the token before ``pos`` in ``seq`` (``state.tails``' hint, when that cell holds it), else of
        the sequence's last position; None for a sequence without cells."""
        hint = state.tails.get(seq)
        if hint is not None and (state.seq[hint] & self._seq_bit(seq)) and state.pos[hint] == pos - 1:
            return hint
        has = np.flatnonzero(self._has_seq(state, seq))
        return int(has[np.argmax(state.pos[has])]) if has.size else None

    @staticmethod
    def _free_block(free: np.ndarray) -> int | None:
        """The first cell of the first block of RUN_CELLS cells that is free as a whole, or None."""
        whole = len(free) // RUN_CELLS * RUN_CELLS
        blocks = free[:whole].reshape(-1, RUN_CELLS).all(axis=1)
        first = np.flatnonzero(blocks)
        return int(first[0]) * RUN_CELLS if first.size else None

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
        state.tails.update(zip(ubatch.seq_first.tolist(), idx.tolist()))  # the last of each sequence's tokens wins
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

    def _order(self, n_kv: int) -> np.ndarray:
        """int32 [n_kv]: the cells by ascending position, ties by cell index, the empty cells last (so a cache
        filled in position order, the padding after its cells included, gives cell order itself). A sliding
        window's ring that wrapped, or cells freed and reused, put positions out of cell order: a backend that sums
        a row's visible cells in this order gives it the same bits wherever its cells sit."""
        pos = self.cells.pos[:n_kv]
        # a stable sort merges the ascending runs the cells hold (one per sequence, two for a wrapped ring):
        # tens of microseconds for 32k cells
        return np.argsort(np.where(pos < 0, _EMPTY_LAST, pos), kind="stable").astype(np.int32)

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
        inputs[f"kv_order:{self.cache.name}"] = self.cache._order(n_kv)
