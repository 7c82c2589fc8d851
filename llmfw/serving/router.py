"""Several models behind one server (llama-server's router mode): each request is routed by its ``model``.

A :class:`ModelRouter` holds one :class:`_ModelSlot` per served model: its state (``unloaded``, ``loading``,
``loaded``, ``unloading``), its engine while loaded, the requests using it (``in_flight``) and when it was last
used. :meth:`ModelRouter.acquire` hands a request a :class:`Lease` on the model's engine, loading the model
first when it is not loaded — concurrent first requests for one model wait for the one load. At most
``max_loaded`` models are loaded (or loading) at once: a load that finds no room marks the least recently used
loaded model (idle ones first) for unloading, which happens once its in-flight requests finish (never
mid-request: requests arriving for it meanwhile wait, then load it again). Loads and unloads are logged, a load
with its progress.
"""
from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from ..core.errors import ConfigError, EngineBusy, EngineStopped, RequestError, UnknownModel
from .engine import Engine
from .metrics import EngineMetrics, MetricFamilies

log = logging.getLogger(__name__)

ModelState = Literal["unloaded", "loading", "loaded", "unloading"]
#: most models loaded at once unless told (llama-server's --models-max default); 0 = no limit
DEFAULT_MODELS_MAX = 4
#: load progress is logged at each of these fractions
PROGRESS_STEPS = (0.25, 0.5, 0.75)


@dataclass(frozen=True)
class ServedModel:
    """A model the server offers: its ``name`` (the id in ``/v1/models``), its file and other names for it."""

    name: str
    path: Path
    aliases: tuple[str, ...] = ()


class _ModelSlot:
    """One served model's state in the router (changed only under the router's lock)."""

    def __init__(self, model: ServedModel, metrics: EngineMetrics):
        self.model = model
        self.metrics = metrics
        self.state: ModelState = "unloaded"
        self.engine: Engine | None = None
        self.in_flight = 0
        self.last_used = 0
        #: set on a loaded model chosen for unloading: it takes no new request and unloads once idle
        self.draining = False
        #: loads started, and (attempt, message) of the last one that failed
        self.attempts = 0
        self.failure: tuple[int, str] | None = None


class Lease:
    """A request's hold on a loaded model's engine; :meth:`release` (idempotent) lets the model be unloaded."""

    def __init__(self, router: "ModelRouter", slot: _ModelSlot, engine: Engine):
        self.engine = engine
        self._router, self._slot = router, slot
        self._released = False

    def release(self) -> None:
        self._router._release(self)


class LeasedStream:
    """A streaming response's chunks that hold the model's lease until the stream ends or is closed."""

    def __init__(self, chunks: Any, lease: Lease):
        self._chunks, self._lease = chunks, lease

    def __iter__(self) -> "LeasedStream":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._chunks)
        except StopIteration:
            self._lease.release()
            raise

    def close(self) -> None:
        try:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()
        finally:
            self._lease.release()

    def __del__(self) -> None:  # a response dropped before its body was sent: still let the model go
        self._lease.release()


