"""Where an engine step's time goes: the backend's decode call versus the engine's own Python work.

Each :meth:`Engine._step <llmfw.serving.engine.Engine._step>` is one decode call plus the work around it:
``schedule`` (dropping cancelled jobs, admitting waiting ones, building the batch), ``sample`` (each sampled job's
sampler chain and logprobs) and ``output`` (detokenizing, stop checks, events to the clients, metrics). A
:class:`StepProfile` adds them up from the engine's start and for the current busy period (from the first step
after the engine was idle), feeds the ``llmfw_step_decode_seconds`` / ``llmfw_step_engine_seconds`` histograms and
says the engine's share of a step in one line (the ``-v`` log when a busy period ends). A step's events reach the
clients after the step is counted; the time to hand them out counts with the next step's ``output``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

#: the parts of a step outside the decode call, in step order
ENGINE_PARTS = ("schedule", "sample", "output")


@dataclass
class StepTotals:
    """Seconds and counts summed over steps."""

    steps: int = 0
    tokens: int = 0  # tokens sampled
    decode_s: float = 0.0
    schedule_s: float = 0.0
    sample_s: float = 0.0
    output_s: float = 0.0

    @property
    def engine_s(self) -> float:
        """The engine's own work: everything of the steps but their decode calls."""
        return self.schedule_s + self.sample_s + self.output_s

    @property
    def step_s(self) -> float:
        return self.decode_s + self.engine_s

    @property
    def engine_share(self) -> float:
        """The engine's own work as a fraction of the steps' time (0 before any step)."""
        return self.engine_s / self.step_s if self.step_s > 0 else 0.0

    def add(self, other: "StepTotals") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def summary(self) -> str:
        """``128 steps, 128 tokens: 5.12 ms/step = decode 4.80 + engine 0.32 ms (6.2 %: schedule 0.05, ...)``."""
        n = max(self.steps, 1)
        parts = ", ".join(f"{name} {getattr(self, name + '_s') / n * 1e3:.3f}" for name in ENGINE_PARTS)
        return (f"{self.steps} steps, {self.tokens} tokens: {self.step_s / n * 1e3:.3f} ms/step = decode "
                f"{self.decode_s / n * 1e3:.3f} + engine {self.engine_s / n * 1e3:.3f} ms "
                f"({100 * self.engine_share:.1f} % of a step: {parts} ms)")


class StepProfile:
    """The engine's step timings: ``total`` since the engine started, ``period`` since it last became busy.

    Touched by the engine thread only (readers get copies through :meth:`snapshot`); ``decode_histogram`` and
    ``engine_histogram`` are the Prometheus histograms each step is observed into."""

    def __init__(self, decode_histogram: Any, engine_histogram: Any):
        self._decode_histogram, self._engine_histogram = decode_histogram, engine_histogram
        self.total = StepTotals()
        self.period = StepTotals()
        self._carried_s = 0.0

    def carry(self, seconds: float) -> None:
        """Engine work done after a step was counted (handing out its events): it counts with the next step."""
        self._carried_s += seconds

    def record(self, step: StepTotals) -> None:
        """Count one step (a :class:`StepTotals` of one step)."""
        step.output_s += self._carried_s
        self._carried_s = 0.0
        self.total.add(step)
        self.period.add(step)
        self._decode_histogram.observe(step.decode_s)
        self._engine_histogram.observe(step.engine_s)

    def end_period(self) -> StepTotals | None:
        """The busy period that just ended (None when it had no step); the next step starts a new one."""
        period, self.period = self.period, StepTotals()
        return period if period.steps else None

    def snapshot(self) -> StepTotals:
        """A copy of the totals since the engine started."""
        copy = StepTotals()
        copy.add(self.total)
        return copy
