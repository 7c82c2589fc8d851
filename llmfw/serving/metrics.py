"""Prometheus metrics of one engine, in a registry of its own (no process-global state).

Names are pinned (docs/design.md, "Public API"): ``llmfw_requests_running``, ``llmfw_requests_waiting`` (gauges),
``llmfw_prompt_tokens_total``, ``llmfw_generated_tokens_total`` (counters), ``llmfw_time_to_first_token_seconds``
(histogram). Requests are counted per choice (a request with ``n = 2`` runs two sequences).
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: time-to-first-token buckets, seconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineMetrics:
    def __init__(self, running: Callable[[], float], waiting: Callable[[], float]):
        self.registry = CollectorRegistry(auto_describe=True)
        Gauge("llmfw_requests_running", "Sequences being decoded now", registry=self.registry) \
            .set_function(running)
        Gauge("llmfw_requests_waiting", "Sequences waiting for a free slot", registry=self.registry) \
            .set_function(waiting)
        # prometheus_client appends _total to counter names
        self.prompt_tokens = Counter("llmfw_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=self.registry)
        self.generated_tokens = Counter("llmfw_generated_tokens", "Tokens sampled", registry=self.registry)
        self.time_to_first_token = Histogram("llmfw_time_to_first_token_seconds",
                                             "Seconds from submission to the first sampled token",
                                             buckets=TTFT_BUCKETS, registry=self.registry)

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)
