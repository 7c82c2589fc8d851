"""An example llmfw plugin: the top-a sampler, usable by name ("top_a") in sampler chains, YAML pipelines and
``llmfw run --sampler-seq``.

Top-a keeps the tokens whose probability is at least ``a * p_max ** 2``: a confident distribution (large
``p_max``) is cut hard, a flat one hardly at all.
"""
from __future__ import annotations

import numpy as np

from llmfw import hookimpl
from llmfw.core.generation.sampling import Candidates, Sampler


class TopA(Sampler):
    """Keep tokens with ``p >= a * p_max**2`` (at least ``min_keep``); ``a <= 0`` does nothing.

    Configure it in a chain through ``SamplerParams.options``: ``{"top_a": {"a": 0.2}}``.
    """

    name = "top_a"

    def __init__(self, a: float = 0.2, min_keep: int = 1):
        if not np.isfinite(a) or a < 0:
            from llmfw.core.errors import SamplerError

            raise SamplerError(f"top_a: 'a' must be a finite number >= 0, got {a!r}")
        self.a, self.min_keep = float(a), int(min_keep)

    def apply(self, cur: Candidates) -> None:
        if self.a <= 0 or len(cur) <= 1:
            return
        cur.softmax(sort=True)
        threshold = self.a * float(cur.probs[0]) ** 2
        n_keep = max(int(np.count_nonzero(cur.probs >= threshold)), self.min_keep, 1)
        cur.truncate(min(n_keep, len(cur)))


@hookimpl
def register_samplers(register):
    register("top_a", TopA)
