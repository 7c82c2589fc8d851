"""The continuous-batching engine: one thread, one Context with ``n_seq_max = parallel`` slots.

Callers (HTTP handlers, Python code, any thread) build a :class:`Job` per choice and :meth:`Engine.submit`
it; the engine thread never blocks on them. Each :meth:`Engine._step`:

1. drops cancelled jobs (their slot is free at once; the cached tokens stay for prefix reuse);
2. admits waiting jobs into idle slots — the idle slot whose cached tokens share the longest prefix with the
   prompt (llama-server's ``cache_prompt``), so only the rest of the prompt is decoded;
3. decodes **one batch**: the next token of every generating job plus prompt chunks of admitted ones, at most
   ``n_batch`` tokens;
4. samples each job whose row came out with that job's own sampler chain (own seed), and pushes a
   :class:`TokenEvent` / :class:`FinishEvent` to the job's event queue once the step is over (and counted).

Every step is timed (:mod:`.step_profile`): the decode call against the engine's own work around it, in the
``llmfw_step_*_seconds`` histograms, :attr:`Engine.step_profile` and, when the engine goes idle, one INFO line of
the busy period (``llmfw serve -v``).

Each slot may hold ``n_ctx / parallel`` tokens (llama-server's rule); a job that cannot fit is refused at
submit time with a :class:`RequestError` whose message names the context.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..core.runtime.batch import Batch
from ..core.errors import EngineBusy, EngineStopped, LLMFWError, RequestError
from ..core.generation.generate import FINISH_REASONS, TextStream, accept_prompt_tokens, common_prefix_length, \
    forget_cache, reuse_cached_prefix, stop_reason
from .jobs import Cancel as Cancel, ErrorEvent as ErrorEvent, Event as Event, FinishEvent, Job, TokenEvent
from .chat_options import ChatOptions
from .metrics import EngineMetrics
from .step_profile import StepProfile, StepTotals

if TYPE_CHECKING:
    from ..core.runtime.model import Model

log = logging.getLogger(__name__)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted: np.ndarray = logits.astype(np.float64) - float(np.max(logits))
    result: np.ndarray = shifted - np.log(np.sum(np.exp(shifted)))
    return result


class Engine:
    """``Engine(model, parallel=4)``: serve ``completion`` / ``chat_completion`` calls from any thread.

    ``n_ctx``: total KV cache size (0 = the model's default); each slot gets ``n_ctx / parallel``.
    ``n_batch``: most tokens one decode step holds. ``max_queue``: most jobs waiting for a slot (more are
    refused with :class:`EngineBusy`). ``alias``: the model name reported in responses. ``chat_template``:
    a Jinja chat template overriding the model's (e.g. one that knows tools). ``chat_options``: template
    variables, reasoning format and budget for every chat. ``metrics``: where the engine counts (a model's share
    of a server's metrics; default: a registry of its own).
    """

    def __init__(self, model: Model, parallel: int = 4, *, n_ctx: int = 0, n_batch: int = 512,
                 n_threads: int | None = None, max_queue: int = 64, alias: str | None = None,
                 chat_template: str | None = None, chat_options: ChatOptions | None = None,
                 metrics: EngineMetrics | None = None):
        if parallel < 1:
            raise RequestError(f"parallel must be >= 1, got {parallel}", "parallel")
        self.model = model
        self.alias = alias or _model_name(model)
        #: Jinja source chats are rendered with (None: the model's own, else ChatML)
        self.chat_template = chat_template
        #: reasoning format and budget, template variables (llmfw.serving.chat_options)
        self.chat_options = chat_options or ChatOptions()
        self.parallel = parallel
        self.max_queue = max_queue
        self._stopping = threading.Event()
        self.ctx = model.new_context(n_ctx=n_ctx, n_seq_max=parallel, n_batch=max(n_batch, parallel),
                                     n_ubatch=max(n_batch, parallel), n_threads=n_threads,
                                     abort_callback=self._stopping.is_set)
        self.n_ctx_slot = self.ctx.n_ctx // parallel
        self.n_batch = self.ctx.n_batch
        #: the longest token piece in bytes: text longer than n_ctx_slot times this cannot fit a slot
        self.max_piece_bytes = max(1, max(len(p) for p in model.vocab.all_pieces(special=True)))
        self._slots: list[Job | None] = [None] * parallel
        self._waiting: deque[Job] = deque()
        #: work that must run where the model's backends are used, between two decode steps (embeddings)
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._cond = threading.Condition()
        self.metrics = metrics or EngineMetrics()
        self.metrics.attach(lambda: sum(j is not None for j in self._slots), lambda: len(self._waiting))
        self.profile = StepProfile(self.metrics.step_decode, self.metrics.step_engine)
        #: the events of the step running now, handed to the jobs' queues when it is over (:meth:`_deliver`)
        self._outbox: list[tuple[Job, Event]] = []
        self._thread = threading.Thread(target=self._run, name="llmfw-engine", daemon=True)
        self._thread.start()

    # -- the Python API (see api.py for the OpenAI-shaped front) -------------------------------------------------
    def completion(self, /, **params: Any) -> Any:
        """OpenAI ``/v1/completions``: a response dict, or an iterator of chunk dicts with ``stream=True``."""
        from .api import run_completion

        return run_completion(self, params)

    def chat_completion(self, /, **params: Any) -> Any:
        """OpenAI ``/v1/chat/completions``: a response dict, or an iterator of chunk dicts with ``stream=True``."""
        from .api import run_chat_completion

        return run_chat_completion(self, params)

    def embeddings(self, /, **params: Any) -> dict[str, Any]:
        """OpenAI ``/v1/embeddings``: ``input`` a string, strings, token ids or lists of them."""
        from .api import run_embeddings

        return run_embeddings(self, params)

    def call_in_engine(self, func: Callable[[], Any]) -> Any:
        """Run ``func`` on the engine thread between two decode steps and return its result: the thread owns the
        model's backends, so work beside generation (an embeddings context) never runs concurrently with a step."""
        future: Future[Any] = Future()
        with self._cond:
            if self._stopping.is_set() or not self._thread.is_alive():
                raise EngineStopped("the engine is shut down")
            self._calls.append((func, future))
            self._cond.notify()
        return future.result()

    # -- submitting ------------------------------------------------------------------------------------------
    def check_fits(self, n_prompt: int, max_tokens: int | None, param: str = "prompt") -> int:
        """The job's token limit: ``max_tokens`` capped at the room the prompt leaves in a slot (llama-server's
        rule: a reply that reaches it finishes with ``length``); a :class:`RequestError` naming the context only
        when the prompt itself leaves no room."""
        if n_prompt == 0:
            raise RequestError("the prompt is empty: nothing to generate from", param)
        room = self.n_ctx_slot - n_prompt
        if room < 1:
            raise RequestError(f"the prompt ({n_prompt} tokens) does not fit the context of a slot "
                               f"({self.n_ctx_slot} tokens = n_ctx {self.ctx.n_ctx} / parallel {self.parallel}) "
                               "with room for a reply; shorten the prompt", param)
        return room if max_tokens is None else min(max_tokens, room)

    def submit(self, jobs: list[Job]) -> None:
        """Queue the jobs of one request together (all or none: :class:`EngineBusy` when the queue is full)."""
        with self._cond:
            if self._stopping.is_set() or not self._thread.is_alive():
                raise EngineStopped("the engine is shut down")
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise EngineBusy(f"the server is busy: {len(self._waiting)} requests are waiting "
                                 f"(--max-queue {self.max_queue}); retry later")
            self._waiting.extend(jobs)
            self._cond.notify()

    def wake(self) -> None:
        """Make the engine look at its jobs now (a consumer cancelled one)."""
        with self._cond:
            self._cond.notify()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def step_profile(self) -> StepTotals:
        """The steps since the engine started: their decode calls' time and the engine's own work (a copy)."""
        return self.profile.snapshot()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the engine thread: every unfinished job ends with an error event."""
        with self._cond:
            self._stopping.set()
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.metrics.detach()  # the gauges no longer read (nor keep alive) this engine

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the engine thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        message = "the server is shutting down"
        try:
            while self._wait_for_work():
                self._run_calls()
                self._step()
                self._deliver()
        except Exception as exc:  # report to every waiting client, then stop
            log.exception("the serving engine failed")
            message = f"the engine failed: {type(exc).__name__}: {exc}"
        finally:
            self._stopping.set()
            self._fail_all(message)

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping.is_set() and not self._waiting and not self._calls and not any(self._slots):
                self._report_busy_period()
                self._cond.wait()
            return not self._stopping.is_set()

    def _report_busy_period(self) -> None:
        period = self.profile.end_period()
        if period is not None:
            log.info("%s: %s", self.alias, period.summary())

    def _run_calls(self) -> None:
        with self._cond:
            calls = list(self._calls)
            self._calls.clear()
        for func, future in calls:
            try:
                future.set_result(func())
            except Exception as exc:  # noqa: BLE001 - the caller's error, raised in the caller's thread
                future.set_exception(exc)

    def _deliver(self) -> None:
        """Hand the step's events to their jobs' queues — after the step is counted, so a client that saw its
        stream end sees that step in the metrics too. The time it takes counts with the next step."""
        if not self._outbox:
            return
        t_start = time.perf_counter()
        outbox, self._outbox = self._outbox, []
        for job, event in outbox:
            job.events.put(event)
        self.profile.carry(time.perf_counter() - t_start)

    def _fail_all(self, message: str) -> None:
        self._deliver()
        with self._cond:
            jobs = [j for j in self._slots if j is not None] + list(self._waiting)
            calls = list(self._calls)
            self._calls.clear()
            self._waiting.clear()
            self._slots = [None] * self.parallel
        for _, future in calls:
            future.set_exception(EngineStopped(message))
        for job in jobs:
            job.events.put(ErrorEvent(job.index, message, stopped=True))

    def _step(self) -> None:
        t_start = time.perf_counter()
        self._drop_cancelled()
        self._admit()
        plan = self._plan_batch()
        if not plan:
            return
        batch = _batch_of(plan)
        t_decode = time.perf_counter()
        code = self.ctx.decode(batch)
        t_decoded = time.perf_counter()
        if code != 0:
            self._fail_batch(plan, code)
            return
        step = StepTotals(steps=1, schedule_s=t_decode - t_start, decode_s=t_decoded - t_decode)
        row = 0
        for job, chunk in plan:
            finished_prompt = len(chunk) == len(job.pending)
            job.n_past += len(chunk)
            job.pending = job.pending[len(chunk):]
            row += len(chunk)
            if finished_prompt:
                self._sample(job, row - 1, step)
        step.output_s = time.perf_counter() - t_decoded - step.sample_s
        self.profile.record(step)

    def _drop_cancelled(self) -> None:
        with self._cond:
            for seq, job in enumerate(self._slots):
                if job is not None and job.cancel.is_set:
                    self._slots[seq] = None
                    job.events.put(ErrorEvent(job.index, "cancelled", stopped=False))
            kept = [j for j in self._waiting if not j.cancel.is_set]
            if len(kept) != len(self._waiting):
                self._waiting = deque(kept)

    def _admit(self) -> None:
        """Move waiting jobs into idle slots, each into the slot with the longest cached common prefix."""
        while True:
            with self._cond:
                idle = [s for s, j in enumerate(self._slots) if j is None]
                if not idle or not self._waiting:
                    return
                job = self._waiting.popleft()
                seq = max(idle, key=lambda s: common_prefix_length(self.ctx.seq_tokens[s], job.tokens))
                self._slots[seq] = job
            self._start(job, seq)

    def _start(self, job: Job, seq: int) -> None:
        job.seq = seq
        n_keep = reuse_cached_prefix(self.ctx, job.tokens, seq)
        job.n_past, job.pending = n_keep, job.tokens[n_keep:]
        job.text = TextStream(self.model.vocab, job.stops, special=job.special)
        accept_prompt_tokens(job.chain, job.tokens)
        self.metrics.prompt_tokens.inc(len(job.tokens))
        if job.max_tokens == 0:
            self._finish(job, "length")

    def _plan_batch(self) -> list[tuple[Job, list[int]]]:
        """(job, tokens to decode) for this step: every generating job's token first, then prompt chunks."""
        active = [j for j in self._slots if j is not None]
        plan = [(j, list(j.pending)) for j in active if j.n_generated > 0]
        budget = self.n_batch - len(plan)
        for job in active:
            if job.n_generated == 0 and job.pending and budget > 0:
                chunk = job.pending[:budget]
                plan.append((job, chunk))
                budget -= len(chunk)
        return plan

    def _fail_batch(self, plan: list[tuple[Job, list[int]]], code: int) -> None:
        reason = self.ctx.last_error or f"decode returned {code}"
        stopped = self._stopping.is_set()
        for job, _ in plan:
            forget_cache(self.ctx, job.seq)
            self._release(job)
            job.events.put(ErrorEvent(job.index, f"decoding failed: {reason}", stopped=stopped))

    # -- sampling ------------------------------------------------------------------------------------------------
    def _sample(self, job: Job, row: int, step: StepTotals) -> None:
        """Sample the job's next token from output row ``row`` and report it (``step``: counts its time)."""
        t_start = time.perf_counter()
        logits = self.ctx.get_logits_ith(row)
        try:
            token = job.chain.sample(logits)
        except LLMFWError as exc:
            self._release(job)
            self._outbox.append((job, ErrorEvent(job.index, f"sampling failed: {exc}", stopped=False)))
            return
        finally:
            step.sample_s += time.perf_counter() - t_start
        step.tokens += 1
        if job.n_generated == 0:
            self.metrics.time_to_first_token.observe(time.perf_counter() - job.t_submit)
        job.n_generated += 1
        self.metrics.generated_tokens.inc()
        if self.model.vocab.is_eog(token):
            self._finish(job, "stop")
            return
        assert job.text is not None
        event = TokenEvent(job.index, job.text.feed(token), token)
        if job.n_logprobs is not None:
            t_logprobs = time.perf_counter()
            event.logprob, event.top = _token_logprobs(logits, token, job.n_logprobs)
            step.sample_s += time.perf_counter() - t_logprobs
        self._outbox.append((job, event))
        reason = stop_reason(job.text, job.chain, job.n_generated, job.max_tokens, job.n_past, self.n_ctx_slot)
        if reason:
            self._finish(job, FINISH_REASONS[reason])
        else:
            job.pending = [token]

    def _finish(self, job: Job, reason: str) -> None:
        assert job.text is not None
        rest = "" if job.text.stopped else job.text.flush()
        if rest:
            self._outbox.append((job, TokenEvent(job.index, rest)))
        self._release(job)
        self._outbox.append((job, FinishEvent(job.index, reason, len(job.tokens), job.n_generated,
                                              job.text.stopped_by)))

    def _release(self, job: Job) -> None:
        with self._cond:
            if 0 <= job.seq < self.parallel and self._slots[job.seq] is job:
                self._slots[job.seq] = None


def _batch_of(plan: list[tuple[Job, list[int]]]) -> Batch:
    """The batch of a step's plan: each job's tokens at its next positions, logits for a job's last token once its
    pending tokens are all in (a prompt's last chunk, a generating job's token)."""
    tokens = [t for _, chunk in plan for t in chunk]
    pos = [job.n_past + i for job, chunk in plan for i in range(len(chunk))]
    seqs = [job.seq for job, chunk in plan for _ in chunk]
    outputs = [i == len(chunk) - 1 and len(chunk) == len(job.pending)
               for job, chunk in plan for i in range(len(chunk))]
    return Batch(tokens, pos=pos, seq_id=seqs, logits=outputs)


def _token_logprobs(logits: np.ndarray, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of ``token`` and its ``n_top`` most likely alternatives."""
    lp = log_softmax(logits)
    top: list[tuple[int, float]] = []
    if n_top > 0:
        best = np.argpartition(-lp, n_top - 1)[:n_top]
        best = best[np.argsort(-lp[best], kind="stable")]
        top = [(int(t), _finite(float(lp[t]))) for t in best]
    return _finite(float(lp[token])), top


def _finite(value: float, floor: float = -9999.0) -> float:
    """JSON has no -inf: a log-probability of a banned token is reported as ``floor``."""
    return value if np.isfinite(value) else floor


def _model_name(model: Any) -> str:
    path = getattr(model, "path", None) or getattr(getattr(model, "loader", None), "path", None)
    if path:
        from pathlib import Path

        return Path(str(path)).name
    return "llmfw"
