"""The building blocks of a split's ONNX model: the node emitter, split signatures, external initializers."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from llmfw.core.backend import Split

#: ONNX opset of the default domain; com.microsoft ops are version 1
OPSET = 17
#: ONNX element types used in the graphs (constants here: the module must import without onnx)
ONNX_FLOAT, ONNX_INT64 = 1, 7  # onnx.TensorProto.FLOAT, INT64


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

    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._counter)}"

    def op(self, op_type: str, inputs: Sequence[str], n_outputs: int = 1, domain: str = "",
           hint: str | None = None, **attrs: Any) -> Any:
        outputs = [self.fresh(hint or op_type.lower()) for _ in range(n_outputs)]
        self.nodes.append(self.helper.make_node(op_type, list(inputs), outputs, domain=domain or None, **attrs))
        return outputs[0] if n_outputs == 1 else outputs

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        """A small constant initializer embedded in the model (deduplicated)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        name = self._const_cache.get(key)
        if name is None:
            name = self._const_cache[key] = self.fresh("c")
            self.constants.append(self.numpy_helper.from_array(array, name))
        return name

    def external(self, name: str, array: np.ndarray) -> str:
        """A weight initializer whose bytes are handed to the session, not serialized."""
        self.externals[name] = array
        return name


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
