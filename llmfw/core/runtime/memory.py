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
  sees the cells of s at positions ≤ p (and, with a sliding window, not older than the window); and the cells by
  ascending position (``kv_order:<cache>``, [n_kv]: a sliding window's ring wraps, so cell order is not position
  order, and the native backend sums in position order to stay batch invariant). ``n_kv``, the
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
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..exec.backend import Backend, KVHandle
from ..errors import ContextError
# the interface and the KV cache, importable from here as before they moved out
from .kv_cache import CellsState as CellsState, KVCache as KVCache, KVCacheBatch as KVCacheBatch
from .memory_base import (KV_PAD as KV_PAD, MAX_SEQ as MAX_SEQ, NEG_INF as NEG_INF, GraphRunner as GraphRunner,
                          Memory as Memory, MemoryBatch as MemoryBatch, MemoryParams as MemoryParams,
                          SeqTokens as SeqTokens, _range as _range, pad_to as pad_to)

if TYPE_CHECKING:
    from .batch import UBatch
    from ..ir.graph import GraphModel

log = logging.getLogger(__name__)


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
