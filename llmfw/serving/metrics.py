"""Prometheus metrics of the engines, in a registry of their own (no process-global state).

Names are pinned (docs/design.md, "Public API"): ``llmfw_requests_running``, ``llmfw_requests_waiting`` (gauges),
``llmfw_prompt_tokens_total``, ``llmfw_generated_tokens_total`` (counters), ``llmfw_time_to_first_token_seconds``
(histogram). Requests are counted per choice (a request with ``n = 2`` runs two sequences). Each engine step is
observed into two histograms (:mod:`.step_profile`): ``llmfw_step_decode_seconds``, the backend's decode call,
and ``llmfw_step_engine_seconds``, the engine's own work around it; their ``_count`` is the number of steps and
``engine_sum / (engine_sum + decode_sum)`` the engine's share of a step.

One engine (``llmfw serve -m MODEL``) has its own :class:`MetricFamilies` without labels. Several models behind
one server share one :class:`MetricFamilies` whose samples carry a ``model`` label; each model's
:class:`EngineMetrics` outlives its engine, so the counters keep counting across an unload and a reload.
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: time-to-first-token buckets, seconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: step-part buckets, seconds: from a fraction of a millisecond (a small model's decode) to a long prompt chunk
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: the label that names the model when one server holds several
MODEL_LABEL = "model"


def _idle() -> float:
    return 0.0


class MetricFamilies:
    """The metrics in one registry; ``by_model``: every sample carries a ``model`` label."""

    def __init__(self, by_model: bool = False):
        self.by_model = by_model
        self.registry = CollectorRegistry(auto_describe=True)
        labels = (MODEL_LABEL,) if by_model else ()
        self.running = Gauge("llmfw_requests_running", "Sequences being decoded now", labels, registry=self.registry)
        self.waiting = Gauge("llmfw_requests_waiting", "Sequences waiting for a free slot", labels,
                             registry=self.registry)
        # prometheus_client appends _total to counter names
        self.prompt_tokens = Counter("llmfw_prompt_tokens", "Prompt tokens of admitted requests", labels,
                                     registry=self.registry)
        self.generated_tokens = Counter("llmfw_generated_tokens", "Tokens sampled", labels, registry=self.registry)
        self.time_to_first_token = Histogram("llmfw_time_to_first_token_seconds",
                                             "Seconds from submission to the first sampled token", labels,
                                             buckets=TTFT_BUCKETS, registry=self.registry)
        self.step_decode = Histogram("llmfw_step_decode_seconds",
                                     "Seconds of each engine step's decode call (the backend's compute)", labels,
                                     buckets=STEP_BUCKETS, registry=self.registry)
        self.step_engine = Histogram("llmfw_step_engine_seconds",
                                     "Seconds of each engine step outside its decode call (scheduling, batch "
                                     "building, sampling, detokenization, stop checks, events, metrics)", labels,
                                     buckets=STEP_BUCKETS, registry=self.registry)

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)


class EngineMetrics:
    """One model's share of :class:`MetricFamilies` (the whole of them when they have no label).

    The gauges read the engine's slots through functions :meth:`attach` sets; :meth:`detach` makes them read 0
    again, so the metrics never keep a closed engine (and its model) alive."""

    def __init__(self, families: MetricFamilies | None = None, model: str = ""):
        self.families = families or MetricFamilies()

        def share(metric: Any) -> Any:
            return metric.labels(**{MODEL_LABEL: model}) if self.families.by_model else metric

        self._running, self._waiting = share(self.families.running), share(self.families.waiting)
        self.prompt_tokens = share(self.families.prompt_tokens)
        self.generated_tokens = share(self.families.generated_tokens)
        self.time_to_first_token = share(self.families.time_to_first_token)
        self.step_decode = share(self.families.step_decode)
        self.step_engine = share(self.families.step_engine)
        self.detach()

    @property
    def registry(self) -> CollectorRegistry:
        return self.families.registry

    def attach(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        self._running.set_function(running)
        self._waiting.set_function(waiting)

    def detach(self) -> None:
        self.attach(_idle, _idle)

    def exposition(self) -> bytes:
        """The Prometheus text format (of every model sharing the families)."""
        return self.families.exposition()
