"""Temperature, plain and dynamic ("temp_ext", llama.cpp's entropy-based dynamic temperature)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from llmfw.sdk import Candidates, Sampler, SamplerEnv, SamplerParams, apply_temperature


class Temperature(Sampler):
    """Divide the logits by ``temp``; ``temp <= 0`` keeps only the best token (the others become -inf)."""

    name = "temperature"

    def __init__(self, temp: float = 0.8):
        self.temp = float(temp)

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        # In a chain "temperature" is llama.cpp's temp-ext: dynamic when dynatemp_range > 0. Mirostat chains
        # ask for the plain one (dynamic=False), as common_sampler_init does.
        options = dict(options)
        dynamic = options.pop("dynamic", True)
        temp = options.pop("temp", params.temp)
        if dynamic and params.dynatemp_range > 0:
            return TempExt(temp, params.dynatemp_range, params.dynatemp_exponent)
        return cls(temp, **options)

    def apply(self, cur: Candidates) -> None:
        apply_temperature(cur, self.temp)


class TempExt(Sampler):
    """llama_sampler_temp_ext: with ``delta > 0`` the temperature moves in ``[temp - delta, temp + delta]``
    with the normalized entropy of the candidates: ``t = t_min + (t_max - t_min) * (H / H_max) ** exponent``;
    the probabilities are recomputed after scaling. With ``delta <= 0`` it is the plain temperature."""

    name = "temp_ext"

    def __init__(self, temp: float = 0.8, delta: float = 0.0, exponent: float = 1.0):
        self.temp, self.delta, self.exponent = float(temp), float(delta), float(exponent)

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> "TempExt":
        merged = {"temp": params.temp, "delta": params.dynatemp_range, "exponent": params.dynatemp_exponent,
                  **options}
        return cls(**merged)

    def dynamic_temperature(self, cur: Candidates) -> float:
        """The temperature for these candidates (computes their sorted probabilities)."""
        min_temp = max(0.0, self.temp - self.delta)
        max_temp = self.temp + self.delta
        max_entropy = -math.log(1.0 / cur.size)
        cur.softmax(sort=True)
        probs = cur.computed_probs
        p = probs[probs > 0]
        entropy = float(-(p * np.log(p)).sum(dtype=np.float32))
        return float(min_temp + (max_temp - min_temp) * (entropy / max_entropy) ** self.exponent)

    def apply(self, cur: Candidates) -> None:
        if self.delta <= 0:
            apply_temperature(cur, self.temp)
            return
        if cur.size <= 1:
            return
        apply_temperature(cur, self.dynamic_temperature(cur))
        # the C code recomputes the probabilities in double precision, from the (sorted) first logit
        shifted = np.exp(cur.logits.astype(np.float64) - float(cur.logits[0]))
        cur.probs = (shifted / shifted.sum()).astype(np.float32)
