"""RoPE of the numpy backend (ggml_rope_ext semantics) and the llama architecture's rope scaling types.

What is checked are properties that hold for ggml's definition: rotation by relative position, linear scaling
as position scaling, YaRN's split between extrapolated and interpolated dimensions with its magnitude scale,
llama3 frequency factors as the HF→GGUF converter computes them, and that the scaling keys reach the graph.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import llmfw
from llmfw.core.rope import rope_cos_sin, yarn_corr_dims
from llmfw.plugins.backends.numpy import rope_apply
from support.models import write_tiny_llama

BASE = dict(n_dims=64, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0, beta_fast=32.0,
            beta_slow=1.0, n_ctx_orig=2048)


def rope(x, pos, mode="norm", **kw):
    params = {**BASE, **kw}
    cos, sin = rope_cos_sin(np.asarray(pos, dtype=np.int32), **params)
    return rope_apply(x, cos, sin, params["n_dims"], mode)


@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_rope_is_a_relative_rotation(mode):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 64)).astype(np.float32)
    dots = []
    for p in (3, 40, 500):
        rq, rk = rope(q, [p + 7], mode), rope(k, [p], mode)
        assert np.allclose(np.linalg.norm(rq), np.linalg.norm(q), rtol=1e-5)  # a rotation keeps the norm
        dots.append(float((rq * rk).sum()))
    assert np.allclose(dots, dots[0], rtol=1e-3)  # q·k depends only on the distance 7
    assert not np.allclose(rope(q, [5], mode), q)
    np.testing.assert_array_equal(rope(q, [0], mode), q)  # position 0 is the identity


def test_norm_and_neox_pair_different_dimensions():
    x = np.zeros((1, 1, 8), np.float32)
    x[0, 0, 0] = 1.0
    norm = rope(x, [1], "norm", n_dims=8)
    neox = rope(x, [1], "neox", n_dims=8)
    assert norm[0, 0, 1] != 0 and norm[0, 0, 4] == 0  # NORM rotates (0, 1)
    assert neox[0, 0, 4] != 0 and neox[0, 0, 1] == 0  # NEOX rotates (0, n_dims/2)


def test_dimensions_past_n_dims_pass_through():
    x = np.random.default_rng(2).standard_normal((3, 2, 64)).astype(np.float32)
    out = rope(x, [1, 2, 3], n_dims=32)
    np.testing.assert_array_equal(out[..., 32:], x[..., 32:])


def test_linear_scaling_is_position_scaling():
    x = np.random.default_rng(3).standard_normal((2, 1, 64)).astype(np.float32)
    np.testing.assert_allclose(rope(x, [8, 100], freq_scale=0.25), rope(x, [2, 25]), atol=2e-5)


def test_yarn_extrapolates_fast_dims_and_interpolates_slow_ones():
    scale = 0.25
    pos = np.array([1000], np.int32)
    plain_cos, _ = rope_cos_sin(pos, **BASE)
    interp_cos, _ = rope_cos_sin(pos, **{**BASE, "freq_scale": scale})
    yarn_cos, yarn_sin = rope_cos_sin(pos, **{**BASE, "freq_scale": scale, "ext_factor": 1.0})
    low, high = yarn_corr_dims(64, 2048, 10000.0, 32.0, 1.0)
    mscale = 1.0 + 0.1 * math.log(1.0 / scale)
    fast = slice(0, int(low))  # high-frequency pairs keep their original angle
    slow = slice(int(high) + 1, 32)  # low-frequency pairs are interpolated
    np.testing.assert_allclose(yarn_cos[0, fast], plain_cos[0, fast] * mscale, atol=1e-4)
    np.testing.assert_allclose(yarn_cos[0, slow], interp_cos[0, slow] * mscale, atol=1e-4)
    np.testing.assert_allclose(yarn_cos ** 2 + yarn_sin ** 2, mscale ** 2, rtol=1e-4)


def test_llama3_factors_match_the_converter():
    from llmfw.core.hparams import HParams
    from llmfw.plugins.architectures.llama import llama3_rope_factors

    hp = HParams(arch="llama", n_vocab=10, n_ctx_train=131072, n_embd=4096, n_layer=1, n_head_arr=[32],
                 n_head_kv_arr=[8], n_ff_arr=[14336], n_embd_head_k=128, n_embd_head_v=128, n_rot=128,
                 rope_freq_base_train=500000.0, rope_scaling_type="llama3", rope_scaling_factor=8.0,
                 n_ctx_orig_yarn=8192)
    factors = llama3_rope_factors(hp)
    assert factors.shape == (64,) and factors.dtype == np.float32
    assert factors[0] == 1.0 and factors[-1] == 8.0
    assert np.all(np.diff(factors) >= 0)
    # the smooth band: wavelengths between 8192/4 and 8192/1
    freqs = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    wavelen = 2 * np.pi / freqs
    band = (wavelen >= 2048) & (wavelen <= 8192)
    smooth = (8192 / wavelen[band] - 1) / 3
    np.testing.assert_allclose(factors[band], 1 / ((1 - smooth) / 8 + smooth), rtol=1e-5)


@pytest.mark.parametrize("overrides, expected_scale, has_factors", [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, 0.25, False),
    ({"llama.rope.scale_linear": 2.0}, 0.5, False),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 64}, 0.25, False),
    ({"llama.rope.scaling.type": "llama3", "llama.rope.scaling.factor": 8.0,
      "llama.rope.scaling.original_context_length": 64}, 1.0, True),
])
def test_scaling_keys_reach_the_graph(tmp_path, overrides, expected_scale, has_factors):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    with llmfw.load_model(path, backend="numpy", kv_overrides=overrides) as m:
        hp = m.hparams
        params = m.arch.rope_params(hp, 0)
        assert params.freq_scale == pytest.approx(expected_scale)
        assert params.ext_factor == (1.0 if hp.rope_scaling_type == "yarn" else 0.0)
        assert m.has_weight("blk.0.rope_freqs.weight") == has_factors
        ctx = m.new_context(n_threads=1)
        assert ctx.decode(llmfw.Batch([1, 2, 3, 4], logits=True)) == 0
        scaled = ctx.get_logits().copy()
    with llmfw.load_model(path, backend="numpy") as plain_model:
        ctx = plain_model.new_context(n_threads=1)
        assert ctx.decode(llmfw.Batch([1, 2, 3, 4], logits=True)) == 0
        assert np.isfinite(scaled).all()
        assert not np.allclose(scaled[1:], ctx.get_logits()[1:], atol=1e-6)  # the scaling changed something
        np.testing.assert_allclose(scaled[0], ctx.get_logits()[0], atol=1e-4)  # position 0 is unrotated
