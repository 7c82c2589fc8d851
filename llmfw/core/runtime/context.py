"""The context: one conversation state on a model (KV cache, scheduler, logits) and ``decode``.

``ctx.decode(batch)`` follows llama.cpp's ``llama_context::decode``: validate and complete the batch (-1 on a
bad batch) → apply pending memory maintenance (K-shift) → split into ubatches → reserve a KV slot for every
ubatch before any runs (1 when they do not fit; nothing changes) → per ubatch: check ``abort_callback`` (2) →
commit the ubatch's cells → reuse the previous graph when its :class:`BuildParams` are equal, else build one
through the architecture and plan it on the backends → set the inputs → compute → append the output rows.
Return codes: 0 ok, 1 no KV slot, 2 aborted, -1 bad batch, -3 computation failed. Nothing is raised for
these; the reason is in ``ctx.last_error`` and the log.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .collector import collector_paused
from .batch import AllocatedBatch, Batch, BatchAllocator, BatchError, UBatch, sequences_of
from ..errors import ConfigError, ContextError, LogitsIndexError
from ..validation import validation_error_message
from ..ir.graph import BuildParams, Graph, GraphBuilder, GraphModel
from .memory import KV_PAD, Memory, MemoryBatch, SeqTokens, pad_to
from ..exec.scheduler import PlacedModel, Plan, Scheduler

if TYPE_CHECKING:
    import os

    from ..arch.architecture import Architecture
    from ..exec.backend import Backend
    from ..tokenizer.vocab import Vocab
    from .state import SamplerChainState

log = logging.getLogger(__name__)

#: decode-shaped plans a context keeps besides its last one (:meth:`Context._graph_for`), at most ...
DECODE_PLANS_KEPT = 8
#: ... holding this many tokens per sequence of the context in all (a plan's buffers grow with its tokens: the
#: kept ones take at most about as much memory as this many of the largest decode plan)
DECODE_PLAN_TOKENS_PER_SEQ = 3


class ContextModel(GraphModel, PlacedModel, Protocol):
    """What a context reads of its model (:class:`~.model.Model`, one module up, makes contexts on itself)."""

    @property
    def known_arch(self) -> Architecture: ...

    @property
    def vocab(self) -> Vocab: ...

    @property
    def vocab_only(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    @property
    def n_vocab(self) -> int: ...

    @property
    def n_embd(self) -> int: ...

    @property
    def arch_name(self) -> str: ...

    @property
    def sha256(self) -> str: ...

    @property
    def backends(self) -> Mapping[str, Backend]: ...


DECODE_OK = 0
DECODE_NO_SLOT = 1
DECODE_ABORTED = 2
DECODE_BAD_BATCH = -1
DECODE_COMPUTE_FAILED = -3


class ContextParams(BaseModel):
    """Context settings (pinned public API)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    #: KV cache size in tokens; 0 = min(n_ctx_train, 4096). Rounded up to a multiple of 256 like llama.cpp.
    n_ctx: int = Field(default=0, ge=0)
    #: most tokens one decode() accepts
    n_batch: int = Field(default=2048, gt=0)
    #: most tokens one graph evaluation processes
    n_ubatch: int = Field(default=512, gt=0)
    #: number of independent sequences the KV cache holds
    n_seq_max: int = Field(default=1, ge=1, le=64)
    n_threads: int | None = Field(default=None, gt=0)
    #: polled between ubatches; returning True aborts decode (it returns 2)
    abort_callback: Callable[[], bool] | None = None
    #: llama.cpp's ``embeddings``: decode outputs the final hidden state (after the output norm) of each output
    #: token instead of logits; read it with ``get_embeddings`` (``Model.embed`` pools it)
    embeddings: bool = False


