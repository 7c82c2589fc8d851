"""The recurrent-layer ops of issue 34 (``ssm_conv``, ``conv_window``, ``ssm_scan``, ``gated_delta``, ``sigmoid``,
``softplus``): their rows in the op table
(shapes, dtypes, misfits named), the numpy oracle against the definitions written out step by step, a carried
window / state equal to processing the whole sequence at once, and the onnx backend against the oracle."""
from __future__ import annotations

import numpy as np
import pytest

from llmfw.core.errors import ModelError
from llmfw.core.graph import Graph
from llmfw.plugins.backends.numpy.recurrent import (DELTA_CHUNK, conv_window, gated_delta, gated_delta_chunked,
                                                    gated_delta_steps, sigmoid, softplus, ssm_conv, ssm_scan)

RNG = np.random.default_rng(34)
S, T, C, K = 2, 7, 12, 4


def _f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# -- op table ---------------------------------------------------------------------------------------------------
def test_op_table_types_the_recurrent_ops():
    g = Graph()
    window, x = g.leaf("input", "window", (S, K - 1, C)), g.leaf("input", "x", (S, T, C))
    kernel = g.leaf("weight", "w", (C, K))
    assert g.add("ssm_conv", window, x, kernel).shape == (S, T, C)
    assert g.add("conv_window", window, x).shape == (S, K - 1, C)
    H, P, N, G = 4, 3, 5, 2
    scan = g.add("ssm_scan", g.leaf("input", "s", (S, H, P, N)), g.leaf("input", "xs", (S, T, H, P)),
                 g.leaf("input", "dt", (S, T, H)), g.leaf("input", "a", (H,)), g.leaf("input", "b", (S, T, G, N)),
                 g.leaf("input", "c", (S, T, G, N)))
    assert scan.shape == (S, T * H * P + H * P * N) and scan.dtype == "f32"


@pytest.mark.parametrize("window_shape, kernel_shape", [((S, K - 1, C + 1), (C, K)), ((S, K - 1, C), (C, K + 1)),
                                                        ((S + 1, K - 1, C), (C, K))])
def test_misfit_convolutions_are_model_errors(window_shape, kernel_shape):
    g = Graph()
    with pytest.raises(ModelError, match="ssm_conv"):
        g.add("ssm_conv", g.leaf("input", "window", window_shape), g.leaf("input", "x", (S, T, C)),
              g.leaf("weight", "w", kernel_shape))


def test_misfit_scan_is_a_model_error():
    g = Graph()
    with pytest.raises(ModelError, match="ssm_scan"):  # 3 heads do not split into 2 groups
        g.add("ssm_scan", g.leaf("input", "s", (S, 3, 2, 4)), g.leaf("input", "xs", (S, T, 3, 2)),
              g.leaf("input", "dt", (S, T, 3)), g.leaf("input", "a", (3,)), g.leaf("input", "b", (S, T, 2, 4)),
              g.leaf("input", "c", (S, T, 2, 4)))


# -- the numpy oracle ------------------------------------------------------------------------------------------
def test_ssm_conv_is_the_causal_depthwise_convolution():
    window, x, kernel = _f32(S, K - 1, C), _f32(S, T, C), _f32(C, K)
    padded = np.concatenate([window, x], axis=1)
    want = np.zeros((S, T, C), np.float64)
    for s in range(S):
        for t in range(T):
            for c in range(C):
                want[s, t, c] = sum(float(padded[s, t + k, c]) * float(kernel[c, k]) for k in range(K))
    np.testing.assert_allclose(ssm_conv(window, x, kernel), want, atol=1e-5)
    np.testing.assert_array_equal(conv_window(window, x), padded[:, -(K - 1):])


def test_carried_window_equals_the_whole_sequence():
    x, kernel = _f32(1, 10, C), _f32(C, K)
    zeros = np.zeros((1, K - 1, C), np.float32)
    whole = ssm_conv(zeros, x, kernel)
    first = ssm_conv(zeros, x[:, :6], kernel)
    second = ssm_conv(conv_window(zeros, x[:, :6]), x[:, 6:], kernel)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), whole, atol=1e-6)


def _scan_inputs(n_tokens: int, H: int = 4, P: int = 3, N: int = 5, G: int = 2):
    return (_f32(S, H, P, N), _f32(S, n_tokens, H, P), _f32(S, n_tokens, H), -np.linspace(1, 8, H, dtype=np.float32),
            _f32(S, n_tokens, G, N), _f32(S, n_tokens, G, N))


