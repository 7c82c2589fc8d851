"""Recurrent-state memory (llama.cpp's ``llama_memory_recurrent``) and the hybrid memory that pairs it with a KV
cache (``llama_memory_hybrid``): what LFM2's short convolutions, Mamba2 and Gated DeltaNet layers carry from one
ubatch to the next.

**State.** A recurrent layer keeps, per sequence, a fixed-size state whatever the sequence's length — kinds and
shapes declared by ``Architecture.recurrent_state(hp, il)`` (LFM2: ``{"conv": (K - 1, n_embd)}``, the last K-1
inputs of its convolution). :class:`RecurrentMemory` holds them as float32 arrays ``[n_seq_max, *shape]`` on the
host, one row per sequence, plus the position of the last token each sequence has absorbed. The graph receives
the rows of the ubatch's sequences as inputs ``rs:<kind>:<layer>`` [n_seqs, *shape] and returns the updated rows
as outputs of the same names (``GraphBuilder.build_rs`` / ``store_rs``), which :meth:`RecurrentBatch.take_outputs`
writes back once the ubatch ran: a failed compute leaves the state as it was.

**Ubatches.** A state update runs over [n_seqs, n_seq_tokens], so the batch is cut with
:func:`llmfw.core.runtime.batch.split_equal` (llama.cpp's ``split_equal``): every sequence in a ubatch has the same number
of tokens, laid out sequence after sequence in position order. A token shared by several sequences is refused
(decode -1): copy a decoded state with ``seq_cp`` instead.

**Sequence operations** follow llama.cpp's semantics for a state that cannot be taken apart:

* ``seq_rm(s, p0, p1)``: removing the whole sequence (``p0 <= 0``, range reaching its last position) resets its
  state; an empty range or one past its last position removes nothing (True). Any other range — a *suffix*
  (``0 < p0 <= last``) or positions before the last one (``p1 <= last``) — would need a state the sequence no
  longer has: False, nothing changes, and a warning says so (llama.cpp's ``llama_memory_recurrent::seq_rm``).
  ``seq_id < 0`` accepts only the whole range (everything or nothing).
* ``seq_cp(src, dst)`` copies the state whatever the range (the state stands for every position at once);
* ``seq_keep``, ``clear``; ``seq_add`` / ``seq_div`` move the recorded position (the state holds no position);
* ``seq_pos_min`` = ``seq_pos_max`` = the last position absorbed (llama.cpp's single cell per sequence).

**Hybrid.** :class:`HybridMemory` gives the layers without a recurrent state a :class:`KVCache` (name ``"kv"``)
and the others a :class:`RecurrentMemory`, reserves every batch in both or in neither, splits it the recurrent
way, and applies every sequence operation to both (``seq_rm`` only when both can).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .batch import BatchError, split_equal
from ..errors import ContextError
from .memory import GraphRunner, KVCache, Memory, MemoryBatch, MemoryParams, _range

if TYPE_CHECKING:
    from .batch import AllocatedBatch, UBatch
    from ..ir.graph import GraphModel

log = logging.getLogger(__name__)

#: a layer's state kinds and per-sequence shapes (``Architecture.recurrent_state``)
StateShapes = dict[str, tuple[int, ...]]


def recurrent_layers(model: GraphModel) -> dict[int, StateShapes]:
    """Layer → its state shapes, for every layer the architecture gives a recurrent state."""
    arch, hp = model.known_arch, model.known_hparams
    layers = {}
    for il in range(hp.n_layer):
        shapes = arch.recurrent_state(hp, il)
        if shapes:
            layers[il] = dict(shapes)
    return layers


def state_name(kind: str, il: int) -> str:
    """The graph input / output carrying state ``kind`` of layer ``il``."""
    return f"rs:{kind}:{il}"


class RecurrentMemory(Memory):
    """Per-sequence recurrent states of some layers (llama.cpp's ``llama_memory_recurrent`` with one cell per
    sequence). Registered as ``"recurrent"``: the memory of a family whose every layer is recurrent."""

    def __init__(self, model: GraphModel, n_seq_max: int, layers: dict[int, StateShapes] | None = None):
        if n_seq_max < 1:
            raise ContextError(f"n_seq_max must be at least 1, got {n_seq_max}")
        self.model = model
        self.n_seq_max = n_seq_max
        self.layers = recurrent_layers(model) if layers is None else layers
        if not self.layers:
            raise ContextError(f"architecture {model.known_hparams.arch!r} declares no recurrent state "
                               "(Architecture.recurrent_state) for any layer")
        self.cache_names: list[str] = []
        #: (kind, layer) → float32 [n_seq_max, *shape], row s = sequence s's state (zeros: nothing absorbed)
        self.states = {(kind, il): np.zeros((n_seq_max, *shape), dtype=np.float32)
                       for il, shapes in self.layers.items() for kind, shape in shapes.items()}
        #: per sequence, the position of the last token its state absorbed (-1: empty)
        self.pos = np.full(n_seq_max, -1, dtype=np.int64)

    @classmethod
    def create(cls, model: GraphModel, cparams: MemoryParams) -> "RecurrentMemory":
        return cls(model, cparams.n_seq_max)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.states.values())

    def describe(self) -> str:
        return (f"recurrent state for {len(self.layers)} layers ({self.nbytes / 2**20:.2f} MiB for "
                f"{self.n_seq_max} sequences)")

    # -- storage: nothing on the backends; the states travel as graph inputs / outputs ---------------------
    def cache_of_layer(self, il: int) -> str:
        raise ContextError(f"layer {il} keeps a recurrent state, not a KV cache: it has no attention to cache")

    def allocate(self, backend_of_layer: Callable[[int], Any]) -> dict[tuple[str, int], Any]:
        return {}

    # -- batches ------------------------------------------------------------------------------------------
    def init_batch(self, batch: AllocatedBatch, n_ubatch: int) -> tuple[list[UBatch], MemoryBatch | None]:
        ubatches = split_equal(batch, n_ubatch)
        return ubatches, self.prepare(ubatches)

    def prepare(self, ubatches: list[UBatch]) -> "RecurrentBatch":
        for ub in ubatches:
            if not ub.seqs:
                raise BatchError("a recurrent state needs ubatches split by sequence (split_equal)")
        return RecurrentBatch(self, ubatches)

    def update(self, run_graph: GraphRunner) -> None:
        """Nothing to maintain: a state has no positions to shift."""

    # -- queries ------------------------------------------------------------------------------------------
    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise ContextError(f"sequence id {seq_id} is out of range 0..{self.n_seq_max - 1} (n_seq_max)")

    def seq_pos_min(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return int(self.pos[seq_id])

    def seq_pos_max(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return int(self.pos[seq_id])

    def can_drop_suffix(self, n_tokens: int) -> bool:
        return n_tokens <= 0

    # -- sequence operations ------------------------------------------------------------------------------
    def _reset(self, seqs: slice | int) -> None:
        for state in self.states.values():
            state[seqs] = 0.0
        self.pos[seqs] = -1

    def _seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        lo, hi = _range(p0, p1)
        whole = lo == 0 and p1 < 0
        if seq_id < 0:
            if whole:
                self._reset(slice(None))
                return True
            return lo >= hi  # an empty range removes nothing; any other range cannot be cut out of a state
        self._check_seq(seq_id)
        last = int(self.pos[seq_id])
        if last < 0 or lo >= hi or lo > last:
            return True  # the range holds none of the positions the state has absorbed
        if lo == 0 and hi > last:
            self._reset(seq_id)
            return True
        # a suffix, or positions the state absorbed before its last one: either needs a state it no longer has
        log.warning("recurrent memory: sequence %d cannot drop positions %d..%s — its state is the one after "
                    "position %d and cannot be taken apart or rolled back (remove the whole sequence instead)",
                    seq_id, lo, "" if p1 < 0 else hi - 1, last)
        return False

    def _seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        self._check_seq(seq_id_src)
        self._check_seq(seq_id_dst)
        if seq_id_src == seq_id_dst:
            return
        for state in self.states.values():
            state[seq_id_dst] = state[seq_id_src]
        self.pos[seq_id_dst] = self.pos[seq_id_src]

    def _seq_keep(self, seq_id: int) -> None:
        self._check_seq(seq_id)
        others = np.arange(self.n_seq_max) != seq_id
        for state in self.states.values():
            state[others] = 0.0
        self.pos[others] = -1

    def _moved(self, seq_id: int, p0: int, p1: int) -> np.ndarray:
        """Sequences (all for ``seq_id < 0``) whose last position lies in [p0, p1)."""
        lo, hi = _range(p0, p1)
        chosen = np.zeros(self.n_seq_max, dtype=bool)
        if seq_id < 0:
            chosen[:] = True
        else:
            self._check_seq(seq_id)
            chosen[seq_id] = True
        return np.asarray(chosen & (self.pos >= lo) & (self.pos < hi))

    def _seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        moved = self._moved(seq_id, p0, p1)
        self.pos[moved] += delta
        gone = np.flatnonzero(moved & (self.pos < 0))  # shifted before position 0: the sequence is dropped
        for s in gone.tolist():
            self._reset(s)

    def _seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        if d <= 0:
            raise ContextError(f"seq_div needs a positive divisor, got {d}")
        moved = self._moved(seq_id, p0, p1)
        self.pos[moved] //= d

    def _clear(self, data: bool) -> None:
        self._reset(slice(None))

    # -- saved state (core/state.py) ------------------------------------------------------------------------
    def state_arrays(self) -> list[tuple[str, np.ndarray]]:
        """Everything that defines the memory's content, as named arrays (a state file's payload)."""
        arrays = [("rs.pos", self.pos.copy())]
        arrays += [(f"rs.{kind}.{il}", state.copy()) for (kind, il), state in self.states.items()]
        return arrays

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the content with :meth:`state_arrays`' output (shapes checked first: all or nothing)."""
        wanted = dict(self.state_arrays())
        for name, like in wanted.items():
            got = arrays.get(name)
            if got is None or got.shape != like.shape or got.dtype != like.dtype:
                raise ContextError(f"the saved recurrent state {name!r} does not fit this context "
                                   f"(expected {like.dtype}{list(like.shape)})")
        if (arrays["rs.pos"] < -1).any():
            raise ContextError("the saved recurrent state is corrupt (a position below -1)")
        self.pos[:] = arrays["rs.pos"]
        for (kind, il), state in self.states.items():
            state[:] = arrays[f"rs.{kind}.{il}"]


