"""Samplers that shift logits: repetition penalties over the last n tokens, and a fixed logit bias."""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from llmfw.sdk import Candidates, RingHistory, Sampler, SamplerEnv, SamplerError, SamplerParams, ids_lookup, \
    vocab_lookup


class Penalties(Sampler):
    """Repeat / frequency / presence penalties over the last ``last_n`` accepted tokens (llama.cpp).

    For a token seen ``count`` times in the window: its logit is divided by ``repeat`` when positive and
    multiplied by it when not (so the penalty always lowers it), then ``count * freq + present`` is
    subtracted. ``last_n = 0`` or neutral values (1, 0, 0) do nothing.
    """

    name = "penalties"
    logits_only = True

    def __init__(self, last_n: int = 64, repeat: float = 1.0, freq: float = 0.0, present: float = 0.0):
        self.last_n = max(int(last_n), 0)
        self.repeat, self.freq, self.present = float(repeat), float(freq), float(present)
        self.window = RingHistory(self.last_n)
        self.counts: Counter[int] = Counter()

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        last_n = params.penalty_last_n
        if last_n == -1:  # llama.cpp: -1 = the context size
            last_n = env.n_ctx or env.n_ctx_train or 0
        defaults = {"last_n": last_n, "repeat": params.penalty_repeat, "freq": params.penalty_freq,
                    "present": params.penalty_present}
        return cls(**{**defaults, **options})

    def accept(self, token: int) -> None:
        if self.last_n == 0:
            return
        self.counts[token] += 1
        dropped = self.window.push(token)
        if dropped is not None:
            self.counts[dropped] -= 1
            if self.counts[dropped] == 0:
                del self.counts[dropped]

    def _neutral(self) -> bool:
        return self.last_n == 0 or (self.repeat == 1.0 and self.freq == 0.0 and self.present == 0.0)

    def _penalized(self, hit: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The logits ``hit`` of tokens seen ``counts`` times, penalized."""
        hit = np.where(hit <= 0, hit * np.float32(self.repeat), hit / np.float32(self.repeat))
        hit = hit - (counts * self.freq + (counts > 0) * self.present).astype(np.float32)
        return hit.astype(np.float32)

    def apply(self, cur: Candidates) -> None:
        if self._neutral():
            return
        positions, counts = ids_lookup(cur.ids, self.counts)
        if positions.size == 0:
            return
        logits = cur.logits.copy()
        logits[positions] = self._penalized(logits[positions], counts)
        cur.logits = logits
        cur.sorted = False

    def apply_logits(self, logits: np.ndarray) -> None:
        if not self._neutral():
            positions, counts = vocab_lookup(logits.size, self.counts)
            logits[positions] = self._penalized(logits[positions], counts)

    def reset(self) -> None:
        self.window.clear()
        self.counts.clear()


class LogitBias(Sampler):
    """Add a fixed bias to chosen tokens' logits (``-inf`` bans a token)."""

    name = "logit_bias"
    logits_only = True

    def __init__(self, bias: dict[int, float] | None = None):
        self.bias = {int(k): float(v) for k, v in (bias or {}).items()}
        if any(k < 0 for k in self.bias):
            raise SamplerError(f"logit_bias: token ids must be >= 0, got {sorted(self.bias)[:3]}")

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        bias = options.get("bias", params.logit_bias)
        if env.n_vocab is not None:
            bad = [t for t in bias if t >= env.n_vocab]
            if bad:
                raise SamplerError(f"logit_bias: token {bad[0]} is outside the vocabulary (n_vocab "
                                   f"{env.n_vocab})")
        return cls(bias)

    def apply(self, cur: Candidates) -> None:
        positions, values = ids_lookup(cur.ids, self.bias)
        if positions.size == 0:
            return
        logits = cur.logits.copy()
        logits[positions] = (logits[positions] + values).astype(np.float32)
        cur.logits = logits
        cur.sorted = False

    def apply_logits(self, logits: np.ndarray) -> None:
        positions, values = vocab_lookup(logits.size, self.bias)
        logits[positions] = (logits[positions] + values).astype(np.float32)