class ModelRouter:
    """The served models and their engines. ``build(model, metrics)`` loads a model and returns its engine
    (called without the lock, in the requesting thread); ``max_loaded`` (0: no limit) bounds the models loaded
    at once; ``max_waiting``: most requests waiting for their model to load or for room (more are refused with
    :class:`EngineBusy`: each waits in a worker thread, which running streams need too); ``report`` hears each
    load, its progress and each unload (default: this module's logger)."""

    def __init__(self, models: Sequence[ServedModel], build: Callable[[ServedModel, EngineMetrics], Engine], *,
                 max_loaded: int = DEFAULT_MODELS_MAX, max_waiting: int = 64,
                 report: Callable[[str], None] | None = None):
        if not models:
            raise ConfigError("no model to serve")
        if max_loaded < 0:
            raise ConfigError(f"--models-max must be >= 0 (0 = no limit), got {max_loaded}")
        self.metric_families = MetricFamilies(by_model=True)
        self._slots = {m.name: _ModelSlot(m, EngineMetrics(self.metric_families, m.name)) for m in models}
        self._names = _name_table(models)
        self._build = build
        self.max_loaded = max_loaded
        self.max_waiting = max_waiting
        self._n_waiting = 0
        self._report = report or log.info
        self._cond = threading.Condition()
        self._ticks = itertools.count(1)
        self._closed = False

    # -- looking up ------------------------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def resolve(self, name: Any) -> ServedModel:
        """The served model a request's ``model`` names (its name or an alias): 400 when it names none, 404
        (:class:`UnknownModel`) when it names one the server does not serve; both list the known ones."""
        known = ", ".join(self._slots)
        if name is None or name == "":
            raise RequestError(f"the request names no model; this server serves several: {known}", "model")
        model = self._names.get(name) if isinstance(name, str) else None
        if model is None:
            raise UnknownModel(f"model {name!r} not found; this server serves: {known}")
        return model

    def listing(self) -> list[tuple[ServedModel, ModelState, Engine | None]]:
        """Every served model with its state and, when loaded, its engine."""
        with self._cond:
            return [(s.model, s.state, s.engine) for s in self._slots.values()]

    # -- leasing ---------------------------------------------------------------------------------------------------
    def acquire(self, name: Any) -> Lease:
        """A lease on the engine of the model ``name`` names, loading it first if needed (blocks meanwhile)."""
        slot = self._slots[self.resolve(name).name]
        seen_attempt: int | None = None  # the load this request waits for
        while True:
            victim: _ModelSlot | None = None
            with self._cond:
                self._check_open()
                if slot.failure is not None and seen_attempt is not None and slot.failure[0] == seen_attempt:
                    raise EngineStopped(f"model {slot.model.name} failed to load: {slot.failure[1]}")
                if slot.state == "loaded" and not slot.draining:
                    assert slot.engine is not None
                    slot.in_flight += 1
                    slot.last_used = next(self._ticks)
                    return Lease(self, slot, slot.engine)
                if slot.state == "unloaded" and self._has_room():
                    slot.state = "loading"
                    slot.attempts += 1
                    break
                if slot.state == "loading":
                    seen_attempt = slot.attempts
                elif slot.state == "unloaded":
                    victim = self._choose_victim()
                if victim is None:
                    self._wait()
            if victim is not None:
                self._finish_unload(victim)
        return self._load(slot)

    def _load(self, slot: _ModelSlot) -> Lease:
        model = slot.model
        self._report(f"llmfw: loading model {model.name} ({model.path.name})")
        start = time.perf_counter()
        try:
            engine = self._build(model, slot.metrics)
        except BaseException as exc:
            message = str(exc) or type(exc).__name__
            with self._cond:
                slot.state, slot.failure = "unloaded", (slot.attempts, message)
                self._cond.notify_all()
            self._report(f"llmfw: model {model.name} failed to load: {message}")
            if isinstance(exc, Exception):
                raise EngineStopped(f"model {model.name} failed to load: {message}") from exc
            raise
        with self._cond:
            closed = self._closed
            if not closed:
                slot.engine, slot.state, slot.failure = engine, "loaded", None
                slot.in_flight += 1
                slot.last_used = next(self._ticks)
            self._cond.notify_all()
        if closed:
            engine.close()
            engine.model.close()
            raise EngineStopped("the server is shutting down")
        self._report(f"llmfw: model {model.name} loaded in {time.perf_counter() - start:.1f}s "
                     f"(parallel {engine.parallel}, {engine.n_ctx_slot} tokens per slot)")
        return Lease(self, slot, engine)

    def _release(self, lease: Lease) -> None:
        slot = lease._slot
        with self._cond:
            if lease._released:
                return
            lease._released = True
            slot.in_flight -= 1
            unload = slot.draining and slot.in_flight == 0 and slot.state == "loaded"
            if unload:
                slot.state = "unloading"
            self._cond.notify_all()
        if unload:  # not in the caller's thread: that may be the event loop closing a stream
            threading.Thread(target=self._finish_unload, args=(slot,), name="llmfw-unload", daemon=True).start()

    def _wait(self) -> None:
        """Under the lock: wait for a change of any model's state, unless too many requests wait already."""
        if self._n_waiting >= self.max_waiting:
            raise EngineBusy(f"the server is busy: {self._n_waiting} requests are waiting for their model to load "
                             f"(--max-queue {self.max_waiting}); retry later")
        self._n_waiting += 1
        try:
            self._cond.wait()
        finally:
            self._n_waiting -= 1

    # -- making room -------------------------------------------------------------------------------------------------
    def _has_room(self) -> bool:
        occupied = sum(s.state != "unloaded" for s in self._slots.values())
        return self.max_loaded == 0 or occupied < self.max_loaded

    def _choose_victim(self) -> _ModelSlot | None:
        """Under the lock: mark the least recently used loaded model (an idle one if any) for unloading and return
        it when it can go now; None when one is already on its way out or the victim still has requests."""
        if any(s.draining or s.state == "unloading" for s in self._slots.values()):
            return None  # one at a time: its unloading makes the room
        loaded = [s for s in self._slots.values() if s.state == "loaded"]
        if not loaded:
            return None  # every slot is loading: wait for one to finish
        victim = min(loaded, key=lambda s: (s.in_flight > 0, s.last_used))
        victim.draining = True
        if victim.in_flight:
            self._report(f"llmfw: model {victim.model.name} will be unloaded once its {victim.in_flight} "
                         f"request(s) finish (--models-max {self.max_loaded})")
            return None
        victim.state = "unloading"
        return victim

    def _finish_unload(self, slot: _ModelSlot) -> None:
        engine = slot.engine
        try:
            if engine is not None:
                engine.close()
                engine.model.close()
        finally:
            with self._cond:
                slot.engine, slot.state, slot.draining = None, "unloaded", False
                self._cond.notify_all()
            del engine
            gc.collect()  # the model's arrays go now, before the next model loads into their room
        self._report(f"llmfw: unloaded model {slot.model.name} (least recently used; --models-max "
                     f"{self.max_loaded})")

    # -- stopping ---------------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineStopped("the server is shutting down")

    def close(self, timeout: float = 5.0) -> None:
        """Stop every loaded engine (their requests end with an error) and refuse new requests."""
        with self._cond:
            self._closed = True
            engines = [s.engine for s in self._slots.values() if s.engine is not None]
            self._cond.notify_all()
        for engine in engines:
            engine.close(timeout)


def load_progress(name: str, report: Callable[[str], None] | None = None) -> Callable[[float], bool]:
    """A load-progress callback that reports ``loading NAME: 25%`` at each of :data:`PROGRESS_STEPS`."""
    steps = list(PROGRESS_STEPS)
    say = report or log.info

    def progress(fraction: float) -> bool:
        while steps and fraction >= steps[0]:
            say(f"llmfw: loading model {name}: {steps.pop(0):.0%}")
        return True
    return progress


def _name_table(models: Sequence[ServedModel]) -> dict[str, ServedModel]:
    """Every name and alias -> its model; a name given to two models is an error naming both files."""
    table: dict[str, ServedModel] = {}
    for model in models:
        for name in dict.fromkeys((model.name, *model.aliases)):
            other = table.get(name)
            if other is not None:
                raise ConfigError(f"two models are named {name!r} ({other.path} and {model.path}): give them "
                                  "different names or aliases (a `models:` list in the YAML file)")
            table[name] = model
    return table
