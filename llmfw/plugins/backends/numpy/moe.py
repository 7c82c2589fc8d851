"""The numpy backend's mixture-of-experts kernels (the oracle of core/ir/ops.py's MoE ops) and their steps."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from llmfw.core.ir.graph import Node
from llmfw.plugins.backends.numpy.kernels import F32
from llmfw.plugins.backends.numpy.weights import QuantizedExperts

Step = Callable[[], None]


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis (ggml sums the exponentials in double)."""
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    out: np.ndarray = (shifted / shifted.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(F32)
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        out: np.ndarray = (F32(1.0) / (F32(1.0) + np.exp(-x))).astype(F32, copy=False)
    return out


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of each row, largest first (ties: the lower index first)."""
    return np.argsort(-x, axis=-1, kind="stable")[..., :k].astype(np.int32)


def id_mask(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    out = np.full(x.shape, -np.inf, dtype=F32)
    np.put_along_axis(out, ids.astype(np.intp), F32(0.0), axis=-1)
    return out


def mul_mat_id(w: "np.ndarray | QuantizedExperts", x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Row (t, j) = ``x[t(, j)] @ w[ids[t, j]].T``: one matmul per expert over the rows that chose it, so only
    the chosen experts' matrices are read (and, kept quantized, decoded)."""
    n_tokens, n_used = ids.shape
    out = np.empty((n_tokens, n_used, w.shape[1]), dtype=F32)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    bounds = list(starts[1:]) + [flat.size]
    for expert, start, stop in zip(experts, starts, bounds):
        slots = order[start:stop]
        tokens, used = np.divmod(slots, n_used)
        rows = x[tokens] if x.ndim == 2 else x[tokens, used]
        out[tokens, used] = rows @ w[int(expert)].T
    return out


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    g = np.minimum(gate, F32(limit))
    u = np.clip(up, F32(-limit), F32(limit))
    out: np.ndarray = (g * sigmoid(F32(alpha) * g) * (u + F32(1.0))).astype(F32, copy=False)
    return out


class MoeSteps:
    """The numpy split compiler's steps for the MoE ops (mixed into
    :class:`~llmfw.plugins.backends.numpy.compiler.SplitCompiler`, which provides ``_unary`` / ``_binary`` and
    the value slots ``env``)."""

    env: list[Any]

    def _unary(self, fn: Callable[[np.ndarray], np.ndarray], ins: list[int], out: int) -> Step:
        raise NotImplementedError

    def _binary(self, fn: Callable[[np.ndarray, np.ndarray], np.ndarray], ins: list[int], out: int) -> Step:
        raise NotImplementedError

    def _op_softmax(self, node: Node, ins: list[int], out: int) -> Step:
        return self._unary(softmax, ins, out)

    def _op_sigmoid(self, node: Node, ins: list[int], out: int) -> Step:
        return self._unary(sigmoid, ins, out)

    def _op_div(self, node: Node, ins: list[int], out: int) -> Step:
        return self._binary(np.divide, ins, out)

    def _op_sum_rows(self, node: Node, ins: list[int], out: int) -> Step:
        return self._unary(lambda x: x.sum(axis=-1, keepdims=True, dtype=np.float64).astype(F32), ins, out)

    def _op_top_k(self, node: Node, ins: list[int], out: int) -> Step:
        k = node.attr_int("k")
        return self._unary(lambda x: top_k(x, k), ins, out)

    def _op_take(self, node: Node, ins: list[int], out: int) -> Step:
        return self._binary(lambda x, ids: np.take_along_axis(x, ids.astype(np.intp), axis=-1), ins, out)

    def _op_id_mask(self, node: Node, ins: list[int], out: int) -> Step:
        return self._binary(id_mask, ins, out)

    def _op_mul_mat_id(self, node: Node, ins: list[int], out: int) -> Step:
        env = self.env
        w_slot, x_slot, ids_slot = ins

        def step() -> None:
            env[out] = mul_mat_id(env[w_slot], env[x_slot], np.asarray(env[ids_slot]))

        return step

    def _op_add_id(self, node: Node, ins: list[int], out: int) -> Step:
        env = self.env
        a_slot, b_slot, ids_slot = ins

        def step() -> None:
            env[out] = env[a_slot] + env[b_slot][np.asarray(env[ids_slot], dtype=np.intp)]

        return step

    def _op_concat(self, node: Node, ins: list[int], out: int) -> Step:
        return self._binary(lambda a, b: np.concatenate([a, b], axis=-1), ins, out)

    def _op_mul_mat_heads(self, node: Node, ins: list[int], out: int) -> Step:
        """[T, H, n_in] by [H, n_out, n_in]: one batched matmul over the heads."""
        return self._binary(lambda w, x: np.matmul(x.transpose(1, 0, 2), w.transpose(0, 2, 1)).transpose(1, 0, 2),
                            ins, out)

    def _op_swiglu_oai(self, node: Node, ins: list[int], out: int) -> Step:
        alpha, limit = node.attr_float("alpha"), node.attr_float("limit")
        return self._binary(lambda g, u: swiglu_oai(g, u, alpha, limit), ins, out)
