"""The onnx backend's mixture-of-experts: expert weights prepared once at load, and the MoE ops in ONNX.

Expert matrices. A 3-D ``*_exps`` tensor [E, n_out, n_in] is split at load into E ordinary 2-D weights named
``<name>@<e>``, each converted exactly like a dense layer's matrix (MatMulNBits blocks for quantized types, float32
for float ones; see weights.py) and stored in the converted-weight cache like any other weight. No dequantized
float copy of the experts is made, and nothing is converted per token.

``mul_mat_id`` is a sorted dispatch (what llama.cpp's CPU kernel does too): the T*K (token, slot) pairs are
ordered by expert with one TopK, the activation rows gathered in that order, each expert multiplies its
contiguous run of rows (a Slice whose bounds come from the per-expert counts; an expert nobody chose gets zero
rows), and the results are put back in (token, slot) order with one Gather. Only the chosen experts' rows are
computed. The order, counts and inverse permutation depend only on the expert ids, so the three expert
matmuls of a layer share them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from llmfw.core.exec.backend import WeightSource
from llmfw.core.ir.graph import Node, Shape
from llmfw.core.format.quants import tensor_nbytes
from llmfw.plugins.backends.onnx.emit import ONNX_INT32, ONNX_INT64, Emitter
from llmfw.plugins.backends.onnx.weights import F32

if TYPE_CHECKING:
    from llmfw.plugins.backends.onnx.weights import Weight


@dataclass(frozen=True)
class ExpertWeights:
    """The handle of a 3-D expert tensor: the names of its E per-expert 2-D weights (held by the backend)."""

    shape: tuple[int, int, int]
    names: tuple[str, ...]


def expert_name(name: str, expert: int) -> str:
    return f"{name}@{expert}"


def expert_sources(source: WeightSource) -> list[WeightSource]:
    """One 2-D :class:`WeightSource` per expert of a 3-D tensor: its bytes are a contiguous slice of the tensor's
    (ggml stores expert after expert), used as a matmul weight."""
    n_in, n_out, n_expert = (int(d) for d in source.ne)
    step = tensor_nbytes(source.ggml_type, (n_in, n_out))
    return [WeightSource(expert_name(source.name, e), expert_name(source.source_name, e), source.ggml_type,
                         (n_in, n_out), source.raw[e * step:(e + 1) * step], frozenset({"mul_mat"}))
            for e in range(n_expert)]


def is_expert_source(source: WeightSource) -> bool:
    return "mul_mat_id" in source.usage and len(source.ne) == 3


def load_experts(source: WeightSource, load: Callable[[WeightSource], "Weight"],
                 store: Callable[[str, "Weight"], None]) -> ExpertWeights:
    """Convert each expert with ``load`` (through the cache) and ``store`` it under its own name."""
    names = []
    for part in expert_sources(source):
        store(part.name, load(part))
        names.append(part.name)
    n_in, n_out, n_expert = (int(d) for d in source.ne)
    return ExpertWeights((n_expert, n_out, n_in), tuple(names))


class MoeTranslation:
    """The MoE ops of :class:`~llmfw.plugins.backends.onnx.translate.SplitTranslator` (mixed into it; it provides
    the emitter ``e``, ``value``, ``shape``, ``shared``, ``backend`` and ``matmul_weight``)."""

    e: Emitter
    backend: Any

    def value(self, node: Node) -> str:
        raise NotImplementedError

    def shape(self, node: Node) -> Shape:
        raise NotImplementedError

    def shared(self, key: tuple, make: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def matmul_weight(self, x: str, x_shape: Shape, name: str) -> str:
        raise NotImplementedError

    # -- routing -------------------------------------------------------------------------------------------
    def _op_softmax(self, node: Node) -> str:
        return self.e.op("Softmax", [self.value(node.inputs[0])], axis=-1)

    def _op_sigmoid(self, node: Node) -> str:
        return self.e.op("Sigmoid", [self.value(node.inputs[0])])

    def _op_div(self, node: Node) -> str:
        return self.e.op("Div", [self.value(node.inputs[0]), self.value(node.inputs[1])])

    def _op_sum_rows(self, node: Node) -> str:
        return self.e.op("ReduceSum", [self.value(node.inputs[0]), self.e.const([-1])], keepdims=1)

    def _op_top_k(self, node: Node) -> str:
        _, ids = self.e.op("TopK", [self.value(node.inputs[0]), self.e.const([node.attr_int("k")])], n_outputs=2,
                           axis=-1, largest=1, sorted=1)
        return self.e.op("Cast", [ids], to=ONNX_INT32, hint="topk_ids")

    def _op_take(self, node: Node) -> str:
        return self.e.op("GatherElements", [self.value(node.inputs[0]), self.value(node.inputs[1])], axis=-1)

    def _op_id_mask(self, node: Node) -> str:
        x, ids = (self.value(n) for n in node.inputs)
        hidden = self.e.op("ConstantOfShape", [self.e.op("Shape", [x])],
                           value=self.e.numpy_helper.from_array(np.array([-np.inf], dtype=F32)))
        zeros = self.e.op("ConstantOfShape", [self.e.op("Shape", [ids])],
                          value=self.e.numpy_helper.from_array(np.array([0.0], dtype=F32)))
        return self.e.op("ScatterElements", [hidden, ids, zeros], axis=-1)

    def _op_add_id(self, node: Node) -> str:
        a, rows, ids = node.inputs
        return self.e.op("Add", [self.value(a), self.e.op("Gather", [self.value(rows), self.value(ids)], axis=0)])

    def _op_swiglu_oai(self, node: Node) -> str:
        alpha, limit = node.attr_float("alpha"), node.attr_float("limit")
        gate = self.e.op("Min", [self.value(node.inputs[0]), self.e.const(limit, F32)])
        up = self.e.op("Clip", [self.value(node.inputs[1]), self.e.const(-limit, F32), self.e.const(limit, F32)])
        glu = self.e.op("Mul", [gate, self.e.op("Sigmoid", [self.e.op("Mul", [gate, self.e.const(alpha, F32)])])])
        return self.e.op("Mul", [glu, self.e.op("Add", [up, self.e.const(1.0, F32)])])

    # -- DeepSeek's multi-head latent attention ----------------------------------------------------------------
    def _op_concat(self, node: Node) -> str:
        return self.e.op("Concat", [self.value(node.inputs[0]), self.value(node.inputs[1])], axis=-1)

    def _op_mul_mat_heads(self, node: Node) -> str:
        """[T, H, n_in] → [H, T, n_in] @ [H, n_in, n_out] (the weight transposed once, at its first use)."""
        w_node, x_node = node.inputs
        name = w_node.attrs["name"]
        w_t = self.backend.derived(name, "heads.T", lambda: self.backend.dense_copy(name).transpose(0, 2, 1))
        heads = self.e.op("Transpose", [self.value(x_node)], perm=[1, 0, 2])
        out = self.e.op("MatMul", [heads, self.e.external(f"wht:{name}", w_t)], hint="mm_heads")
        return self.e.op("Transpose", [out], perm=[1, 0, 2])

    # -- experts -------------------------------------------------------------------------------------------
    def _op_mul_mat_id(self, node: Node) -> str:
        w_node, x_node, ids_node = node.inputs
        experts = self.backend.weight(w_node.attrs["name"])
        assert isinstance(experts, ExpertWeights)
        n_expert, n_out, n_in = experts.shape
        dispatch = self._dispatch(self.value(ids_node), n_expert, n_used=self.shape(ids_node)[1])
        x = self.value(x_node)
        if len(self.shape(x_node)) == 3:  # one row per (token, slot): the slot order is the flat order
            rows = self.e.op("Gather", [self.e.op("Reshape", [x, self.e.const([-1, n_in])]), dispatch.order],
                             axis=0)
        else:  # one row per token, shared by its K slots
            rows = self.e.op("Gather", [x, dispatch.tokens], axis=0)
        outputs = []
        for e, name in enumerate(experts.names):
            part = self.e.op("Slice", [rows, dispatch.starts[e], dispatch.ends[e], self.e.const([0])])
            outputs.append(self.matmul_weight(part, (-1, n_in), name))
        merged = self.e.op("Concat", outputs, axis=0, hint="experts")
        restored = self.e.op("Gather", [merged, dispatch.inverse], axis=0)
        out_shape = self.e.op("Concat", [self.e.op("Shape", [self.value(ids_node)]), self.e.const([n_out])], axis=0)
        return self.e.op("Reshape", [restored, out_shape], hint="mul_mat_id")

    def _dispatch(self, ids: str, n_expert: int, n_used: int) -> "_Dispatch":
        """The (token, slot) pairs sorted by expert: their order, tokens, per-expert bounds and the inverse."""
        def make() -> _Dispatch:
            flat = self.e.op("Cast", [self.e.op("Reshape", [ids, self.e.const([-1])])], to=ONNX_INT64)
            count = self.e.op("Shape", [flat])
            slots = self.e.op("Range", [self.e.const(0), self.e.op("Squeeze", [count]), self.e.const(1)])
            # expert-major, slot-minor key: one ascending TopK sorts the pairs by expert, stably
            key = self.e.op("Add", [self.e.op("Mul", [flat, self.e.op("Squeeze", [count])]), slots])
            _, order = self.e.op("TopK", [key, count], n_outputs=2, axis=0, largest=0, sorted=1)
            tokens = self.e.op("Div", [order, self.e.const(n_used)])
            chosen = self.e.op("Equal", [self.e.op("Unsqueeze", [flat, self.e.const([1])]),
                                         self.e.const(np.arange(n_expert)[None, :])])
            counts = self.e.op("ReduceSum", [self.e.op("Cast", [chosen], to=ONNX_INT64), self.e.const([0])],
                               keepdims=0)
            ends = self.e.op("CumSum", [counts, self.e.const(0)])
            starts = self.e.op("Sub", [ends, counts])
            inverse = self.e.op("ScatterElements", [slots, order, slots], axis=0, hint="unsort")
            bounds = [(self.e.op("Slice", [starts, self.e.const([e]), self.e.const([e + 1])]),
                       self.e.op("Slice", [ends, self.e.const([e]), self.e.const([e + 1])])) for e in range(n_expert)]
            return _Dispatch(order, tokens, [s for s, _ in bounds], [t for _, t in bounds], inverse)
        dispatch: _Dispatch = self.shared(("moe_dispatch", ids, n_expert), make)
        return dispatch


@dataclass(frozen=True)
class _Dispatch:
    order: str
    tokens: str
    starts: list[str]
    ends: list[str]
    inverse: str


__all__ = ["ExpertWeights", "MoeTranslation", "expert_name", "expert_sources", "is_expert_source", "load_experts"]
