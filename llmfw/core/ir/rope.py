"""RoPE angle tables with ggml_rope_ext's exact float32 semantics, shared by every backend.

ggml computes each rotated pair's angle on the host (``ggml_rope_cache_init``): ``pos * theta_scale**i`` built by
repeated float32 products, divided by the frequency factors, interpolated by ``freq_scale`` and, with YaRN, mixed
with the extrapolated angle over a ramp of dimensions. Backends take these tables and only rotate.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

F32 = np.float32


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the dimension range over which YaRN ramps from interpolation to extrapolation."""

    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))

    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    return max(0.0, start), min(n_dims - 1.0, end)


def yarn_ramp_mix(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float,
                  ext_factor: float) -> np.ndarray:
    """Per rotated pair, float32 [n_dims/2]: how much of the extrapolated (unscaled) angle YaRN keeps — 1 below
    the ramp's low dimension, 0 above its high one (times ext_factor), as ggml's rope_yarn_ramp."""
    low, high = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    y = (np.arange(n_dims // 2, dtype=F32) - F32(low)) / F32(max(0.001, high - low))
    return np.asarray((F32(1.0) - np.clip(y, 0.0, 1.0)) * F32(ext_factor), dtype=F32)


def yarn_magnitude(freq_scale: float, ext_factor: float) -> float:
    """YaRN's factor on cos and sin besides attn_factor: 1 + 0.1 ln(1/freq_scale) when YaRN is on, else 1."""
    if ext_factor != 0.0:
        return 1.0 + 0.1 * math.log(1.0 / freq_scale)
    return 1.0


def rope_angle_slopes(n_dims: int, freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
                      beta_fast: float, beta_slow: float, n_ctx_orig: int, freq_factors: np.ndarray | None = None,
                      **_: Any) -> tuple[np.ndarray, float]:
    """The same angles as :func:`rope_cos_sin` for a backend that computes them in its own graph.

    ggml's angle is linear in the position for every pair (``theta = pos * slope_i``): ``freq_scale``
    interpolation, the YaRN ramp and the frequency factors only change the slope. Returns the float32 slopes
    [n_dims/2] and the magnitude factor. The slopes use an exact power where ggml repeats float32 products:
    the angles differ from :func:`rope_cos_sin`'s by float32 rounding only (``tests/tiny/test_llama_rope.py``).
    """
    half = n_dims // 2
    extrap = float(freq_base) ** (-2.0 * np.arange(half, dtype=np.float64) / n_dims)
    if freq_factors is not None:
        extrap = extrap / np.asarray(freq_factors, dtype=np.float64).reshape(-1)[:half]
    if ext_factor != 0.0:
        mix = yarn_ramp_mix(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow, ext_factor).astype(np.float64)
        slope = extrap * (freq_scale * (1.0 - mix) + mix)
    else:
        slope = extrap * freq_scale
    return slope.astype(F32), attn_factor * yarn_magnitude(freq_scale, ext_factor)


def rope_cos_sin(pos: np.ndarray, n_dims: int, freq_base: float, freq_scale: float, ext_factor: float,
                 attn_factor: float, beta_fast: float, beta_slow: float, n_ctx_orig: int,
                 freq_factors: np.ndarray | None = None, **_: Any) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, n_dims/2] exactly as ggml_rope_cache_init: theta advanced by repeated float32 products."""
    half = n_dims // 2
    theta_scale = F32(freq_base ** (-2.0 / n_dims))
    theta = np.empty((pos.shape[0], half), dtype=F32)
    cur = pos.astype(F32)
    for i in range(half):
        theta[:, i] = cur
        cur = cur * theta_scale
    if freq_factors is not None:
        theta_extrap = theta / np.asarray(freq_factors, dtype=F32).reshape(-1)[:half]
    else:
        theta_extrap = theta
    theta_interp = F32(freq_scale) * theta_extrap
    if ext_factor != 0.0:
        ramp_mix = yarn_ramp_mix(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow, ext_factor)
        theta = theta_interp * (F32(1.0) - ramp_mix) + theta_extrap * ramp_mix
    else:
        theta = theta_interp
    mscale = F32(F32(attn_factor) * yarn_magnitude(freq_scale, ext_factor))  # a float32 product, as ggml's
    return (np.cos(theta) * mscale).astype(F32), (np.sin(theta) * mscale).astype(F32)
