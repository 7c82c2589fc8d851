"""ONNX translation of the recurrent ops with a time loop (issue 34): ``ssm_scan`` (Mamba-2's selective scan) and
``gated_delta`` (the gated delta rule), mixed into :class:`.translate.SplitTranslator`.

The carried state arrives as an ordinary split input and leaves in the op's packed output (the memory gathers and
scatters it, see :mod:`llmfw.core.runtime.recurrent`), as on numpy. Everything that does not depend on the state
(the decays, ``x · dt``, the heads each group or q/k head feeds) is computed for the whole ubatch first; only the
state update itself runs token by token, in an ONNX ``Scan`` over the time axis whose carried value is the
state of every sequence and head at once. Each step is the numpy oracle's (:mod:`..numpy.recurrent`): the
elementwise decay and outer product, the state-vector products as ``MatMul`` over [.., D, 1] columns.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from llmfw.plugins.backends.onnx.emit import ONNX_FLOAT, Emitter

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

        inputs = [self._unsqueeze(self.e.op("Exp", [self.value(g)]), [-1, -2]),
                  self._unsqueeze(self.value(beta), [-1, -2]), self._unsqueeze(k_h, -1), self._unsqueeze(k_h, -2),
                  self._unsqueeze(self.value(v), -1), self._unsqueeze(q_h, -1)]
        final, (o,) = self._scan(self.value(state), inputs, step)
        scaled = self.e.op("Mul", [o, self.e.const(1.0 / math.sqrt(d_v), np.float32)], hint="delta_o")
        return self._packed(scaled, final)

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

    def _scan(self, state: str, inputs: list[str], step: Step) -> tuple[str, list[str]]:
        """One ONNX ``Scan`` over the time axis of ``inputs`` ([S, T, ...] each) carrying ``state``: the final
        state and each per-token output of ``step`` stacked back on the time axis."""
        helper = self.e.helper
        outer, self.e.nodes = self.e.nodes, []
        try:
            carried_in, now = self.e.fresh("scan_state"), [self.e.fresh("scan_now") for _ in inputs]
            new_state, outputs = step(carried_in, now)
            # a Scan output must be a value made in the body (not one of its inputs)
            carried_out = self.e.op("Identity", [new_state], hint="scan_state_out")
            body_outputs = [carried_out, *(self.e.op("Identity", [o], hint="scan_out") for o in outputs)]
            body = helper.make_graph(
                self.e.nodes, self.e.fresh("scan_body"),
                [helper.make_tensor_value_info(name, ONNX_FLOAT, None) for name in (carried_in, *now)],
                [helper.make_tensor_value_info(name, ONNX_FLOAT, None) for name in body_outputs])
        finally:
            self.e.nodes = outer
        results: Any = self.e.op("Scan", [state, *inputs], n_outputs=1 + len(outputs), hint="scan", body=body,
                                 num_scan_inputs=len(inputs), scan_input_axes=[_TIME] * len(inputs),
                                 scan_output_axes=[_TIME] * len(outputs))
        return results[0], list(results[1:])
