"""The native compiler's steps for the recurrent ops (issue 34; the kernels are csrc/recurrent.c): the short
convolution and its carried window, Mamba-2's selective scan and the gated delta rule. The carried states are
graph inputs and outputs (the recurrent memory gathers and scatters the rows of the ubatch's sequences), so they
live in the arena like any activation. Each function is a method of
:class:`~llmfw.plugins.backends.native.compiler.NativeCompiler` (assigned there as ``_op_<op>``)."""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import Node
import llmfw.plugins.backends.native.program as pg


class ArenaValue(Protocol):
    """What these steps read of a compiler value (compiler.Value)."""

    shape: tuple[int, ...]
    dtype: str
    off: int

    @property
    def size(self) -> int: ...

    @property
    def operand(self) -> pg.Operand: ...


class ProgramBuilder(Protocol):
    """What these steps use of the compiler (compiler.NativeCompiler, which imports this module)."""

    def v(self, node: Node) -> ArenaValue: ...

    def define(self, node: Node) -> ArenaValue: ...

    def new_value(self, shape: tuple[int, ...], dtype: str) -> ArenaValue: ...

    def release(self, value: Any) -> None: ...

    def emit(self, op: int, args: Sequence[pg.Operand], n: Sequence[int] = (), f: Sequence[float] = (),
             label: str = "") -> None: ...


def _float_values(c: ProgramBuilder, node: Node) -> list[ArenaValue]:
    values = [c.v(i) for i in node.inputs]
    if any(v.dtype != "f32" for v in values):
        raise ModelError(f"native backend: {node.op} of {node!r} needs float32 operands")
    return values


def _conv_shape(node: Node, window: ArenaValue, x: ArenaValue) -> list[int]:
    """S, T, C, K-1 of a carried window [S, K-1, C] and a ubatch [S, T, C]."""
    if len(window.shape) != 3 or len(x.shape) != 3 or window.shape[::2] != x.shape[::2]:
        raise ModelError(f"native backend: {node.op} of a window {window.shape} and an input {x.shape}")
    return [x.shape[0], x.shape[1], x.shape[2], window.shape[1]]


def compile_ssm_conv(c: ProgramBuilder, node: Node) -> None:
    window, x, kernel = _float_values(c, node)
    n = _conv_shape(node, window, x)
    if kernel.size != n[2] * (n[3] + 1):
        raise ModelError(f"native backend: a convolution kernel of shape {kernel.shape} for {n[2]} channels of "
                         f"width {n[3] + 1}")
    out = c.define(node)
    c.emit(pg.SSM_CONV, [out.operand, window.operand, x.operand, kernel.operand], n, label="ssm_conv")


def compile_conv_window(c: ProgramBuilder, node: Node) -> None:
    window, x = _float_values(c, node)
    n = _conv_shape(node, window, x)
    out = c.define(node)
    c.emit(pg.CONV_WINDOW, [out.operand, window.operand, x.operand], n, label="conv_window")


def _emit_scan(c: ProgramBuilder, node: Node, op: int, values: list[ArenaValue], n: list[int]) -> None:
    """A scan over (state, three inputs, a pair of same-sized inputs) with n = S, T, H, shared heads, rows and
    columns of a head's state (program.scan_operand_words). The pair goes as one operand (an instruction has six
    operands; the scans read seven): a temporary arena value holding the first, then the second."""
    first, second = values[-2:]
    sizes = [v.size for v in values[:-2]] + [first.size + second.size]
    if sizes != pg.scan_operand_words(op, n)[1:] or first.size != second.size:
        raise ModelError(f"native backend: {node.op} operands of shapes {[v.shape for v in values]} disagree")
    pair = c.new_value((first.size + second.size,), "f32")
    for at, value in ((0, first), (first.size, second)):
        c.emit(pg.SLICE, [pg.Operand(0, pair.off + at), value.operand], [1, value.size, 0, value.size],
               label="pack")
    out = c.define(node)
    c.emit(op, [out.operand, *(v.operand for v in values[:-2]), pair.operand], n, label=node.op)
    c.release(pair)


def _four_dims(node: Node, *values: ArenaValue) -> None:
    if any(len(v.shape) != 4 for v in values):
        raise ModelError(f"native backend: {node.op} of shapes {[v.shape for v in values]}")


def compile_ssm_scan(c: ProgramBuilder, node: Node) -> None:
    values = _float_values(c, node)
    state, x, b = values[0], values[1], values[4]
    _four_dims(node, state, x, b)
    n_seqs, n_head, dim, d_state = state.shape
    _emit_scan(c, node, pg.SSM_SCAN, values, [n_seqs, x.shape[1], n_head, b.shape[2], dim, d_state])


def compile_gated_delta(c: ProgramBuilder, node: Node) -> None:
    values = _float_values(c, node)
    state, q = values[0], values[1]
    _four_dims(node, state, q)
    n_seqs, n_head, dv, dk = state.shape
    _emit_scan(c, node, pg.GATED_DELTA, values, [n_seqs, q.shape[1], n_head, q.shape[2], dv, dk])