def test_ssm_scan_follows_the_recurrence():
    state, x, dt, a, b, c = _scan_inputs(T)
    H, P, N, G = 4, 3, 5, 2
    packed = ssm_scan(state, x, dt, a, b, c)
    y, final = packed[:, :T * H * P].reshape(S, T, H, P), packed[:, T * H * P:].reshape(S, H, P, N)
    for s in range(S):
        h_state = state[s].astype(np.float64)
        for t in range(T):
            for h in range(H):
                d = float(softplus(dt[s, t, h]))
                g = h // (H // G)
                h_state[h] = h_state[h] * np.exp(d * a[h]) + np.outer(x[s, t, h] * d, b[s, t, g])
                np.testing.assert_allclose(y[s, t, h], h_state[h] @ c[s, t, g], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(final[s], h_state, rtol=1e-4, atol=1e-4)
    assert softplus(np.float32(25.0)) == np.float32(25.0)  # ggml's threshold: x itself above 20


def test_ssm_scan_carried_state_equals_the_whole_sequence():
    state, x, dt, a, b, c = _scan_inputs(9)
    whole = ssm_scan(state, x, dt, a, b, c)
    H, P, N = 4, 3, 5
    first = ssm_scan(state, x[:, :4], dt[:, :4], a, b[:, :4], c[:, :4])
    carried = first[:, 4 * H * P:].reshape(S, H, P, N)
    second = ssm_scan(carried, x[:, 4:], dt[:, 4:], a, b[:, 4:], c[:, 4:])
    y = np.concatenate([first[:, :4 * H * P], second[:, :5 * H * P]], axis=1)
    np.testing.assert_allclose(y, whole[:, :9 * H * P], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(second[:, 5 * H * P:], whole[:, 9 * H * P:], rtol=1e-5, atol=1e-5)


def _delta_inputs(n_tokens: int, H: int = 4, Hk: int = 2, D: int = 6):
    q, k = _f32(S, n_tokens, Hk, D), _f32(S, n_tokens, Hk, D)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return (_f32(S, H, D, D, scale=0.3), q, k, _f32(S, n_tokens, H, D), -np.abs(_f32(S, n_tokens, H, scale=0.5)),
            sigmoid(_f32(S, n_tokens, H)))


def test_gated_delta_follows_the_delta_rule():
    state, q, k, v, g, beta = _delta_inputs(T)
    H, Hk, D = 4, 2, 6
    packed = gated_delta(state, q, k, v, g, beta)
    out, final = packed[:, :T * H * D].reshape(S, T, H, D), packed[:, T * H * D:].reshape(S, H, D, D)
    assert gated_delta(state, q, k, v, g, beta).shape == (S, T * H * D + H * D * D)
    for s in range(S):
        for h in range(H):
            m = state[s, h].astype(np.float64)
            for t in range(T):
                kt, qt = k[s, t, h % Hk], q[s, t, h % Hk]  # value head h reads key head h % Hk
                m = m * np.exp(g[s, t, h])
                m = m + np.outer((v[s, t, h] - m @ kt) * beta[s, t, h], kt)
                np.testing.assert_allclose(out[s, t, h], m @ qt / np.sqrt(D), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(final[s, h], m, rtol=1e-4, atol=1e-5)


def test_gated_delta_prompt_in_pieces_equals_one_step_decode():
    """The state carried across ubatches: a prompt cut in two pieces, then one token at a time, gives the same
    outputs and final state as the whole sequence at once."""
    state, q, k, v, g, beta = _delta_inputs(8)
    H, D = 4, 6
    whole = gated_delta(state, q, k, v, g, beta)
    outputs, current = [], state
    for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 8)):
        piece = gated_delta(current, q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi])
        outputs.append(piece[:, :(hi - lo) * H * D])
        current = piece[:, (hi - lo) * H * D:].reshape(state.shape)
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), whole[:, :8 * H * D], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(current.reshape(S, -1), whole[:, 8 * H * D:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_tokens, chunk", [(150, DELTA_CHUNK), (150, 7), (5, 8), (1, DELTA_CHUNK)])
def test_chunked_gated_delta_equals_the_recurrence(n_tokens, chunk):
    """The chunked form (several chunks and a partial last one, or one chunk shorter than its size) gives the
    step-by-step outputs and final state up to float32 rounding; the decay and β stay inside (0, 1]."""
    arrays = _delta_inputs(n_tokens, D=16)
    steps = gated_delta_steps(*arrays)
    np.testing.assert_allclose(gated_delta_chunked(*arrays, chunk=chunk), steps, rtol=1e-4, atol=1e-5)


def test_gated_delta_chunks_prompts_longer_than_a_chunk():
    long, short = _delta_inputs(DELTA_CHUNK + 1), _delta_inputs(DELTA_CHUNK)
    np.testing.assert_array_equal(gated_delta(*long), gated_delta_chunked(*long))
    np.testing.assert_array_equal(gated_delta(*short), gated_delta_steps(*short))


def test_gated_delta_shapes_are_checked():
    g = Graph()
    with pytest.raises(ModelError, match="gated_delta"):  # 3 value heads cannot read 2 key heads
        g.add("gated_delta", g.leaf("input", "s", (S, 3, 4, 4)), g.leaf("input", "q", (S, T, 2, 4)),
              g.leaf("input", "k", (S, T, 2, 4)), g.leaf("input", "v", (S, T, 3, 4)), g.leaf("input", "g", (S, T, 3)),
              g.leaf("input", "b", (S, T, 3)))


def test_sigmoid_and_softplus():
    x = np.array([-30.0, -1.0, 0.0, 2.0, 19.0, 21.0], np.float32)
    np.testing.assert_allclose(sigmoid(x), 1 / (1 + np.exp(-x.astype(np.float64))), rtol=1e-6)
    np.testing.assert_allclose(softplus(x), np.where(x > 20, x, np.log1p(np.exp(x.astype(np.float64)))), rtol=1e-6)


# -- the onnx backend ----------------------------------------------------------------------------------------------
def _onnx_run(op_outputs, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Build a graph of one input per array and the outputs ``op_outputs(graph, inputs)`` makes, run it as one
    onnx split, and return the outputs as numpy arrays."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from llmfw.core.backend import Split
    from llmfw.plugins.backends.onnx import OnnxBackend

    g = Graph()
    inputs = [g.leaf("input", f"in{i}", a.shape) for i, a in enumerate(arrays)]
    outputs = op_outputs(g, inputs)
    backend = OnnxBackend()
    split = Split(backend=backend, nodes=[n for n in g.nodes if n.op != "input"], input_ids=[i.id for i in inputs],
                  output_ids=[n.id for n in outputs])
    values = backend.compile(split, {})({i.id: backend.from_numpy(a) for i, a in zip(inputs, arrays)})
    return [backend.to_numpy(values[n.id]) for n in outputs]


def test_onnx_convolution_matches_the_oracle():
    window, x, kernel = _f32(S, K - 1, C), _f32(S, T, C), _f32(C, K)
    out, following = _onnx_run(lambda g, i: [g.add("ssm_conv", *i), g.add("conv_window", *i[:2])],
                               [window, x, kernel])
    np.testing.assert_allclose(out, ssm_conv(window, x, kernel), atol=1e-5)
    np.testing.assert_array_equal(following, conv_window(window, x))


@pytest.mark.parametrize("n_tokens, n_group", [(1, 2), (9, 2), (5, 1), (5, 4)])
def test_onnx_ssm_scan_matches_the_oracle(n_tokens, n_group):
    """One token (decode) and prompts, heads sharing B/C groups or each with its own: outputs and final state."""
    arrays = _scan_inputs(n_tokens, G=n_group)
    (packed,) = _onnx_run(lambda g, i: [g.add("ssm_scan", *i)], list(arrays))
    np.testing.assert_allclose(packed, ssm_scan(*arrays), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_tokens, n_k_heads", [(1, 2), (9, 2), (5, 4), (DELTA_CHUNK + 1, 2), (150, 4)])
def test_onnx_gated_delta_matches_the_oracle(n_tokens, n_k_heads):
    """Decode and short ubatches step by step, prompts past a chunk in chunks (several, the last one partial)."""
    arrays = _delta_inputs(n_tokens, Hk=n_k_heads, D=16)
    (packed,) = _onnx_run(lambda g, i: [g.add("gated_delta", *i)], list(arrays))
    np.testing.assert_allclose(packed, gated_delta(*arrays), rtol=1e-5, atol=1e-5)
