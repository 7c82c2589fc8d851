"""Samplers that drop candidates: top-k, top-p, min-p, typical, top-n-sigma and XTC (llama.cpp semantics)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from llmfw.core.generation.sampling import (
    Candidates,
    MT19937Rng,
    Sampler,
    SamplerEnv,
    SamplerParams,
    keep_top_k,
    resolve_seed,
)


def _from_params(cls: type[Sampler], defaults: dict[str, Any], options: dict[str, Any]) -> Sampler:
    return cls(**{**defaults, **options})


class TopK(Sampler):
    """Keep the ``k`` highest logits (sorted); ``k <= 0`` keeps everything."""

    name = "top_k"

    def __init__(self, k: int = 40):
        self.k = int(k)

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        return _from_params(cls, {"k": params.top_k}, options)

    def apply(self, cur: Candidates) -> None:
        keep_top_k(cur, self.k)


class TopP(Sampler):
    """Nucleus sampling: the smallest prefix of the sorted softmax whose cumulative probability reaches
    ``p`` (and holds at least ``min_keep`` tokens). ``p >= 1`` does nothing."""

    name = "top_p"

    def __init__(self, p: float = 0.95, min_keep: int = 0):
        self.p, self.min_keep = float(p), int(min_keep)

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        return _from_params(cls, {"p": params.top_p, "min_keep": params.min_keep}, options)

    def apply(self, cur: Candidates) -> None:
        if self.p >= 1.0:
            return
        cur.softmax(sort=False)
        if not cur.sorted and cur.size > 1024:
            # like llama.cpp, try the best 256 first: the nucleus is usually inside them
            trial = Candidates(cur.ids, cur.logits, cur.probs)
            trial.sort(256)
            last = self._nucleus_end(trial.computed_probs)
            if last is not None:
                cur.ids, cur.logits, cur.probs, cur.sorted = trial.ids, trial.logits, trial.probs, True
                cur.truncate(last)
                return
        if not cur.sorted:
            cur.sort()
        last = self._nucleus_end(cur.computed_probs)
        if last is not None:
            cur.truncate(last)

    def _nucleus_end(self, sorted_probs: np.ndarray) -> int | None:
        """Length of the shortest prefix reaching ``p`` with at least ``min_keep`` tokens, or None."""
        cumulative = np.cumsum(sorted_probs, dtype=np.float32)  # float running sum, as in the C loop
        index = np.arange(1, len(sorted_probs) + 1)
        hits = np.nonzero((cumulative >= np.float32(self.p)) & (index >= self.min_keep))[0]
        return int(hits[0]) + 1 if hits.size else None


class MinP(Sampler):
    """Keep tokens whose probability is at least ``p`` times the best one's (``logit >= max + log p``),
    keeping at least ``min_keep``. ``p <= 0`` does nothing."""

    name = "min_p"

    def __init__(self, p: float = 0.05, min_keep: int = 0):
        self.p, self.min_keep = float(p), int(min_keep)

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        return _from_params(cls, {"p": params.min_p, "min_keep": params.min_keep}, options)

    def apply(self, cur: Candidates) -> None:
        if self.p <= 0.0 or cur.size == 0:
            return
        log_p = np.float32(math.log(self.p))
        if not cur.sorted:
            # unsorted path: filter in place, order kept
            keep = cur.logits >= cur.logits.max() + log_p
            n_keep = int(keep.sum())
            if n_keep and n_keep >= self.min_keep:
                cur.take(np.nonzero(keep)[0])
                return
            cur.sort()
        threshold = cur.logits[0] + log_p
        below = np.nonzero((cur.logits < threshold) & (np.arange(cur.size) >= max(self.min_keep, 1)))[0]
        if below.size:
            cur.truncate(int(below[0]))


class Typical(Sampler):
    """Locally typical sampling: order tokens by ``|-log p - H|`` (distance of their surprise from the
    entropy) and keep them until the cumulative probability exceeds ``p`` (at least ``min_keep``).
    The result is in that order, not sorted by logit. ``p >= 1`` does nothing."""

    name = "typical"

    def __init__(self, p: float = 1.0, min_keep: int = 0):
        self.p, self.min_keep = float(p), int(min_keep)

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        return _from_params(cls, {"p": params.typical_p, "min_keep": params.min_keep}, options)

    def apply(self, cur: Candidates) -> None:
        if self.p >= 1.0:
            return
        cur.softmax(sort=True)
        probs = cur.computed_probs
        with np.errstate(divide="ignore", invalid="ignore"):
            neg_log = -np.log(probs)
            terms = np.where(probs > 0, probs * neg_log, 0.0).astype(np.float32)
        entropy = np.cumsum(terms, dtype=np.float32)[-1]
        shifted = np.abs(neg_log - entropy)
        order = np.argsort(shifted, kind="stable")
        cumulative = np.cumsum(probs[order], dtype=np.float32)
        index = np.arange(cur.size)
        enough = (index >= self.min_keep - 1) if self.min_keep > 0 else np.ones(cur.size, dtype=bool)
        hits = np.nonzero((cumulative > np.float32(self.p)) & enough)[0]
        last = int(hits[0]) + 1 if hits.size else cur.size
        cur.take(order[:last])
        cur.sorted = False


class TopNSigma(Sampler):
    """Keep logits within ``n`` standard deviations of the maximum (statistics over the finite logits);
    the rest become -inf, then the candidates are sorted with their softmax. ``n <= 0`` does nothing."""

    name = "top_n_sigma"

    def __init__(self, n: float = -1.0):
        self.n = float(n)

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        return _from_params(cls, {"n": params.top_n_sigma}, options)

    def apply(self, cur: Candidates) -> None:
        if self.n <= 0.0 or cur.size <= 1:
            return
        valid = cur.logits[cur.logits != -np.inf].astype(np.float64)
        max_l = max(float(cur.logits[0]), float(valid.max())) if valid.size else float(cur.logits[0])
        mean = valid.mean() if valid.size else 0.0
        std = math.sqrt(((valid - mean) ** 2).sum() / valid.size) if valid.size else 0.0
        logits = cur.logits.copy()
        logits[logits < np.float32(max_l - self.n * std)] = -np.inf
        cur.logits = logits
        cur.softmax(sort=True)


class XTC(Sampler):
    """Exclude Top Choices: with chance ``probability`` (one draw per step from the seeded generator), drop
    every token with ``p >= threshold`` except the least probable of them — only when at least two tokens
    reach the threshold and ``min_keep`` tokens remain. ``threshold > 0.5`` disables it (at most one token can
    exceed 0.5)."""

    name = "xtc"

    def __init__(self, probability: float = 0.0, threshold: float = 0.1, min_keep: int = 0,
                 seed: int = 0xFFFFFFFF):
        self.probability, self.threshold = float(probability), float(threshold)
        self.min_keep, self.seed = int(min_keep), seed
        self.rng: MT19937Rng = MT19937Rng(resolve_seed(seed))

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        defaults = {"probability": params.xtc_probability, "threshold": params.xtc_threshold,
                    "min_keep": params.min_keep, "seed": params.seed}
        return _from_params(cls, defaults, options)

    def apply(self, cur: Candidates) -> None:
        if self.probability <= 0.0 or self.threshold > 0.5 or cur.size < 2:
            return
        if self.rng.uniform_float() > self.probability:
            return
        cur.softmax(sort=True)
        above = cur.computed_probs >= np.float32(self.threshold)
        # index of the last token of the leading run above the threshold
        pos_last = int(np.argmin(above)) - 1 if not above.all() else cur.size - 1
        pos_last = max(pos_last, 0)
        if cur.size - pos_last >= self.min_keep and pos_last > 0:
            cur.take(slice(pos_last, None))

    def reset(self) -> None:
        self.rng.reseed(resolve_seed(self.seed))
