"""The numpy backend's recurrent-layer ops (issue 34): the oracle for every other backend. Pure functions of
float32 arrays plus the compiler steps that call them (:class:`RecurrentSteps`, mixed into the split compiler)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from llmfw.core.ir.graph import Node

F32 = np.float32


def conv_input(window: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``concat(window, x)`` along the time axis: [S, K-1 + T, C]."""
    return np.concatenate([window.astype(F32, copy=False), x.astype(F32, copy=False)], axis=1)


def ssm_conv(window: np.ndarray, x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """The short causal depthwise convolution of each sequence: ``out[s, t, c] = Σ_k xx[s, t + k, c] · w[c, k]``
    with ``xx = concat(window, x)`` (ggml_ssm_conv sums the K products in order k = 0, 1, ... in float32)."""
    xx = conv_input(window, x)
    n_tokens, width = x.shape[1], kernel.shape[1]
    out: np.ndarray = xx[:, 0:n_tokens, :] * kernel[:, 0]
    for k in range(1, width):
        out += xx[:, k:k + n_tokens, :] * kernel[:, k]
    return out


def conv_window(window: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The window the next ubatch carries: the last K-1 rows of ``concat(window, x)``."""
    keep = window.shape[1]
    return np.ascontiguousarray(conv_input(window, x)[:, x.shape[1]:x.shape[1] + keep, :]) if keep else window


def softplus(x: np.ndarray) -> np.ndarray:
    """ggml's softplus: ``log(1 + exp(x))``, ``x`` itself above 20."""
    x = x.astype(F32, copy=False)
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(F32)


def ssm_scan(state: np.ndarray, x: np.ndarray, dt: np.ndarray, a: np.ndarray, b: np.ndarray,
             c: np.ndarray) -> np.ndarray:
    """Mamba-2's selective scan over each sequence's tokens (see the op table): returns, per sequence, y [T, H, P]
    then the final state [H, P, N], flattened into one row."""
    n_seqs, n_tokens, n_head, head_dim = x.shape
    n_group = b.shape[2]
    group = np.arange(n_head) // (n_head // n_group)  # the group each head reads (repeat_interleave)
    s = state.astype(F32, copy=True)
    y = np.empty(x.shape, dtype=F32)
    d = softplus(dt)  # [S, T, H]
    decay = np.exp(d * a.reshape(-1)).astype(F32)  # [S, T, H]
    for t in range(n_tokens):
        bt, ct = b[:, t][:, group], c[:, t][:, group]  # [S, H, N]
        xdt = x[:, t] * d[:, t, :, None]  # [S, H, P]
        s = s * decay[:, t, :, None, None] + xdt[..., None] * bt[:, :, None, :]
        y[:, t] = np.einsum("shpn,shn->shp", s, ct, dtype=F32)
    return np.concatenate([y.reshape(n_seqs, -1), s.reshape(n_seqs, -1)], axis=1)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype(F32, copy=False)))).astype(F32)


#: tokens per chunk of the chunked gated delta rule (llama.cpp's chunk size for Gated DeltaNet)
DELTA_CHUNK = 64


def gated_delta(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                beta: np.ndarray) -> np.ndarray:
    """The gated delta rule over each sequence's tokens (see the op table): per sequence, o [T, H, Dv] then the
    final state [H, Dv, Dk], flattened into one row. Prompts longer than a chunk take the chunked form
    (:func:`gated_delta_chunked`), shorter ones the step-by-step recurrence (:func:`gated_delta_steps`)."""
    if v.shape[1] > DELTA_CHUNK:
        return gated_delta_chunked(state, q, k, v, g, beta)
    return gated_delta_steps(state, q, k, v, g, beta)


def _per_value_head(q: np.ndarray, n_head: int) -> np.ndarray:
    """q or k [S, T, Hk, Dk] with value head h reading q/k head ``h % Hk`` (llama.cpp tiles them): [S, T, H, Dk]."""
    return q[:, :, np.arange(n_head) % q.shape[2]].astype(F32, copy=False)


def gated_delta_steps(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                      beta: np.ndarray) -> np.ndarray:
    """:func:`gated_delta` one token at a time, every head and sequence at once."""
    n_seqs, n_tokens, n_head, d_v = v.shape
    q, k = _per_value_head(q, n_head), _per_value_head(k, n_head)
    m = state.astype(F32, copy=True)
    out = np.empty(v.shape, dtype=F32)
    decay = np.exp(g.astype(F32, copy=False)).astype(F32)
    scale = F32(1.0 / np.sqrt(d_v))
    for t in range(n_tokens):
        qt, kt = q[:, t], k[:, t]  # [S, H, Dk]
        m *= decay[:, t, :, None, None]
        delta = (v[:, t] - np.einsum("shvk,shk->shv", m, kt, dtype=F32)) * beta[:, t, :, None]
        m += delta[..., None] * kt[:, :, None, :]
        out[:, t] = np.einsum("shvk,shk->shv", m, qt, dtype=F32) * scale
    return np.concatenate([out.reshape(n_seqs, -1), m.reshape(n_seqs, -1)], axis=1)


