"""Random numbers as llama.cpp draws them: ``std::mt19937`` and the libstdc++ distributions its samplers use, so
a seeded chain picks the tokens llama.cpp picks."""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ..errors import SamplerError

#: llama.cpp's LLAMA_DEFAULT_SEED: "pick a random seed".
DEFAULT_SEED = 0xFFFFFFFF


def _mt19937_key(seed: int) -> np.ndarray:
    """The 624-word state std::mt19937(seed) starts from (Matsumoto & Nishimura's init_genrand)."""
    key = np.empty(624, dtype=np.uint32)
    x = seed & 0xFFFFFFFF
    key[0] = x
    for i in range(1, 624):
        x = (1812433253 * (x ^ (x >> 30)) + i) & 0xFFFFFFFF
        key[i] = x
    return key


def resolve_seed(seed: int) -> int:
    """llama.cpp's get_rng_seed: the default seed (or -1) means a fresh random seed."""
    if seed in (DEFAULT_SEED, -1):
        return int.from_bytes(os.urandom(4), "little")
    return seed & 0xFFFFFFFF


class MT19937Rng:
    """``std::mt19937`` plus the libstdc++ distributions llama.cpp's samplers use."""

    _TWO32 = 4294967296.0

    def __init__(self, seed: int):
        self.seed = seed
        self._bits = np.random.MT19937()
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        self.seed = seed
        self._bits.state = {"bit_generator": "MT19937", "state": {"key": _mt19937_key(seed), "pos": 624}}

    def get_state(self) -> dict[str, Any]:
        """The generator's position, JSON-serializable (a saved prompt state keeps it)."""
        state = self._bits.state["state"]
        return {"seed": int(self.seed), "pos": int(state["pos"]), "key": [int(k) for k in state["key"]]}

    def set_state(self, state: dict[str, Any]) -> None:
        key = np.asarray(state["key"], dtype=np.uint32)
        if key.shape != (624,) or not 0 <= int(state["pos"]) <= 624:
            raise SamplerError("an MT19937 state needs 624 key words and a position in 0..624")
        self.seed = int(state["seed"])
        self._bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": int(state["pos"])}}

    def next_u32(self) -> int:
        return int(self._bits.random_raw())

    def uniform_double(self) -> float:
        """uniform_real_distribution<double>(0, 1): generate_canonical with two 32-bit draws."""
        lo, hi = self.next_u32(), self.next_u32()
        value = (lo + hi * self._TWO32) / (self._TWO32 * self._TWO32)
        return value if value < 1.0 else math.nextafter(1.0, 0.0)

    def uniform_float(self) -> float:
        """uniform_real_distribution<float>(0, 1): one 32-bit draw, float arithmetic."""
        value = np.float32(np.float32(self.next_u32()) / np.float32(self._TWO32))
        return float(value) if value < 1.0 else float(np.nextafter(np.float32(1.0), np.float32(0.0)))

    def discrete(self, weights: np.ndarray) -> int:
        """std::discrete_distribution<int>(weights)(rng) as libstdc++ computes it."""
        if len(weights) == 0:
            return 0
        w = np.asarray(weights, dtype=np.float64)
        cumulative = np.cumsum(w / w.sum())
        cumulative[-1] = 1.0
        return int(np.searchsorted(cumulative, self.uniform_double(), side="left"))
