"""The building blocks of a split's ONNX model: the node emitter, split signatures, external initializers."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from llmfw.core.exec.backend import Split

#: ONNX opset of the default domain; com.microsoft ops are version 1
OPSET = 17
#: ONNX element types used in the graphs (constants here: the module must import without onnx)
ONNX_FLOAT, ONNX_INT32, ONNX_INT64, ONNX_BOOL = 1, 6, 7, 9  # onnx.TensorProto.FLOAT, INT32, INT64, BOOL


@dataclass
class Emitter:
    """Accumulates ONNX nodes, small constants and external weights while a split is translated."""

    helper: Any
    numpy_helper: Any
    nodes: list[Any] = field(default_factory=list)
    constants: list[Any] = field(default_factory=list)
    externals: dict[str, np.ndarray] = field(default_factory=dict)
    _counter: Any = field(default_factory=itertools.count)
    _const_cache: dict[tuple, str] = field(default_factory=dict)
    _const_values: dict[str, np.ndarray] = field(default_factory=dict)
    #: a Reshape's output → its input: a reshape of a reshape reads the first one's input instead
    _reshaped_from: dict[str, str] = field(default_factory=dict)
    #: a value → the constant shape it was reshaped to (or keeps, see :meth:`keeps_shape`)
    _shape_of: dict[str, str] = field(default_factory=dict)

    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._counter)}"

    def op(self, op_type: str, inputs: Sequence[str], n_outputs: int = 1, domain: str = "",
           hint: str | None = None, **attrs: Any) -> Any:
        if op_type == "Reshape" and not domain:
            return self._reshape(inputs[0], inputs[1], hint)
        outputs = [self.fresh(hint or op_type.lower()) for _ in range(n_outputs)]
        self.nodes.append(self.helper.make_node(op_type, list(inputs), outputs, domain=domain or None, **attrs))
        return outputs[0] if n_outputs == 1 else outputs

    def _reshape(self, x: str, shape: str, hint: str | None) -> str:
        """A Reshape node, unless ``x`` already has that constant shape (then ``x`` itself)."""
        x = self._reshape_source(x, shape)
        if self._shape_of.get(x) == shape:
            return x
        out = self.fresh(hint or "reshape")
        self.nodes.append(self.helper.make_node("Reshape", [x, shape], [out]))
        self._reshaped_from[out] = x
        if shape in self._const_values and self._const_values[shape].all():
            self._shape_of[out] = shape
        return out

    def keeps_shape(self, out: str, of: str) -> None:
        """``out`` has the shape of ``of`` (an elementwise op's output): a Reshape to it is then a no-op."""
        if of in self._shape_of:
            self._shape_of[out] = self._shape_of[of]

    def _reshape_source(self, x: str, shape: str) -> str:
        """Reshape(Reshape(a, s1), s2) is Reshape(a, s2) when s2 is a constant without 0 (ONNX's "copy this
        dimension of the input", which would refer to the intermediate shape); the intermediate is then dead
        unless something else reads it (see :func:`live_nodes`)."""
        target = self._const_values.get(shape)
        if target is None or not target.all():
            return x
        return self._reshaped_from.get(x, x)

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        """A small constant initializer embedded in the model (deduplicated)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        name = self._const_cache.get(key)
        if name is None:
            name = self._const_cache[key] = self.fresh("c")
            self.constants.append(self.numpy_helper.from_array(array, name))
            self._const_values[name] = array
        return name

    def external(self, name: str, array: np.ndarray) -> str:
        """A weight initializer whose bytes are handed to the session, not serialized."""
        self.externals[name] = array
        return name


def live_nodes(nodes: Sequence[Any], outputs: Sequence[str]) -> list[Any]:
    """The nodes (topological order) that the graph outputs depend on: every op emitted here is side-effect
    free (the cache updates are graph outputs), so the others are dropped."""
    needed = set(outputs)
    live = []
    for node in reversed(nodes):
        if not needed.isdisjoint(node.output):
            live.append(node)
            needed.update(node.input)
            if node.op_type in _CONTROL_FLOW:
                needed.update(_branch_reads(node))
    return live[::-1]


#: the ONNX ops with subgraphs (attributes of type GRAPH) that read values of the outer graph
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def _branch_reads(node: Any) -> set[str]:
    """Every name the subgraphs of a control-flow node (If) read: outer values they use (a superset)."""
    names: set[str] = set()
    for attribute in node.attribute:
        if attribute.HasField("g"):
            for inner in attribute.g.node:
                names.update(inner.input)
                names.update(_branch_reads(inner))
    return names


def freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    return value


def split_signature(split: Split, inputs: Sequence[np.ndarray]) -> tuple:
    """A hashable key equal for two splits that translate to the same ONNX model: ops, wiring, attributes,
    weight names and input dtypes/ranks — not token counts or KV lengths (dynamic axes)."""
    local: dict[int, Any] = {nid: ("in", k) for k, nid in enumerate(split.input_ids)}
    items = []
    for k, node in enumerate(split.nodes):
        local[node.id] = k
        items.append((node.op, tuple(local.get(i.id, ("ext", i.op, i.attrs.get("name"))) for i in node.inputs),
                      freeze(node.attrs)))
    return (tuple(items), tuple(local[i] for i in split.output_ids),
            tuple((a.dtype.str, a.ndim) for a in inputs))



def kv_name(key: tuple[str, int], which: str) -> str:
    return f"kv_{which}_{key[0]}_{key[1]}"


def external_tensor_proto(name: str, array: np.ndarray) -> Any:
    """An initializer declared with EXTERNAL data; its bytes come from add_external_initializers."""
    from onnx import TensorProto, helper

    proto = TensorProto()
    proto.name = name
    proto.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
    proto.dims.extend(array.shape)
    proto.data_location = TensorProto.EXTERNAL
    entry = proto.external_data.add()
    entry.key, entry.value = "location", "llmfw-in-memory"
    return proto
