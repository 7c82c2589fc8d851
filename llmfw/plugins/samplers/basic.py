"""The selecting samplers every chain ends with: greedy (argmax) and dist (a seeded random draw)."""
from __future__ import annotations

from typing import Any

import numpy as np

from llmfw.sdk import Candidates, MT19937Rng, Sampler, SamplerEnv, SamplerParams, resolve_seed


class Greedy(Sampler):
    """Select the candidate with the highest logit (the first one on ties), like llama.cpp's greedy."""

    name = "greedy"
    selects_from_logits = True

    def apply(self, cur: Candidates) -> None:
        cur.selected = self.select_logits(cur.logits)

    def select_logits(self, logits: np.ndarray) -> int:
        return int(np.argmax(logits))


class Dist(Sampler):
    """Softmax over the candidates, then one draw from ``std::mt19937(seed)`` (llama.cpp's dist).

    The draw is ``u * sum(p)`` against the running sum of the unnormalized probabilities, exactly as
    llama_sampler_dist_apply does, so a seed picks the same token as llama.cpp for the same candidates.
    ``reset`` re-seeds: the same seed gives the same text.
    """

    name = "dist"

    def __init__(self, seed: int = 0xFFFFFFFF):
        self.seed = seed
        self.rng: MT19937Rng = MT19937Rng(resolve_seed(seed))

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> "Dist":
        return cls(options.get("seed", params.seed))

    def apply(self, cur: Candidates) -> None:
        if cur.size == 0:
            cur.selected = -1
            return
        cur.selected = 0
        if cur.size == 1:
            cur.probs = np.ones(1, dtype=np.float32)
            return
        max_l = cur.logits[0] if cur.sorted else cur.logits.max()
        p = np.exp(cur.logits - max_l).astype(np.float32)
        running = np.cumsum(p, dtype=np.float64)  # the C code sums the float probs in a double
        total = running[-1]
        target = total * self.rng.uniform_double()
        chosen = int(np.searchsorted(running, target, side="left"))
        cur.selected = min(chosen, cur.size - 1)
        cur.probs = (p / total).astype(np.float32)

    def reset(self) -> None:
        self.rng.reseed(resolve_seed(self.seed))
