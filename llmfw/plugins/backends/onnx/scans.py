"""ONNX translation of the recurrent ops with a time loop (issue 34): ``ssm_scan`` (Mamba-2's selective scan) and
``gated_delta`` (the gated delta rule), mixed into :class:`.translate.SplitTranslator`.

The carried state arrives as an ordinary split input and leaves in the op's packed output (the memory gathers and
scatters it, see :mod:`llmfw.core.runtime.recurrent`), as on numpy. Everything that does not depend on the state
(the decays, ``x · dt``, the heads each group or q/k head feeds) is computed for the whole ubatch first; only the
state update itself runs token by token, in an ONNX ``Scan`` over the time axis whose carried value is the
state of every sequence and head at once. Each step is the numpy oracle's (:mod:`..numpy.recurrent`): the
elementwise decay and outer product, the state-vector products as ``MatMul`` over [.., D, 1] columns.

A ``gated_delta`` over more than ``DELTA_CHUNK`` tokens (a prompt) takes numpy's chunked form instead
(``gated_delta_chunked``): every chunk's unit lower-triangular system solved at once by forward substitution
(a ``Loop`` over the chunk's rows), then a ``Scan`` over the chunks. The IR's token count picks the form; each
form is right for any count, so a session reused for another count still computes the op.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from llmfw.plugins.backends.numpy.recurrent import DELTA_CHUNK
from llmfw.plugins.backends.onnx.emit import ONNX_BOOL, ONNX_FLOAT, ONNX_INT64, Emitter

if TYPE_CHECKING:
    from llmfw.core.ir.graph import Node

#: the time axis of the ops' [S, T, ...] operands
_TIME = 1
#: a Scan step: (the carried state, this token's slices of the scan inputs) → (new state, this token's outputs)
Step = Callable[[str, Sequence[str]], tuple[str, Sequence[str]]]


class ScanTranslation:
    """``_op_ssm_scan`` and ``_op_gated_delta`` (see the op table in :mod:`llmfw.core.ir.graph`)."""

    e: Emitter

    def value(self, node: "Node") -> str:
        raise NotImplementedError  # provided by SplitTranslator

    def known_dim(self, node: "Node", axis: int) -> int:
        raise NotImplementedError  # provided by SplitTranslator

    # -- the ops -------------------------------------------------------------------------------------------
    def _op_ssm_scan(self, node: "Node") -> str:
        state, x, dt, a, b, c = node.inputs
        n_head, n_group = self.known_dim(state, 1), self.known_dim(b, 2)
        d = self.e.op("Softplus", [self.value(dt)])  # [S, T, H]; see _op_softplus on ggml's threshold
        decay = self.e.op("Exp", [self.e.op("Mul", [d, self.e.op("Reshape", [self.value(a), self.e.const([-1])])])])
        xdt = self.e.op("Mul", [self.value(x), self._unsqueeze(d, -1)], hint="xdt")  # [S, T, H, P]
        group = np.arange(n_head) // (n_head // n_group)  # the group each head reads
        b_rows = self._unsqueeze(self._heads(self.value(b), group), -2)  # [S, T, H, 1, N]
        c_cols = self._unsqueeze(self._heads(self.value(c), group), -1)  # [S, T, H, N, 1]

        def step(s: str, now: Sequence[str]) -> tuple[str, Sequence[str]]:
            decay_t, xdt_t, b_t, c_t = now
            s = self.e.op("Add", [self.e.op("Mul", [s, decay_t]), self.e.op("Mul", [xdt_t, b_t])], hint="ssm")
            return s, [self.e.op("MatMul", [s, c_t], hint="ssm_y")]  # [S, H, P, 1]

        inputs = [self._unsqueeze(decay, [-1, -2]), self._unsqueeze(xdt, -1), b_rows, c_cols]
        final, (y,) = self._scan(self.value(state), inputs, step)
        return self._packed(y, final)

    def _op_gated_delta(self, node: "Node") -> str:
        state, q, k, v, g, beta = node.inputs
        n_head, d_v, n_k_heads = self.known_dim(state, 1), self.known_dim(state, 2), self.known_dim(q, 2)
        heads = np.arange(n_head) % n_k_heads  # llama.cpp tiles the q/k heads over the v heads
        q_h, k_h = self._heads(self.value(q), heads), self._heads(self.value(k), heads)  # [S, T, H, Dk]

        def step(m: str, now: Sequence[str]) -> tuple[str, Sequence[str]]:
            decay_t, beta_t, k_col, k_row, v_col, q_col = now
            m = self.e.op("Mul", [m, decay_t], hint="delta_decay")
            delta = self.e.op("Mul", [self.e.op("Sub", [v_col, self.e.op("MatMul", [m, k_col])]), beta_t])
            m = self.e.op("Add", [m, self.e.op("Mul", [delta, k_row])], hint="delta_state")  # δ ⊗ k
            return m, [self.e.op("MatMul", [m, q_col], hint="delta_o")]  # [S, H, Dv, 1]

        scale = self.e.const(1.0 / math.sqrt(d_v), np.float32)
        if self.known_dim(v, _TIME) > DELTA_CHUNK:  # a prompt: chunks (either form is right for any length)
            o, final = self._delta_chunks(self.value(state), q_h, k_h, self.value(v), self.value(g),
                                          self.value(beta), d_v, self.known_dim(state, 3))
            return self._packed(self.e.op("Mul", [o, scale], hint="delta_o"), final)
        inputs = [self._unsqueeze(self.e.op("Exp", [self.value(g)]), [-1, -2]),
                  self._unsqueeze(self.value(beta), [-1, -2]), self._unsqueeze(k_h, -1), self._unsqueeze(k_h, -2),
                  self._unsqueeze(self.value(v), -1), self._unsqueeze(q_h, -1)]
        final, (o,) = self._scan(self.value(state), inputs, step)
        return self._packed(self.e.op("Mul", [o, scale], hint="delta_o"), final)

    # -- the chunked gated delta rule (numpy's gated_delta_chunked, the same algebra) ------------------------
    def _delta_chunks(self, state: str, q: str, k: str, v: str, g: str, beta: str, d_v: int, d_k: int
                      ) -> tuple[str, str]:
        """o [S, T, H, Dv] (unscaled) and the final state, DELTA_CHUNK tokens at a time: the tokens padded to
        whole chunks (g = 0, k = v = β = 0 there: δ = 0, no decay), every chunk's triangular system solved at
        once, then one Scan over the chunks carrying the state."""
        e, c = self.e, DELTA_CHUNK
        n_tokens = e.op("Shape", [v], start=_TIME, end=_TIME + 1)
        pad = e.op("Mod", [e.op("Sub", [e.const([c]), e.op("Mod", [n_tokens, e.const([c])])]), e.const([c])])

        def chunked(x: str, *size: int) -> str:
            """[S, T, H, *size] → [S, H, n, C, *size], padded with zeros."""
            rank = 3 + len(size)
            pads = e.op("Concat", [e.const([0] * (rank + 1)), pad, e.const([0] * (rank - 2))], axis=0)
            heads_first = e.op("Transpose", [e.op("Pad", [x, pads])], perm=[0, 2, 1, *range(3, rank)])
            return e.op("Reshape", [heads_first, e.const([0, 0, -1, c, *size])])

        q5, k5, v5 = chunked(q, d_k), chunked(k, d_k), chunked(v, d_v)
        g4, beta5 = chunked(g), self._unsqueeze(chunked(beta), -1)
        cum = e.op("CumSum", [g4, e.const(-1)])  # G_t within each chunk [S, H, n, C]
        causal = np.tril(np.ones((c, c), dtype=bool))
        gap = e.op("Sub", [self._unsqueeze(cum, -1), self._unsqueeze(cum, -2)])
        decays = e.op("Exp", [e.op("Where", [e.const(causal, bool), gap, e.const(-np.inf, np.float32)])])
        k_t = e.op("Transpose", [k5], perm=[0, 1, 2, 4, 3])
        below = e.const(np.tril(causal, -1), bool)
        system = e.op("Where", [below, e.op("Mul", [e.op("Mul", [beta5, decays]), e.op("MatMul", [k5, k_t])]),
                                e.const(0.0, np.float32)])
        start = e.op("Exp", [self._unsqueeze(cum, -1)])  # e^{G_t} [S, H, n, C, 1]
        rhs = e.op("Concat", [e.op("Mul", [beta5, v5]), e.op("Mul", [e.op("Mul", [beta5, start]), k5])], axis=-1)
        solved = self._unit_lower_solve(system, rhs, c)
        u = e.op("Slice", [solved, e.const([0]), e.const([d_v]), e.const([-1])])
        w = e.op("Slice", [solved, e.const([d_v]), e.const([np.iinfo(np.int64).max]), e.const([-1])])
        qk = e.op("Mul", [e.op("MatMul", [q5, k_t]), decays])
        cum_last = e.op("Slice", [cum, e.const([-1]), e.const([np.iinfo(np.int64).max]), e.const([-1])])
        last = e.op("Exp", [self._unsqueeze(e.op("Sub", [cum_last, cum]), -1)])  # e^{G_C - G_t}
        end = e.op("Exp", [self._unsqueeze(cum_last, -1)])  # e^{G_C} [S, H, n, 1, 1]

        def step(m: str, now: Sequence[str]) -> tuple[str, Sequence[str]]:
            u_c, w_c, q_c, k_c, qk_c, start_c, last_c, end_c = now
            m_t = e.op("Transpose", [m], perm=[0, 1, 3, 2])
            delta = e.op("Sub", [u_c, e.op("MatMul", [w_c, m_t])])  # Δ = U - W M0ᵀ [S, H, C, Dv]
            o = e.op("Add", [e.op("Mul", [start_c, e.op("MatMul", [q_c, m_t])]), e.op("MatMul", [qk_c, delta])])
            weighted = e.op("Transpose", [e.op("Mul", [last_c, delta])], perm=[0, 1, 3, 2])
            m = e.op("Add", [e.op("Mul", [end_c, m]), e.op("MatMul", [weighted, k_c])], hint="delta_chunk_state")
            return m, [o]

        final, (o,) = self._scan(state, [u, w, q5, k5, qk, start, last, end], step, axis=2)
        flat = e.op("Reshape", [o, e.const([0, 0, -1, d_v])])  # [S, H, n·C, Dv]
        o = e.op("Slice", [flat, e.const([0]), n_tokens, e.const([2])])
        return e.op("Transpose", [o], perm=[0, 2, 1, 3]), final

    def _unit_lower_solve(self, lower: str, rhs: str, n: int) -> str:
        """X with (I + L) X = R for every chunk at once, by forward substitution (an ONNX Loop over the n rows:
        x_t = r_t - L[t] X, the rows of X after t still zero)."""
        e, helper = self.e, self.e.helper
        ones = np.eye(n, dtype=np.float32)[:, :, None]  # row t of the identity as a [n, 1] column
        outer, e.nodes = e.nodes, []
        try:
            t, cond, x = e.fresh("row"), e.fresh("cond"), e.fresh("solved")
            row = self._unsqueeze(t, 0)
            x_row = e.op("Sub", [e.op("Gather", [rhs, row], axis=-2),
                                 e.op("MatMul", [e.op("Gather", [lower, row], axis=-2), x])])
            x_next = e.op("Add", [x, e.op("Mul", [e.op("Gather", [e.const(ones, np.float32), t], axis=0), x_row])])
            cond_out = e.op("Identity", [cond])
            body = helper.make_graph(
                e.nodes, e.fresh("solve_body"),
                [helper.make_tensor_value_info(t, ONNX_INT64, []), helper.make_tensor_value_info(cond, ONNX_BOOL, []),
                 self._ranked(x, 5)],
                [helper.make_tensor_value_info(cond_out, ONNX_BOOL, []),
                 helper.make_tensor_value_info(x_next, ONNX_FLOAT, None)])
        finally:
            e.nodes = outer
        zeros = e.op("ConstantOfShape", [e.op("Shape", [rhs])],
                     value=e.numpy_helper.from_array(np.array([0.0], dtype=np.float32)))
        return e.op("Loop", [e.const(n), e.const(True, bool), zeros], hint="solve", body=body)

    # -- helpers -------------------------------------------------------------------------------------------
    def _unsqueeze(self, x: str, axes: int | list[int]) -> str:
        return self.e.op("Unsqueeze", [x, self.e.const(axes if isinstance(axes, list) else [axes])])

    def _heads(self, x: str, index: np.ndarray) -> str:
        """``x[:, :, index]``: the per-head copies of grouped operands (nothing when each head has its own)."""
        if np.array_equal(index, np.arange(len(index))):
            return x
        return self.e.op("Gather", [x, self.e.const(index)], axis=2, hint="heads")

    def _packed(self, per_token: str, final: str) -> str:
        """The op's output row per sequence: its per-token values [S, T, ...] then its final state, flattened."""
        flat = [self.e.op("Reshape", [v, self.e.const([0, -1])]) for v in (per_token, final)]
        return self.e.op("Concat", flat, axis=1, hint="scan_packed")

    def _ranked(self, name: str, rank: int) -> Any:
        """A float subgraph input of known rank (dimensions named after it)."""
        return self.e.helper.make_tensor_value_info(name, ONNX_FLOAT, [f"{name}_d{i}" for i in range(rank)])

    def _scan(self, state: str, inputs: list[str], step: Step, axis: int = _TIME) -> tuple[str, list[str]]:
        """One ONNX ``Scan`` over ``axis`` of ``inputs`` (the time axis of [S, T, ...] by default) carrying
        ``state``: the final state and each step's outputs stacked back on that axis."""
        helper = self.e.helper
        outer, self.e.nodes = self.e.nodes, []
        try:
            carried_in, now = self.e.fresh("scan_state"), [self.e.fresh("scan_now") for _ in inputs]
            new_state, outputs = step(carried_in, now)
            # a Scan output must be a value made in the body (not one of its inputs)
            carried_out = self.e.op("Identity", [new_state], hint="scan_state_out")
            body_outputs = [carried_out, *(self.e.op("Identity", [o], hint="scan_out") for o in outputs)]
            # ORT needs the rank of the body's values (the state and every slice are 4-D in each use here)
            body = helper.make_graph(
                self.e.nodes, self.e.fresh("scan_body"),
                [self._ranked(name, 4) for name in (carried_in, *now)],
                [helper.make_tensor_value_info(name, ONNX_FLOAT, None) for name in body_outputs])
        finally:
            self.e.nodes = outer
        results: Any = self.e.op("Scan", [state, *inputs], n_outputs=1 + len(outputs), hint="scan", body=body,
                                 num_scan_inputs=len(inputs), scan_input_axes=[axis] * len(inputs),
                                 scan_output_axes=[axis] * len(outputs))
        return results[0], list(results[1:])
