"""The native backend's recurrent ops (csrc/recurrent.c: the short convolution and its carried window, Mamba-2's
selective scan, the gated delta rule) compiled into programs and run against the numpy backend's kernels (the
oracle); a sequence's bits alone, beside another sequence and on any number of threads; the checker's refusals."""
from __future__ import annotations

import numpy as np
import pytest

from llmfw.core.errors import ModelError
from llmfw.plugins.backends.numpy.recurrent import gated_delta_chunked, gated_delta_steps

from support.native import kernels_or_skip
from support.native_graph import Graph, both, native_and_oracle, random_f32

kernels_or_skip()

from llmfw.plugins.backends.native import program as pg  # noqa: E402

f32 = random_f32(34)


@pytest.fixture(scope="module")
def backends():
    yield from native_and_oracle()


def conv_case(n_seqs: int = 3, n_tokens: int = 5, n_ch: int = 24, keep: int = 3) -> tuple[Graph, dict]:
    g = Graph()
    window, x = g.input(f32(n_seqs, keep, n_ch)), g.input(f32(n_seqs, n_tokens, n_ch))
    kernel = g.weight("conv", f32(n_ch, keep + 1))
    return g, {"conv": g.op("ssm_conv", window, x, kernel, out=(n_seqs, n_tokens, n_ch)),
               "window": g.op("conv_window", window, x, out=(n_seqs, keep, n_ch))}


@pytest.mark.parametrize("n_tokens", [1, 2, 7])  # fewer tokens than the window keeps, and more
def test_short_convolution_and_its_window_match_the_oracle(backends, n_tokens):
    g, outs = conv_case(n_tokens=n_tokens)
    got, expected = both(g, outs["conv"], backends)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    got, expected = both(g, outs["window"], backends)
    assert np.array_equal(got, expected)  # a copy of rows


def scan_case(n_seqs: int, n_tokens: int, n_head: int = 4, dim: int = 8, d_state: int = 16,
              n_group: int = 2) -> tuple[Graph, object, list[np.ndarray]]:
    values = [f32(n_seqs, n_head, dim, d_state), f32(n_seqs, n_tokens, n_head, dim),
              f32(n_seqs, n_tokens, n_head, scale=8.0),  # some dt above 20: softplus passes them through
              -np.abs(f32(n_head)), f32(n_seqs, n_tokens, n_group, d_state), f32(n_seqs, n_tokens, n_group, d_state)]
    g = Graph()
    out = g.op("ssm_scan", *(g.input(v) for v in values),
               out=(n_seqs, n_tokens * n_head * dim + n_head * dim * d_state))
    return g, out, values


def test_ssm_scan_matches_the_oracle(backends):
    g, out, _ = scan_case(n_seqs=3, n_tokens=9)
    got, expected = both(g, out, backends)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def delta_case(n_seqs: int, n_tokens: int, n_head: int = 4, n_head_k: int = 2, dv: int = 8,
               dk: int = 16) -> tuple[Graph, object, list[np.ndarray]]:
    q, k = (f32(n_seqs, n_tokens, n_head_k, dk, scale=0.25) for _ in range(2))  # about unit norm, as l2-normed
    values = [f32(n_seqs, n_head, dv, dk), q, k, f32(n_seqs, n_tokens, n_head, dv),
              -np.abs(f32(n_seqs, n_tokens, n_head, scale=0.3)),  # g: log-decays
              1.0 / (1.0 + np.exp(-f32(n_seqs, n_tokens, n_head))).astype(np.float32)]  # beta in (0, 1)
    g = Graph()
    out = g.op("gated_delta", *(g.input(v) for v in values),
               out=(n_seqs, n_tokens * n_head * dv + n_head * dv * dk))
    return g, out, values


@pytest.mark.parametrize("n_tokens", [1, 9, 70])
def test_gated_delta_matches_both_forms_of_the_oracle(backends, n_tokens):
    """The kernel steps token by token; the oracle takes chunks past 64 tokens: the same values up to rounding."""
    g, out, values = delta_case(n_seqs=2, n_tokens=n_tokens)
    got = g.run(backends[0], out)
    np.testing.assert_allclose(got, gated_delta_steps(*values), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, gated_delta_chunked(*values), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", [scan_case, delta_case])
def test_a_sequence_has_the_same_bits_alone_beside_others_and_on_any_thread_count(backends, case):
    native = backends[0]
    g, out, values = case(n_seqs=3, n_tokens=6)
    together = g.run(native, out)
    for s in range(3):
        alone = Graph()
        rows = [np.ascontiguousarray(v[s:s + 1]) if v.shape[0] == 3 else v for v in values]  # A is per head
        alone_out = alone.op(out.op, *(alone.input(v) for v in rows), out=(1, out.shape[1]))
        for n_threads in (1, 16):
            native.set_n_threads(n_threads)
            assert np.array_equal(alone.run(native, alone_out)[0], together[s]), (s, n_threads)
    native.set_n_threads(2)


def test_operands_that_do_not_fit_are_refused_at_compile_time(backends):
    g = Graph()
    window, x = g.input(f32(2, 3, 8)), g.input(f32(2, 4, 8))
    out = g.op("ssm_conv", window, x, g.weight("narrow", f32(8, 3)), out=(2, 4, 8))  # width 3, window of 3 rows
    with pytest.raises(ModelError, match="kernel of shape"):
        g.run(backends[0], out)


@pytest.mark.parametrize("op,n,reason", [
    (pg.SSM_SCAN, [1, 2, 3, 2, 4, 4], "3 heads over 2 groups"),
    (pg.SSM_SCAN, [1, 2, 4, 0, 4, 4], "4 heads over 0 groups"),
    (pg.GATED_DELTA, [1, 2, 4, 0, 4, 4], "over 0 groups or key heads"),
    (pg.GATED_DELTA, [1, 8, 4, 2, 4, 4], "operand 0 spans"),
    (pg.SSM_CONV, [2, 8, 16, 3], "operand 0 spans"),
    (pg.CONV_WINDOW, [2, 1, 8, -3], "out of range"),
])
def test_a_recurrent_instruction_that_reaches_outside_its_buffers_is_refused(op, n, reason):
    args = [pg.Operand(0, 0)] * 6
    with pytest.raises(pg.ProgramError, match=reason):
        pg.Program([pg.Instr(op, args, n)], 128, [], [], [], [])
