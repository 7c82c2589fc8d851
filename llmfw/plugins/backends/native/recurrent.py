"""The native compiler's steps for the recurrent ops (issue 34; the kernels are csrc/recurrent.c): the short
convolution and its carried window, Mamba-2's selective scan and the gated delta rule. The carried states are
graph inputs and outputs (the recurrent memory gathers and scatters the rows of the ubatch's sequences), so they
live in the arena like any activation. Each function is a method of
:class:`~llmfw.plugins.backends.native.compiler.NativeCompiler` (assigned there as ``_op_<op>``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import Node
import llmfw.plugins.backends.native.program as pg

if TYPE_CHECKING:
    from llmfw.plugins.backends.native.compiler import NativeCompiler, Value


def _float_values(c: "NativeCompiler", node: Node) -> list["Value"]:
    values = [c.v(i) for i in node.inputs]
    if any(v.dtype != "f32" for v in values):
        raise ModelError(f"native backend: {node.op} of {node!r} needs float32 operands")
    return values


def _conv_shape(node: Node, window: "Value", x: "Value") -> list[int]:
    """S, T, C, K-1 of a carried window [S, K-1, C] and a ubatch [S, T, C]."""
    if len(window.shape) != 3 or len(x.shape) != 3 or window.shape[::2] != x.shape[::2]:
        raise ModelError(f"native backend: {node.op} of a window {window.shape} and an input {x.shape}")
    return [x.shape[0], x.shape[1], x.shape[2], window.shape[1]]


def compile_ssm_conv(c: "NativeCompiler", node: Node) -> None:
    window, x, kernel = _float_values(c, node)
    n = _conv_shape(node, window, x)
    if kernel.size != n[2] * (n[3] + 1):
        raise ModelError(f"native backend: a convolution kernel of shape {kernel.shape} for {n[2]} channels of "
                         f"width {n[3] + 1}")
    out = c.define(node)
    c.emit(pg.SSM_CONV, [out.operand, window.operand, x.operand, kernel.operand], n, label="ssm_conv")


def compile_conv_window(c: "NativeCompiler", node: Node) -> None:
    window, x = _float_values(c, node)
    n = _conv_shape(node, window, x)
    out = c.define(node)
    c.emit(pg.CONV_WINDOW, [out.operand, window.operand, x.operand], n, label="conv_window")


def _packed(c: "NativeCompiler", first: "Value", second: "Value") -> "Value":
    """A temporary arena value holding ``first`` then ``second``: two same-shaped operands as one (an instruction
    has six operands; the scans read seven)."""
    temp = c.new_value((first.size + second.size,), "f32")
    for at, value in ((0, first), (first.size, second)):
        c.emit(pg.SLICE, [pg.Operand(0, temp.off + at), value.operand], [1, value.size, 0, value.size],
               label="pack")
    return temp


def compile_ssm_scan(c: "NativeCompiler", node: Node) -> None:
    state, x, dt, a, b, cc = _float_values(c, node)
    if len(state.shape) != 4 or len(x.shape) != 4 or len(b.shape) != 4 or b.shape != cc.shape:
        raise ModelError(f"native backend: ssm_scan of state {state.shape}, x {x.shape}, B {b.shape}, C {cc.shape}")
    n_seqs, n_head, dim, d_state = state.shape
    n_tokens, n_group = x.shape[1], b.shape[2]
    if x.shape != (n_seqs, n_tokens, n_head, dim) or dt.size != n_seqs * n_tokens * n_head or a.size != n_head \
            or b.shape != (n_seqs, n_tokens, n_group, d_state):
        raise ModelError(f"native backend: ssm_scan operands disagree: state {state.shape}, x {x.shape}, dt "
                         f"{dt.shape}, A {a.shape}, B/C {b.shape}")
    bc = _packed(c, b, cc)
    out = c.define(node)
    c.emit(pg.SSM_SCAN, [out.operand, state.operand, x.operand, dt.operand, a.operand, bc.operand],
           [n_seqs, n_tokens, n_head, dim, d_state, n_group], label="ssm_scan")
    c.release(bc)


def compile_gated_delta(c: "NativeCompiler", node: Node) -> None:
    state, q, k, v, g, beta = _float_values(c, node)
    if len(state.shape) != 4 or len(q.shape) != 4 or q.shape != k.shape or len(v.shape) != 4:
        raise ModelError(f"native backend: gated_delta of state {state.shape}, q/k {q.shape}, v {v.shape}")
    n_seqs, n_head, dv, dk = state.shape
    n_tokens, n_head_k = v.shape[1], q.shape[2]
    if v.shape != (n_seqs, n_tokens, n_head, dv) or q.shape != (n_seqs, n_tokens, n_head_k, dk) \
            or g.size != n_seqs * n_tokens * n_head or beta.size != g.size:
        raise ModelError(f"native backend: gated_delta operands disagree: state {state.shape}, q/k {q.shape}, v "
                         f"{v.shape}, g {g.shape}, beta {beta.shape}")
    g_beta = _packed(c, g, beta)
    out = c.define(node)
    c.emit(pg.GATED_DELTA, [out.operand, state.operand, q.operand, k.operand, v.operand, g_beta.operand],
           [n_seqs, n_tokens, n_head, n_head_k, dv, dk], label="gated_delta")
    c.release(g_beta)
