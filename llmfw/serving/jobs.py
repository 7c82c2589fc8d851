"""What the engine and its fronts exchange: a :class:`Job` per choice of a request, the events it reports, and
what a front may ask of the engine (:class:`ServedEngine`, which :class:`~llmfw.serving.engine.Engine` fills in).

The OpenAI front (:mod:`.api`) builds jobs and reads their events; the engine runs them. Neither imports the
other's module for it, so the engine's Python methods can delegate to the front without an import cycle.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Union

from ..core.generation.generate import TextStream
from ..core.generation.sampling import SamplerChain

if TYPE_CHECKING:
    from ..core.runtime.model import Model
    from .chat_options import ChatOptions


# -- what a job reports -------------------------------------------------------------------------------------
@dataclass
class TokenEvent:
    """Text produced by one sampled token (``token`` None: text flushed at the end)."""

    index: int
    text: str
    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class FinishEvent:
    index: int
    reason: str  # "stop" | "length"
    n_prompt: int
    n_generated: int
    stop_sequence: str | None = None  # the stop string that ended the choice


@dataclass
class ErrorEvent:
    index: int
    message: str
    stopped: bool  # True when the engine shut down (the server answers 503), False for a failed decode


Event = Union[TokenEvent, FinishEvent, ErrorEvent]


class Cancel:
    """Shared by the jobs of one request: the consumer sets it when the client goes away."""

    def __init__(self) -> None:
        self._flag = threading.Event()

    def set(self) -> None:
        self._flag.set()

    @property
    def is_set(self) -> bool:
        return self._flag.is_set()


@dataclass
class Job:
    """One choice of a request: its prompt tokens, sampler chain and limits, and its progress."""

    index: int
    tokens: list[int]
    chain: SamplerChain
    max_tokens: int
    stops: list[str]
    n_logprobs: int | None  # None: no logprobs; k: the chosen token's logprob plus k alternatives
    events: "queue.Queue[Event]"
    cancel: Cancel
    #: render control tokens in the text (a chat whose tool-call or thinking markers are special tokens)
    special: bool = False
    # progress, touched only by the engine thread
    seq: int = -1
    pending: list[int] = field(default_factory=list)  # tokens still to decode (prompt rest or the last sample)
    n_past: int = 0
    n_generated: int = 0
    text: TextStream | None = None
    t_submit: float = field(default_factory=time.perf_counter)


class ServedEngine(Protocol):
    """What a front reads of the engine that runs its jobs."""

    model: Model
    alias: str
    chat_template: str | None
    chat_options: ChatOptions
    n_ctx_slot: int
    max_piece_bytes: int

    @property
    def running(self) -> bool: ...

    def check_fits(self, n_prompt: int, max_tokens: int | None, param: str = "prompt") -> int: ...

    def submit(self, jobs: list[Job]) -> None: ...

    def wake(self) -> None: ...

    def call_in_engine(self, func: Callable[[], Any]) -> Any: ...