class Context:
    """Decoding state on a model. ``Context(model, params, **kw)`` == ``model.new_context(params, **kw)``."""

    def __init__(self, model: ContextModel, params: ContextParams | None = None, **kw: Any):
        if model.vocab_only:
            raise ContextError("this model was loaded with vocab_only=True; load its weights to decode")
        if model.closed:
            raise ContextError("the model is closed")
        self.model: ContextModel = model
        self.params = _context_params(params, kw)
        hp = model.known_hparams
        n_ctx = self.params.n_ctx or min(hp.n_ctx_train, 4096)
        self.n_ctx: int = pad_to(n_ctx, KV_PAD)
        self.n_batch: int = min(self.params.n_batch, self.n_ctx) if hp.causal_attn else self.params.n_batch
        self.n_ubatch: int = min(self.params.n_ubatch, self.n_batch)
        self.n_seq_max: int = self.params.n_seq_max
        self.abort_callback = self.params.abort_callback
        self.memory: Memory = self._create_memory()
        #: per sequence, the tokens whose KV is in the cache (positions 0, 1, ...), updated by every decode and
        #: every sequence operation of the memory; ``generate`` and the serving engine match new prompts against
        #: them to reuse a shared prefix, and a saved state (``state_save_file``) carries them
        self.seq_records = SeqTokens(self.n_seq_max)
        self.memory.records = self.seq_records
        self.seq_tokens: list[list[int]] = self.seq_records.lists
        self.kv_storage = self.memory.allocate(model.layer_backend)
        self.scheduler = Scheduler(model, self.kv_storage)
        self.allocator = BatchAllocator(model.n_vocab, hp.n_embd, self.n_seq_max)
        #: graphs built / reused since creation (llama.cpp's graph reuse)
        self.n_graph_builds = 0
        self.n_graph_reuses = 0
        self.last_error: str | None = None
        self._plan: Plan | None = None
        self._plan_params: BuildParams | None = None
        #: decode-shaped plans kept besides the last one (:meth:`_graph_for`), least recently used first
        self._decode_plans: OrderedDict[BuildParams, Plan] = OrderedDict()
        self._logits = np.zeros((0, model.n_vocab), dtype=np.float32)
        self._output_ids = np.zeros(0, dtype=np.int32)
        self._written = np.zeros(0, dtype=bool)
        self.reset_perf()

    # -- set-up ------------------------------------------------------------------------------------------
    def _create_memory(self) -> Memory:
        from ..plugins import registry

        cls = registry("memory").get_class(self.model.known_arch.memory, Memory)
        return cls.create(self.model, self)

    @property
    def n_vocab(self) -> int:
        return int(self.model.n_vocab)

    def close(self) -> None:
        self._plan = None
        self._decode_plans.clear()
        self.kv_storage = {}

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- decode --------------------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> int:
        """Evaluate a batch; returns 0 ok, 1 no KV slot, 2 aborted, -1 bad batch, -3 compute failure."""
        self.last_error = None
        try:
            if batch is not None and getattr(batch, "n_tokens", 0) > self.n_batch:
                raise BatchError(f"the batch has {batch.n_tokens} tokens, more than n_batch = {self.n_batch}")
            allocated = self.allocator.init(batch, self.memory)
        except BatchError as exc:
            return self._fail(DECODE_BAD_BATCH, str(exc))
        try:
            self.memory.update(self._run_maintenance)
        except Exception as exc:  # a failed K-shift leaves the cache unusable: fatal
            log.exception("memory update failed")
            return self._fail(DECODE_COMPUTE_FAILED, f"memory update (K-shift) failed: {exc}")
        try:
            ubatches, reserved = self.memory.init_batch(allocated, self.n_ubatch)
        except BatchError as exc:  # a split the memory cannot make (a recurrent state: shared tokens)
            return self._fail(DECODE_BAD_BATCH, str(exc))
        if reserved is None:
            return self._fail(DECODE_NO_SLOT, f"no KV cache slot for {allocated.n_tokens} tokens "
                                              f"({self.describe_n_ctx()}); free space with memory.seq_rm or use "
                                              "a larger n_ctx")
        code = self._run_ubatches(allocated, ubatches, reserved)
        self._record_tokens(allocated, code == DECODE_OK)
        return code

    def _record_tokens(self, allocated: AllocatedBatch, complete: bool) -> None:
        """Keep :attr:`seq_tokens` in step with the cache: the batch's tokens when it all ran, else each of its
        sequences cut where the batch began writing (some of its ubatches may have run)."""
        if complete:
            self.seq_records.decoded(allocated.tokens, allocated.pos, allocated.seq_ids)
            return
        first: dict[int, int] = {}
        for p, seqs in zip(allocated.pos.tolist(), allocated.seq_ids):
            for s in seqs:
                first[s] = min(first.get(s, p), p)
        for s, p in first.items():
            self.seq_records.cut(s, p)

    def n_ctx_padding_note(self) -> str:
        """``"64 requested, padded to a multiple of 256 like llama.cpp"`` when the KV padding changed the size
        that was asked for, else ``""``: the padding is never silent (``-v``, too-long errors)."""
        requested = self.params.n_ctx
        if requested and requested != self.n_ctx:
            return f"{requested} requested, padded to a multiple of {KV_PAD} like llama.cpp"
        return ""

    def describe_n_ctx(self) -> str:
        """``n_ctx 256 (64 requested, padded ...)`` or just ``n_ctx 4096``."""
        note = self.n_ctx_padding_note()
        return f"n_ctx {self.n_ctx}" + (f" ({note})" if note else "")

    def _run_ubatches(self, allocated: AllocatedBatch, ubatches: list[UBatch], reserved: MemoryBatch) -> int:
        start = time.perf_counter()
        self._begin_outputs(allocated)
        n_done = 0
        for i, ub in enumerate(ubatches):
            if self.abort_callback is not None and self.abort_callback():
                self._end_outputs()
                return self._fail(DECODE_ABORTED, f"aborted by abort_callback after {i} of {len(ubatches)} ubatches")
            reserved.apply(i)
            try:
                logits = self._process_ubatch(ub, reserved, i, allocated.embd is not None)
            except Exception as exc:  # llama.cpp reports a failed compute as a code
                log.exception("decode failed")
                self._forget_ubatch(ub)
                self._end_outputs()
                return self._fail(DECODE_COMPUTE_FAILED, f"computing ubatch {i} failed: {type(exc).__name__}: {exc}")
            rows = (np.arange(n_done, n_done + ub.n_outputs) if ub.rows is None
                    else self._output_ids[ub.rows[ub.output]])  # a ubatch regrouped by sequence: batch order
            if len(ubatches) == 1 and ub.rows is None and self._output_is_fresh():
                self._logits = logits  # every output row, in batch order, in an array no later compute writes
            else:
                self._logits[rows] = logits
            self._written[rows] = True
            n_done += ub.n_outputs
        self._record_perf(allocated.n_tokens, time.perf_counter() - start)
        return DECODE_OK

    def _process_ubatch(self, ub: UBatch, reserved: MemoryBatch, i: int, use_embd: bool) -> np.ndarray:
        params = BuildParams(ub.n_tokens, ub.n_outputs, use_embd, tuple(sorted(reserved.n_kv().items())),
                             n_ctx_seq=self.n_ctx // self.n_seq_max, embeddings=self.params.embeddings,
                             n_seqs=ub.n_seqs)
        plan = self._graph_for(params)
        inputs: dict[str, np.ndarray] = {"pos": ub.pos}
        if ub.embd is not None:
            inputs["embd"] = ub.embd
        elif ub.tokens is not None:
            inputs["tokens"] = ub.tokens
        inputs["out_ids"] = ub.out_ids
        inputs.update(self.model.known_arch.ubatch_inputs(self.model.known_hparams, ub.pos))
        reserved.set_inputs(i, ub, inputs)
        outputs = self._compute(plan, inputs)
        reserved.take_outputs(i, ub, outputs)  # a recurrent state's new values
        return outputs[self._output_name].reshape(ub.n_outputs, self._output_width)

    def _output_is_fresh(self) -> bool:
        """Whether the last plan's output (logits or embeddings) comes from a backend that hands out new arrays
        (``Backend.fresh_outputs``): then a ubatch that holds every output row is kept as it is, not copied."""
        assert self._plan is not None
        _, backend = self._plan.output_ids[self._output_name]
        return backend is not None and backend.fresh_outputs

    @property
    def _output_name(self) -> str:
        return "embd" if self.params.embeddings else "logits"

    @property
    def _output_width(self) -> int:
        return self.model.n_embd if self.params.embeddings else self.n_vocab

    def _graph_for(self, params: BuildParams) -> Plan:
        """The previous plan when the build parameters are unchanged, or a kept decode plan with these parameters,
        else a new graph planned on backends.

        Decode-shaped plans (at most one token per sequence) are kept, the most recently used ones up to
        :data:`DECODE_PLANS_KEPT` plans and :data:`DECODE_PLAN_TOKENS_PER_SEQ` tokens per sequence: a server
        alternates each request's prompt with the decode steps of all, and without them every request would build
        the decode graph again after its prompt. Prompt plans (their size varies with each
        prompt, and their buffers grow with it) are not kept beyond the last one."""
        if self._plan is not None and self._plan_params == params:
            self.n_graph_reuses += 1
            return self._plan
        kept = self._decode_plans.get(params)
        if kept is not None:
            self._decode_plans.move_to_end(params)
            self._plan, self._plan_params = kept, params
            self.n_graph_reuses += 1
            return kept
        arch = self.model.known_arch
        with collector_paused():  # a graph and its compiled programs: thousands of objects kept together
            builder = GraphBuilder(self.model, params, self.memory.cache_of_layer)
            arch.build_graph(builder)
            if self._output_name not in builder.graph.outputs:
                raise ContextError(f"architecture {arch.name!r} built a graph without a "
                                   f"{self._output_name!r} output")
            self._plan = self.scheduler.plan(builder.graph)
        self._plan_params = params
        self.n_graph_builds += 1
        if params.n_tokens <= self.n_seq_max:
            self._keep_decode_plan(params, self._plan)
        return self._plan

    def _keep_decode_plan(self, params: BuildParams, plan: Plan) -> None:
        self._decode_plans[params] = plan
        budget = DECODE_PLAN_TOKENS_PER_SEQ * self.n_seq_max
        while len(self._decode_plans) > DECODE_PLANS_KEPT or sum(p.n_tokens for p in self._decode_plans) > budget:
            self._decode_plans.popitem(last=False)  # never the new one: its tokens alone fit the budget

    def _run_maintenance(self, graph: Graph, inputs: dict[str, np.ndarray]) -> None:
        self._compute(self.scheduler.plan(graph), inputs)

    def _compute(self, plan: Plan, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run a plan with this context's thread count: each compute call states it (the model's backends are
        shared by its contexts, so a context's ``n_threads`` is not a setting it leaves behind)."""
        for backend in self.model.backends.values():
            backend.use_threads(self.params.n_threads)
        return self.scheduler.compute(plan, inputs)

    def _forget_ubatch(self, ub: UBatch) -> None:
        """After a failed ubatch, drop its positions (and later ones) from the memory, as llama.cpp does."""
        for s in sequences_of(ub.seq_first):
            p_min = int(ub.pos[ub.seq_first == s].min())
            self.memory.seq_rm(s, p_min, -1)

    def _fail(self, code: int, message: str) -> int:
        self.last_error = message
        log.log(logging.WARNING if code > 0 else logging.ERROR, "decode returned %d: %s", code, message)
        return code

    # -- outputs --------------------------------------------------------------------------------------------
    def _begin_outputs(self, allocated: AllocatedBatch) -> None:
        self._logits = np.empty((allocated.n_outputs, self._output_width), dtype=np.float32)
        ids = np.full(allocated.n_tokens, -1, dtype=np.int32)
        ids[allocated.output] = np.arange(allocated.n_outputs, dtype=np.int32)
        self._output_ids = ids
        #: output rows computed so far (ubatches regrouped by sequence fill them out of order)
        self._written = np.zeros(allocated.n_outputs, dtype=bool)

    def _end_outputs(self) -> None:
        """Keep only the rows computed before an abort or failure, in batch order."""
        kept = np.flatnonzero(self._written)
        self._logits = self._logits[kept]
        new_row = np.full(self._written.shape[0] + 1, -1, dtype=np.int32)  # index -1 (no output) stays -1
        new_row[kept] = np.arange(kept.size, dtype=np.int32)
        self._output_ids = new_row[self._output_ids]

    @property
    def n_outputs(self) -> int:
        return int(self._logits.shape[0])

    def get_logits(self) -> np.ndarray:
        """float32 [n_outputs, n_vocab] of the last decode (rows in batch order of the output tokens)."""
        if self.params.embeddings:
            raise ContextError("this context computes embeddings (embeddings=True): use get_embeddings()")
        return self._logits

    def get_embeddings(self) -> np.ndarray:
        """float32 [n_outputs, n_embd]: the output tokens' final hidden states (an ``embeddings=True`` context)."""
        if not self.params.embeddings:
            raise ContextError("this context computes logits; create it with embeddings=True for embeddings")
        return self._logits

    def get_logits_ith(self, i: int) -> np.ndarray:
        """The logits of batch index ``i`` (i ≥ 0) or of output row ``i`` from the end (i < 0), as a copy."""
        i = int(i)
        if i < 0:
            row = self.n_outputs + i
            if row < 0:
                raise LogitsIndexError(f"output row {i} does not exist: the last decode produced "
                                       f"{self.n_outputs} output rows")
        else:
            if i >= self._output_ids.shape[0]:
                raise LogitsIndexError(f"batch index {i} is out of range: the last batch had "
                                       f"{self._output_ids.shape[0]} tokens")
            row = int(self._output_ids[i])
            if row < 0:
                raise LogitsIndexError(f"no logits for batch index {i}: that token was not marked for output")
        row_logits: np.ndarray = self._logits[row].copy()
        return row_logits

    # -- saved state (core/runtime/state.py) ----------------------------------------------------------------------
    def state_save_file(self, path: str | os.PathLike[str], tokens: list[int] | None = None,
                        sampler: SamplerChainState | None = None) -> int:
        """Save the KV cells of every sequence, the token records (``tokens`` replaces sequence 0's) and the
        RNG state of ``sampler``'s samplers to ``path``; returns the bytes written."""
        from .state import save_state_file

        return save_state_file(self, path, tokens, sampler)

    def state_load_file(self, path: str | os.PathLike[str], sampler: SamplerChainState | None = None) -> list[int]:
        """Load a state saved by :meth:`state_save_file` and return its tokens. A file of another model or
        context shape, or a truncated / corrupt one, raises ContextError and leaves the context as it was."""
        from .state import load_state_file

        return load_state_file(self, path, sampler)

    # -- performance counters (llama.cpp's llama_perf_context) ---------------------------------------------
    def reset_perf(self) -> None:
        self.perf_data: dict[str, float] = {"n_p_eval": 0, "t_p_eval": 0.0, "n_eval": 0, "t_eval": 0.0}

    def _record_perf(self, n_tokens: int, seconds: float) -> None:
        key = "eval" if n_tokens == 1 else "p_eval"
        self.perf_data[f"n_{key}"] += n_tokens
        self.perf_data[f"t_{key}"] += seconds

    def perf(self) -> dict[str, float]:
        """Prompt (multi-token decodes) and generation (one-token decodes) counts, seconds and tokens/s."""
        d = dict(self.perf_data)
        d["prompt_tps"] = d["n_p_eval"] / d["t_p_eval"] if d["t_p_eval"] else 0.0
        d["eval_tps"] = d["n_eval"] / d["t_eval"] if d["t_eval"] else 0.0
        return d


def _context_params(params: ContextParams | None, kw: dict[str, Any]) -> ContextParams:
    base = dict(params) if params is not None else {}
    try:
        return ContextParams(**{**base, **kw})
    except ValidationError as exc:
        problems = validation_error_message(exc, known_keys=ContextParams.model_fields)
        raise ConfigError(f"invalid context parameters: {problems}") from None