def gated_delta_chunked(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                        beta: np.ndarray, chunk: int = DELTA_CHUNK) -> np.ndarray:
    """:func:`gated_delta` a chunk of tokens at a time: the same values up to rounding, in matrix products.

    Within a chunk, with ``G_t`` the running sum of ``g`` from its start and ``M0`` the state before it, the
    state after token t is ``e^{G_t} M0 + Σ_{i≤t} e^{G_t - G_i} δ_i k_iᵀ``. Putting that into
    ``δ_t = β_t (v_t - e^{g_t} M_{t-1} k_t)`` gives one unit lower-triangular system for all the chunk's δ:
    ``(I + A) Δ = β·V - β·e^{G}·(K M0ᵀ)`` with ``A[t, i] = β_t e^{G_t - G_i} k_t·k_i`` (i < t); then
    ``o_t = (e^{G_t} M0 q_t + Σ_{i≤t} e^{G_t - G_i} (k_i·q_t) δ_i) / √Dv`` and the next chunk starts from
    ``e^{G_C} M0 + Σ_i e^{G_C - G_i} δ_i k_iᵀ``."""
    n_seqs, n_tokens, n_head, d_v = v.shape
    # [S, H, T, D] and [S, H, T]: a chunk's rows are then one matrix per head
    q, k = (_per_value_head(x, n_head).transpose(0, 2, 1, 3) for x in (q, k))
    v = v.astype(F32, copy=False).transpose(0, 2, 1, 3)
    g, beta = (x.astype(F32, copy=False).transpose(0, 2, 1) for x in (g, beta))
    m = state.astype(F32, copy=True)  # [S, H, Dv, Dk]
    out = np.empty((n_seqs, n_head, n_tokens, d_v), dtype=F32)
    scale = F32(1.0 / np.sqrt(d_v))
    for lo in range(0, n_tokens, chunk):
        hi = min(lo + chunk, n_tokens)
        out[:, :, lo:hi], m = _delta_chunk(m, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], g[:, :, lo:hi],
                                           beta[:, :, lo:hi], scale)
    return np.concatenate([out.transpose(0, 2, 1, 3).reshape(n_seqs, -1), m.reshape(n_seqs, -1)], axis=1)


def _delta_chunk(m: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                 scale: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of :func:`gated_delta_chunked`: its outputs [S, H, C, Dv] and the state after it."""
    n = v.shape[2]
    cum = np.cumsum(g, axis=-1, dtype=F32)  # G_t [S, H, C]
    causal, below = np.tril(np.ones((n, n), dtype=bool)), np.tril(np.ones((n, n), dtype=bool), -1)
    # e^{G_t - G_i} for i ≤ t, 0 above the diagonal (masked before exp: the upper differences may overflow)
    decays = np.exp(np.where(causal, cum[..., :, None] - cum[..., None, :], -np.inf)).astype(F32)
    kk = k @ k.swapaxes(-1, -2)  # k_t · k_i [S, H, C, C]
    system = np.eye(n, dtype=F32) + np.where(below, beta[..., :, None] * decays * kk, 0).astype(F32)
    start = np.exp(cum)[..., None]  # e^{G_t} [S, H, C, 1]
    rhs = beta[..., None] * (v - start * (k @ m.swapaxes(-1, -2)))
    delta = np.linalg.solve(system, rhs).astype(F32)  # Δ [S, H, C, Dv]
    qk = q @ k.swapaxes(-1, -2) * decays  # (k_i · q_t) e^{G_t - G_i}, i ≤ t
    out = (start * (q @ m.swapaxes(-1, -2)) + qk @ delta) * scale
    last = np.exp(cum[..., -1:, None] - cum[..., :, None]) * delta  # e^{G_C - G_i} δ_i [S, H, C, Dv]
    m = np.exp(cum[..., -1])[..., None, None] * m + last.swapaxes(-1, -2) @ k
    return out.astype(F32), m.astype(F32)


class RecurrentSteps:
    """Compiler steps of the recurrent ops (see :class:`llmfw.plugins.backends.numpy.compiler.SplitCompiler`)."""

    env: list[Any]

    def _nary(self, fn: Callable[..., np.ndarray], ins: list[int], out: int) -> Callable[[], None]:
        env = self.env

        def step() -> None:
            env[out] = fn(*(env[i] for i in ins))

        return step

    def _op_ssm_conv(self, node: "Node", ins: list[int], out: int) -> Callable[[], None]:
        return self._nary(ssm_conv, ins, out)

    def _op_conv_window(self, node: "Node", ins: list[int], out: int) -> Callable[[], None]:
        return self._nary(conv_window, ins, out)

    def _op_ssm_scan(self, node: "Node", ins: list[int], out: int) -> Callable[[], None]:
        return self._nary(ssm_scan, ins, out)

    def _op_gated_delta(self, node: "Node", ins: list[int], out: int) -> Callable[[], None]:
        return self._nary(gated_delta, ins, out)

    def _op_sigmoid(self, node: "Node", ins: list[int], out: int) -> Callable[[], None]:
        return self._nary(sigmoid, ins, out)

    def _op_softplus(self, node: "Node", ins: list[int], out: int) -> Callable[[], None]:
        return self._nary(softplus, ins, out)