class RecurrentBatch(MemoryBatch):
    """The states of one batch's ubatches: gathered per ubatch into the graph's inputs, scattered back from its
    outputs after the compute."""

    def __init__(self, memory: RecurrentMemory, ubatches: list[UBatch]):
        self.memory = memory
        self.ubatches = ubatches

    def apply(self, i: int) -> None:
        """Nothing to commit before the compute: the state changes when its outputs come back."""

    def n_kv(self) -> dict[str, int]:
        return {}

    def set_inputs(self, i: int, ubatch: UBatch, inputs: dict[str, np.ndarray]) -> None:
        rows = list(ubatch.seqs)
        for (kind, il), state in self.memory.states.items():
            inputs[state_name(kind, il)] = state[rows]

    def take_outputs(self, i: int, ubatch: UBatch, outputs: dict[str, np.ndarray]) -> None:
        rows = list(ubatch.seqs)
        for (kind, il), state in self.memory.states.items():
            name = state_name(kind, il)
            if name not in outputs:
                raise ContextError(f"the graph did not return the new recurrent state {name!r}")
            state[rows] = outputs[name].reshape(state[rows].shape)
        per_seq = ubatch.pos.reshape(len(rows), -1)
        self.memory.pos[rows] = per_seq.max(axis=1)


class HybridMemory(Memory):
    """A KV cache for the attention layers and a recurrent state for the others (llama.cpp's
    ``llama_memory_hybrid``), chosen per layer by ``Architecture.recurrent_state``. Registered as ``"hybrid"``."""

    def __init__(self, model: GraphModel, n_ctx: int, n_seq_max: int = 1):
        layers = recurrent_layers(model)
        arch, hp = model.known_arch, model.known_hparams
        attention = [il for il in range(hp.n_layer) if il not in layers and arch.has_kv(hp, il)]
        self.recurrent = RecurrentMemory(model, n_seq_max, layers)
        self.kv = KVCache(model, n_ctx, n_seq_max, layers=attention)
        self.n_seq_max = n_seq_max
        self.cache_names = self.kv.cache_names if attention else []

    @classmethod
    def create(cls, model: GraphModel, cparams: MemoryParams) -> "HybridMemory":
        return cls(model, cparams.n_ctx, cparams.n_seq_max)

    @property
    def parts(self) -> list[Memory]:
        """The memories sequence operations go to (a KV cache serving no layer has nothing to keep)."""
        return [self.kv, self.recurrent] if self.kv.layers else [self.recurrent]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.recurrent.nbytes

    def describe(self) -> str:
        return (f"KV cache for {len(self.kv.layers)} attention layers ({self.kv.n_cells} cells) + "
                f"{self.recurrent.describe()}")

    def cache_of_layer(self, il: int) -> str:
        if il in self.recurrent.layers:
            return self.recurrent.cache_of_layer(il)
        return self.kv.cache_of_layer(il)

    def allocate(self, backend_of_layer: Callable[[int], Any]) -> dict[tuple[str, int], Any]:
        return self.kv.allocate(backend_of_layer) if self.kv.layers else {}

    def init_batch(self, batch: AllocatedBatch, n_ubatch: int) -> tuple[list[UBatch], MemoryBatch | None]:
        ubatches = split_equal(batch, n_ubatch)
        return ubatches, self.prepare(ubatches)

    def prepare(self, ubatches: list[UBatch]) -> MemoryBatch | None:
        from .memory import _CompositeBatch

        recurrent = self.recurrent.prepare(ubatches)
        if not self.kv.layers:
            return recurrent
        kv = self.kv.prepare(ubatches)
        return None if kv is None else _CompositeBatch([kv, recurrent])

    def update(self, run_graph: GraphRunner) -> None:
        self.kv.update(run_graph)

    # llama.cpp's hybrid answers with the narrower of the two ranges
    def seq_pos_min(self, seq_id: int) -> int:
        return max(part.seq_pos_min(seq_id) for part in self.parts)

    def seq_pos_max(self, seq_id: int) -> int:
        return min(part.seq_pos_max(seq_id) for part in self.parts)

    def can_drop_suffix(self, n_tokens: int) -> bool:
        return self.recurrent.can_drop_suffix(n_tokens)

    def _seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        # ask the recurrent part first: when it refuses, the KV cache must stay as it is
        return all(part.seq_rm(seq_id, p0, p1) for part in reversed(self.parts))

    def _seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int, p1: int) -> None:
        for part in self.parts:
            part.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def _seq_keep(self, seq_id: int) -> None:
        for part in self.parts:
            part.seq_keep(seq_id)

    def _seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        for part in self.parts:
            part.seq_add(seq_id, p0, p1, delta)

    def _seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        for part in self.parts:
            part.seq_div(seq_id, p0, p1, d)

    def _clear(self, data: bool) -> None:
        for part in self.parts:
            part.clear(data)
