"""Mirostat 1.0 and 2.0: selecting samplers that steer the surprise of the text towards ``tau``."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from llmfw.sdk import Candidates, MT19937Rng, Sampler, SamplerEnv, SamplerError, SamplerParams, keep_top_k, resolve_seed


class _MirostatBase(Sampler):
    """Shared state: the seeded generator and ``mu`` (starts at ``2 * tau``; ``mu -= eta * (surprise - tau)``
    after every choice, where surprise is ``-log2 p`` of the chosen token)."""

    def __init__(self, tau: float = 5.0, eta: float = 0.1, seed: int = 0xFFFFFFFF):
        self.tau, self.eta, self.seed = float(tau), float(eta), seed
        self.mu = 2.0 * self.tau
        self.rng: MT19937Rng = MT19937Rng(resolve_seed(seed))

    def _select_and_update(self, cur: Candidates) -> None:
        cur.softmax(sort=True)
        idx = self.rng.discrete(cur.computed_probs)
        cur.selected = idx
        observed_surprise = -math.log2(float(cur.computed_probs[idx]))
        self.mu = self.mu - self.eta * (observed_surprise - self.tau)

    def reset(self) -> None:
        self.mu = 2.0 * self.tau
        self.rng.reseed(resolve_seed(self.seed))


class Mirostat(_MirostatBase):
    """Mirostat 1.0: estimate the Zipf exponent ``s_hat`` from the ``m`` best tokens, derive the top-k that
    gives surprise ``mu``, keep that many, draw one."""

    name = "mirostat"

    def __init__(self, n_vocab: int, tau: float = 5.0, eta: float = 0.1, m: int = 100, seed: int = 0xFFFFFFFF):
        super().__init__(tau, eta, seed)
        self.n_vocab, self.m = int(n_vocab), int(m)

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        defaults = {"n_vocab": env.n_vocab, "tau": params.mirostat_tau, "eta": params.mirostat_eta,
                    "m": 100, "seed": params.seed}
        merged = {**defaults, **options}
        if merged["n_vocab"] is None:
            raise SamplerError("mirostat needs the vocabulary size; build the chain with a model")
        return cls(**merged)

    def estimate_k(self, cur: Candidates) -> int:
        n = min(self.m - 1, cur.size - 1)
        if n <= 0:
            return 1
        i = np.arange(n, dtype=np.float32)
        t = np.log((i + 2) / (i + 1)).astype(np.float32)
        probs = cur.computed_probs
        b = np.log(probs[:n] / probs[1:n + 1]).astype(np.float32)
        s_hat = float((t * b).sum(dtype=np.float32) / (t * t).sum(dtype=np.float32))
        epsilon_hat = s_hat - 1.0
        try:
            k = ((epsilon_hat * 2.0 ** self.mu) / (1.0 - self.n_vocab ** (-epsilon_hat))) ** (1.0 / s_hat)
        except (OverflowError, ZeroDivisionError):
            return cur.size
        if isinstance(k, complex) or not math.isfinite(k):
            return cur.size
        return max(int(min(k, cur.size)), 1)

    def apply(self, cur: Candidates) -> None:
        cur.softmax(sort=True)
        keep_top_k(cur, self.estimate_k(cur))
        self._select_and_update(cur)


class MirostatV2(_MirostatBase):
    """Mirostat 2.0: keep the sorted tokens whose surprise ``-log2 p`` is at most ``mu`` (at least one),
    renormalize, draw one."""

    name = "mirostat_v2"

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        defaults = {"tau": params.mirostat_tau, "eta": params.mirostat_eta, "seed": params.seed}
        return cls(**{**defaults, **options})

    def apply(self, cur: Candidates) -> None:
        cur.softmax(sort=True)
        with np.errstate(divide="ignore"):
            too_surprising = -np.log2(cur.computed_probs) > self.mu
        first = int(np.argmax(too_surprising)) if too_surprising.any() else cur.size
        cur.truncate(max(first, 1))
        self._select_and_update(cur)
