"""The native backend's row-wise ops (RMS norm, attention over the KV cache) against the numpy backend's kernels
(the oracle), and the property they are built for: a row's result is the same bits alone or in any batch."""
from __future__ import annotations

import numpy as np
import pytest

from llmfw.plugins.backends.numpy.kernels import NumpyKV, attention, rms_norm

from support.native import kernels_or_skip

kernels = kernels_or_skip()


@pytest.fixture(scope="module")
def pool():
    made = kernels.ThreadPool(3)
    yield made
    made.close()


@pytest.mark.parametrize("with_weight", [False, True])
def test_rms_norm_matches_the_oracle(pool, with_weight):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 3, 45)) * 5).astype(np.float32)
    w = rng.standard_normal(45).astype(np.float32) if with_weight else None
    np.testing.assert_allclose(kernels.rms_norm(x, 1e-6, w, pool), rms_norm(x, 1e-6, w), rtol=2e-6, atol=1e-7)


def causal_case(rng, n_tokens, n_head, n_head_kv, dk, dv, n_cells, n_kv, start):
    """q for tokens at positions start.., a cache whose first start+n_tokens cells are filled, a causal mask."""
    q = rng.standard_normal((n_tokens, n_head, dk)).astype(np.float32)
    kv = NumpyKV(np.zeros((n_head_kv, n_cells, dk), np.float32), np.zeros((n_head_kv, n_cells, dv), np.float32))
    kv.k[:, :start + n_tokens] = rng.standard_normal((n_head_kv, start + n_tokens, dk))
    kv.v[:, :start + n_tokens] = rng.standard_normal((n_head_kv, start + n_tokens, dv))
    cells = np.arange(n_kv)[None, :]
    mask = np.where(cells <= start + np.arange(n_tokens)[:, None], 0.0, -np.inf).astype(np.float32)
    return q, kv, mask


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_attention_matches_the_oracle(pool, softcap):
    rng = np.random.default_rng(2)
    q, kv, mask = causal_case(rng, n_tokens=9, n_head=6, n_head_kv=2, dk=16, dv=12, n_cells=64, n_kv=32, start=5)
    got = kernels.attention(q, kv.k, kv.v, mask, 0.25, softcap, pool)
    expected = attention(q, kv, mask.shape[1], mask, 0.25, softcap)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_fully_masked_row_gives_nan_like_the_oracle(pool):
    rng = np.random.default_rng(3)
    q, kv, mask = causal_case(rng, n_tokens=2, n_head=2, n_head_kv=1, dk=8, dv=8, n_cells=16, n_kv=8, start=0)
    mask[1] = -np.inf
    got = kernels.attention(q, kv.k, kv.v, mask, 1.0, 0.0, pool)
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()
    with np.errstate(invalid="ignore"):  # the oracle's -inf - -inf
        assert np.isnan(attention(q, kv, 8, mask, 1.0, 0.0)[1]).all()


def test_attention_of_a_row_is_bit_identical_alone_and_in_a_batch(pool):
    rng = np.random.default_rng(4)
    q, kv, mask = causal_case(rng, n_tokens=12, n_head=4, n_head_kv=2, dk=16, dv=16, n_cells=64, n_kv=48, start=3)
    batch = kernels.attention(q, kv.k, kv.v, mask, 0.5, 0.0, pool)
    one_thread = kernels.ThreadPool(1)
    for row in (0, 7, 11):
        # the same query alone, with only the cells it sees (what a one-token decode step hands over)
        visible = int(np.isfinite(mask[row]).sum())
        alone = kernels.attention(q[row:row + 1], kv.k, kv.v, mask[row:row + 1, :visible], 0.5, 0.0, one_thread)
        assert np.array_equal(alone[0], batch[row]), row
    one_thread.close()


def test_attention_refuses_shapes_that_do_not_fit(pool):
    q = np.zeros((1, 4, 8), np.float32)
    k = np.zeros((2, 16, 8), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.attention(q, k, k, np.zeros((1, 32), np.float32), 1.0, 0.0, pool)  # more cells than the cache
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.attention(q, k[:, ::2], k[:, ::2], np.zeros((1, 4), np.float32), 1.0, 0.0, pool)
