"""ONNX translation of the recurrent-layer ops (issue 34), mixed into :class:`.translate.SplitTranslator`.

The carried state arrives as an ordinary split input and leaves as an ordinary output (the memory gathers and
scatters it, see :mod:`llmfw.core.runtime.recurrent`), so these are plain functional ONNX subgraphs: ``Concat`` the window
before the ubatch, then one ``Slice`` × kernel column per tap, summed in tap order like the numpy oracle."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from llmfw.core.ir.graph import Node

#: Slice's "to the end"
_END = int(np.iinfo(np.int64).max)
#: the time axis of [S, T, C]
_TIME = 1


class RecurrentTranslation:
    """``_op_ssm_conv``, ``_op_conv_window``, ``_op_sigmoid``, ``_op_softplus`` (see the op table in
    :mod:`llmfw.core.ir.graph`)."""

    e: Any

    def value(self, node: "Node") -> str: ...  # provided by SplitTranslator

    def known_dim(self, node: "Node", axis: int) -> int: ...  # provided by SplitTranslator

    def _time_slice(self, x: str, start: int, stop: int) -> str:
        return self.e.op("Slice", [x, self.e.const([start]), self.e.const([stop]), self.e.const([_TIME])])

    def _conv_input(self, node: "Node") -> str:
        window, x = node.inputs[:2]
        return self.e.op("Concat", [self.value(window), self.value(x)], axis=_TIME, hint="conv_in")

    def _op_ssm_conv(self, node: "Node") -> str:
        kernel = node.inputs[2]
        width = self.known_dim(kernel, 1)
        xx, w = self._conv_input(node), self.value(kernel)
        out = ""
        for k in range(width):
            stop = k - (width - 1)  # tap k reads rows k .. k + T - 1 of the K-1+T rows
            rows = self._time_slice(xx, k, stop if stop < 0 else _END)
            tap = self.e.op("Gather", [w, self.e.const(k)], axis=1, hint="conv_tap")  # column k: [C]
            term = self.e.op("Mul", [rows, tap])
            out = term if not out else self.e.op("Add", [out, term], hint="conv")
        return out

    def _op_conv_window(self, node: "Node") -> str:
        keep = self.known_dim(node.inputs[0], 1)
        if keep == 0:
            return self.value(node.inputs[0])
        return self._time_slice(self._conv_input(node), -keep, _END)

    def _op_sigmoid(self, node: "Node") -> str:
        return self.e.op("Sigmoid", [self.value(node.inputs[0])])

    def _op_softplus(self, node: "Node") -> str:
        # ONNX's Softplus has no threshold: above 20, log(1 + exp(x)) and x agree in float32 anyway
        return self.e.op("Softplus", [self.value(node.inputs[0])])
