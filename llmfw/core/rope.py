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
    mscale = F32(attn_factor)
    if ext_factor != 0.0:
        low, high = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        y = (np.arange(half, dtype=F32) - F32(low)) / F32(max(0.001, high - low))
        ramp_mix = (F32(1.0) - np.clip(y, 0.0, 1.0)) * F32(ext_factor)
        theta = theta_interp * (F32(1.0) - ramp_mix) + theta_extrap * ramp_mix
        mscale = F32(mscale * (1.0 + 0.1 * math.log(1.0 / freq_scale)))
    else:
        theta = theta_interp
    return (np.cos(theta) * mscale).astype(F32), (np.sin(theta) * mscale).astype(F32)
