"""Graph IR → ONNX: one split becomes one ONNX model (ops in the default and com.microsoft domains).

One model serves a split structure for every ubatch size and every KV length: token counts and ``n_kv`` are
dynamic axes (the graph's reshapes use ``-1`` for the token axis).

A residual ``add`` read by an RMS norm becomes ``SkipSimplifiedLayerNormalization`` (sum and norm in one kernel;
the sum is its 4th output for the later residual).

The KV cache, RoPE and attention (op by op, or fused into GroupQueryAttention) are :mod:`.attention`, the
MoE ops :mod:`.moe` and the recurrent ones :mod:`.recurrent`, each mixed into :class:`SplitTranslator`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from llmfw.core.exec.backend import Split
from llmfw.core.exec.compiler import SplitCompilerBase
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import DYNAMIC, Node, Shape
from llmfw.plugins.backends.onnx.attention import AttentionTranslation
# the attention scores' slicing, importable from here as before it moved out
from llmfw.plugins.backends.onnx.attention import (SCORE_SLICE as SCORE_SLICE, score_rows as score_rows,
                                                   score_slice as score_slice)
from llmfw.plugins.backends.onnx.emit import (
    ONNX_BOOL, ONNX_FLOAT, ONNX_INT32, OPSET, Emitter, external_tensor_proto, kv_name, live_nodes,
)
from llmfw.plugins.backends.onnx.fused import USE_GQA, AttentionForm, fusable_rope, kv_cells
from llmfw.plugins.backends.onnx.moe import MoeTranslation
from llmfw.plugins.backends.onnx.ort import OnnxKV, import_onnxruntime
from llmfw.plugins.backends.onnx.recurrent import RecurrentTranslation
from llmfw.plugins.backends.onnx.scans import ScanTranslation
from llmfw.plugins.backends.onnx.weights import F32, BlockWeight, DenseWeight, Weight


class OnnxWeightSource(Protocol):
    """What translating reads of the backend (:class:`~llmfw.plugins.backends.onnx.runtime.OnnxBackend`)."""

    accuracy_level: int

    @property
    def pads_one_row_products(self) -> bool: ...

    def weight(self, name: str) -> Weight: ...

    def dense_copy(self, name: str) -> np.ndarray: ...

    def transposed(self, name: str) -> np.ndarray: ...

    def offsets_transposed(self, key: str, weight: BlockWeight) -> np.ndarray: ...

    def derived(self, name: str, kind: str, make: Callable[[], np.ndarray]) -> np.ndarray: ...

# ---------------------------------------------------------------------------------------------------------------
# split → ONNX model
# ---------------------------------------------------------------------------------------------------------------

class SplitTranslator(AttentionTranslation, MoeTranslation, RecurrentTranslation, ScanTranslation,
                      SplitCompilerBase[OnnxKV]):
    """Translates one split into ONNX nodes. The IR's node shapes (those of the first run's graph) guide choices
    that do not depend on the token count or the KV length (head sizes, rotated dims); the model itself keeps
    those axes dynamic. The op dispatch and the KV look-up are the core's
    :class:`~llmfw.core.exec.compiler.SplitCompilerBase` (its slots go unused: values are ONNX names here)."""

    backend_name = "onnx"
    kv_class = OnnxKV

    def __init__(self, backend: OnnxWeightSource, split: Split, inputs: Sequence[np.ndarray],
                 kv: Mapping[tuple[str, int], Any], attention: AttentionForm = "op"):
        import_onnxruntime()
        from onnx import helper, numpy_helper

        super().__init__(split, kv)
        self.backend = backend
        self.attention = attention
        #: rank of the cache tensors the model binds: GroupQueryAttention reads them as [1, Hkv, n_cells, D]
        self.kv_rank = 3 if attention == "op" else 4
        #: rope nodes only the op-by-op branch of a fused attention reads (GQA rotates their inputs itself)
        self._deferred_ropes: set[int] = set()
        #: rms_norm node id → the add it is fused with (SkipSimplifiedLayerNormalization), and its output name
        self._skip_norms: dict[int, Node] = {}
        self._fused_outputs: dict[int, str] = {}
        self.e = Emitter(helper, numpy_helper)
        self.names: dict[int, str] = {}
        #: the arrays' shapes of the split's inputs: they fill in the IR's DYNAMIC dimensions (see :meth:`shape`)
        self.input_shapes: dict[int, Shape] = {}
        self.graph_inputs: list[Any] = []
        self.graph_outputs: list[Any] = []
        self.kv_bindings: list[tuple[str, str, tuple[str, int], str]] = []
        #: mask input node id → the graph input of the cells its attentions gather (see groups.py), and the KV
        #: storages they read (the cells are gathered in blocks that divide their sizes)
        self.cell_inputs: dict[int, str] = {}
        self.cell_caches: dict[int, set[tuple[str, int]]] = {}
        self._kv_current: dict[tuple[tuple[str, int], str], str] = {}
        self._in_branch = False
        #: the node lists of the graphs around the If branch being built
        self._outer_nodes: list[list[Any]] = []
        self._shared: dict[tuple, Any] = {}
        self._last_kv_writer: dict[tuple[tuple[str, int], str], int] = {}
        self._kv_declared: set[str] = set()
        for node_id, array in zip(split.input_ids, inputs):
            name = f"in_{node_id}"
            self.names[node_id] = name
            self.input_shapes[node_id] = array.shape
            dims = [f"{name}_d{i}" for i in range(array.ndim)]
            self.graph_inputs.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(array.dtype), dims))
        if attention == "switch":
            self.graph_inputs.append(helper.make_tensor_value_info(USE_GQA, ONNX_BOOL, []))

    # -- driving -----------------------------------------------------------------------------------------
    def translate(self) -> tuple[Any, list[str]]:
        """The ONNX model of the split and the names of its outputs (split.output_ids order)."""
        self._mark_last_kv_writers()
        self._find_skip_norms()
        self._find_deferred_ropes()
        for node in self.split.nodes:
            self._translate_node(node)
        output_names = self._declare_outputs()
        return self._assemble(), output_names

    def _mark_last_kv_writers(self) -> None:
        """The last node writing each cache tensor names its ScatterND output as the bound graph output."""
        for node in self.split.nodes:
            if node.op in ("attention", "k_shift"):
                key = (node.attrs["cache"], int(node.attrs["layer"]))
                for which in ("k", "v") if node.op == "attention" else ("k",):
                    self._last_kv_writer[(key, which)] = node.id

    def _find_skip_norms(self) -> None:
        """``rms_norm(add(a, b), w)`` with a, b and the sum of one shape: the add emits both (see
        :meth:`_skip_norm`). The first such norm of an add is fused; the add's sum stays a value of its own."""
        inside = {n.id for n in self.split.nodes}
        taken: set[int] = set()
        for node in self.split.nodes:
            if node.op != "rms_norm" or len(node.inputs) != 2:
                continue
            x, w = node.inputs
            if x.op != "add" or x.id not in inside or x.id in taken or w.op != "weight" or x.shape is None:
                continue
            if len(x.shape) != 2 or any(i.shape != x.shape for i in x.inputs) or w.shape != x.shape[-1:]:
                continue
            self._skip_norms[x.id] = node
            taken.add(x.id)

    def _find_deferred_ropes(self) -> None:
        """The q/k ropes of the fused attentions that GQA applies itself: emitted inside the op-by-op branch only,
        so a GQA batch does not compute them."""
        if self.attention == "op":
            return
        readers: dict[int, int] = {}
        for node in self.split.nodes:
            for i in node.inputs:
                readers[i.id] = readers.get(i.id, 0) + 1
        outputs = set(self.split.output_ids)
        for node in self.split.nodes:
            if node.op == "attention" and fusable_rope(node, self._n_cells(node)) is not None:
                for rope in node.inputs[:2]:
                    if readers.get(rope.id) == 1 and rope.id not in outputs:
                        self._deferred_ropes.add(rope.id)

    def _n_cells(self, node: Node) -> int:
        storage = self.kv.get((node.attrs["cache"], int(node.attrs["layer"])))
        return kv_cells(storage)

    def _translate_node(self, node: Node) -> None:
        if node.op == "weight" or node.id in self._deferred_ropes:  # emitted by their consumers
            return
        fused = self._fused_outputs.pop(node.id, None)
        if fused is not None:  # computed by an earlier fused node
            self.names[node.id] = fused
            return
        self.names[node.id] = self.op_handler(node)(node)

    def _declare_outputs(self) -> list[str]:
        helper = self.e.helper
        output_names = []
        dtypes = {node.id: node.dtype for node in self.split.nodes}
        for node_id in self.split.output_ids:
            name = f"out_{node_id}"
            self.e.nodes.append(helper.make_node("Identity", [self.names[node_id]], [name]))
            output_names.append(name)
            elem = ONNX_INT32 if dtypes.get(node_id) == "i32" else ONNX_FLOAT  # expert ids (top_k) are int32
            self.graph_outputs.append(helper.make_tensor_value_info(name, elem, None))
        for (key, which), current in self._kv_current.items():
            # the last update's own output is the graph output: bound to the input's buffer, ScatterND skips
            # its copy (an Identity here would copy the whole cache)
            self.graph_outputs.append(helper.make_tensor_value_info(current, ONNX_FLOAT, None))
            self.kv_bindings.append((kv_name(key, which), current, key, which))
        return output_names

    def _assemble(self) -> Any:
        helper = self.e.helper
        initializers = list(self.e.constants)
        initializers += [external_tensor_proto(name, array) for name, array in self.e.externals.items()]
        nodes = live_nodes(self.e.nodes, [output.name for output in self.graph_outputs])
        graph = helper.make_graph(nodes, "llmfw_split", self.graph_inputs, self.graph_outputs,
                                  initializer=initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                        helper.make_opsetid("com.microsoft", 1)],
                                  producer_name="llmfw")
        model.ir_version = min(model.ir_version, 10)  # what ORT ≥ 1.17 reads
        return model

    def value(self, node: Node) -> str:
        if node.id in self.names:
            return self.names[node.id]
        if node.op == "weight":
            return self.dense(node.attrs["name"])
        if node.id in self._deferred_ropes:  # inside the op-by-op branch of its attention (its only reader)
            return self._op_rope(node)
        raise ModelError(f"onnx backend: value of node {node!r} is not available to its split")

    def shape(self, node: Node) -> Shape:
        """The IR's shape of a value; a DYNAMIC dimension of a split input is the size its array has now."""
        if node.shape is None:
            raise ModelError(f"onnx backend: node {node!r} is untyped (build graphs with Graph.leaf / Graph.add)")
        actual = self.input_shapes.get(node.id)
        if actual is None:
            return node.shape
        if len(actual) != len(node.shape):
            raise ModelError(f"onnx backend: input {node!r} got an array of shape {list(actual)}")
        return tuple(got if dim == DYNAMIC else dim for dim, got in zip(node.shape, actual))

    def known_dim(self, node: Node, axis: int) -> int:
        """A dimension an emitted op depends on (head count, head size): the IR must know it."""
        dim = self.shape(node)[axis]
        if dim == DYNAMIC:
            raise ModelError(f"onnx backend: node {node!r} needs a known size on axis {axis}")
        return dim

    # -- weights -----------------------------------------------------------------------------------------
    def dense(self, name: str) -> str:
        weight = self.backend.weight(name)
        if isinstance(weight, DenseWeight):
            return self.e.external(f"w:{name}", weight.array)
        # a quantized table used elementwise (unusual): hand over its float values once
        return self.e.external(f"w:{name}", self.backend.dense_copy(name))

    # -- ops ---------------------------------------------------------------------------------------------
    def _op_mul_mat(self, node: Node) -> str:
        w_node, x_node = node.inputs
        x, x_shape = self.value(x_node), self.shape(x_node)
        if w_node.op != "weight":
            # activation × activation (no current architecture emits it): x @ w.T
            return self.e.op("MatMul", [x, self.e.op("Transpose", [self.value(w_node)], perm=[1, 0])])
        return self.matmul_weight(x, x_shape, w_node.attrs["name"])

    def matmul_weight(self, x: str, x_shape: Shape, name: str) -> str:
        """``x @ W.T`` for the backend weight ``name`` (a dense matrix or MatMulNBits blocks)."""
        weight = self.backend.weight(name)
        if isinstance(weight, DenseWeight):
            if len(x_shape) == 2:  # Gemm reads W [n_out, n_in] as it is: no transposed copy
                return self.e.op("Gemm", [x, self.e.external(f"w:{name}", weight.array)], transB=1, hint="mm")
            wt = self.e.external(f"wt:{name}", self.backend.transposed(name))
            return self.e.op("MatMul", [x, wt], hint="mm")
        return self._matmul_nbits(x, x_shape, name, weight)

    def _matmul_nbits(self, x: str, x_shape: Shape, key: str, weight: BlockWeight) -> str:
        """The block product; where this CPU's one-row kernel rounds otherwise than the many-row one (rows.py), a
        row of ones is appended to a 2-D input and its result dropped, so that every product runs on the
        many-row kernel and a token's logits do not depend on the batch it came in."""
        n_out, n_in = weight.shape
        if x_shape[-1] not in (n_in, DYNAMIC):
            raise ModelError(f"onnx backend: mul_mat of {key} expects inputs with {n_in} columns, got {x_shape}")
        # a session serves every row count (the IR's is the first run's), so a 2-D input always gets the row
        padded = len(x_shape) == 2 and self.backend.pads_one_row_products
        if padded:
            x = self.e.op("Concat", [x, self.e.const(np.ones((1, n_in)), np.float32)], axis=0, hint="rows")
        out = self._block_product(x, x_shape, key, weight)
        if padded:
            out = self.e.op("Slice", [out, self.e.const([0]), self.e.const([-1]), self.e.const([0])], hint="mmq")
        return out

    def _block_product(self, x: str, x_shape: Shape, key: str, weight: BlockWeight) -> str:
        n_out, n_in = weight.shape
        b = self.e.external(f"q:{key}", weight.packed)
        s = self.e.external(f"s:{key}", weight.scales)
        out = self.e.op("MatMulNBits", [x, b, s], domain="com.microsoft", hint="mmq", K=n_in, N=n_out,
                        bits=weight.bits, block_size=weight.block, accuracy_level=self.backend.accuracy_level)
        if weight.offsets is None:
            return out
        # per-block offsets: W = codes*scales + offsets ⇒ x @ W.T += blocksum(x) @ offsets.T, the block sums a
        # ReduceSum over x seen as [..., n_blocks, block]: a node more than one MatMul by a 0/1 matrix, yet the
        # decode step is faster (docs/benchmarks.md, generation)
        blocked = self.e.op("Reshape", [x, self.e.const([0] * (len(x_shape) - 1) + [weight.n_blocks, weight.block])])
        sums = self.e.op("ReduceSum", [blocked, self.e.const([-1])], keepdims=0, hint="blocksum")
        offsets_t = self.e.external(f"oT:{key}", self.backend.offsets_transposed(key, weight))
        if len(x_shape) == 2:  # one Gemm: sums @ offsets.T + out
            return self.e.op("Gemm", [sums, offsets_t, out], hint="mmq")
        return self.e.op("Add", [out, self.e.op("MatMul", [sums, offsets_t])], hint="mmq")

    def _op_get_rows(self, node: Node) -> str:
        table, ids = node.inputs
        ids_name = self.value(ids)
        if table.op != "weight":
            return self.e.op("Gather", [self.value(table), ids_name], axis=0)
        name = table.attrs["name"]
        weight = self.backend.weight(name)
        if isinstance(weight, DenseWeight):
            return self.e.op("Gather", [self.e.external(f"w:{name}", weight.array), ids_name], axis=0)
        if weight.codes is None:
            raise ModelError(f"onnx backend: {name} was loaded for mul_mat only, but the graph looks up its rows")
        n_in = weight.shape[1]
        codes = self.e.op("Cast", [self.e.op("Gather", [self.e.external(f"c:{name}", weight.codes), ids_name],
                                              axis=0)], to=ONNX_FLOAT)
        blocked = self.e.op("Reshape", [codes, self.e.const([-1, weight.n_blocks, weight.block])])
        scales = self.e.op("Gather", [self.e.external(f"s:{name}", weight.scales), ids_name], axis=0)
        scales = self.e.op("Reshape", [scales, self.e.const([-1, weight.n_blocks, 1])])
        rows = self.e.op("Mul", [blocked, scales])
        if weight.offsets is not None:
            offsets = self.e.op("Gather", [self.e.external(f"o:{name}", weight.offsets), ids_name], axis=0)
            rows = self.e.op("Add", [rows, self.e.op("Reshape", [offsets, self.e.const([-1, weight.n_blocks, 1])])])
        out_shape = self.e.op("Concat", [self.e.op("Shape", [ids_name]), self.e.const([n_in])], axis=0)
        return self.e.op("Reshape", [rows, out_shape], hint="rows")

    def _binary(self, node: Node, op_type: str) -> str:
        a, b = node.inputs
        return self.e.op(op_type, [self.value(a), self.value(b)])

    def _op_add(self, node: Node) -> str:
        norm = self._skip_norms.get(node.id)
        if norm is not None:
            return self._skip_norm(node, norm)
        return self._binary(node, "Add")

    def _skip_norm(self, add: Node, norm: Node) -> str:
        """SkipSimplifiedLayerNormalization: outputs 0 (the norm's value, kept for the norm node) and 3 (the sum,
        this add's value)."""
        a, b = add.inputs
        normed, total = self.e.fresh("skip_norm"), self.e.fresh("residual")
        self.e.nodes.append(self.e.helper.make_node(
            "SkipSimplifiedLayerNormalization", [self.value(a), self.value(b), self.value(norm.inputs[1])],
            [normed, "", "", total], domain="com.microsoft", epsilon=float(norm.attrs["eps"])))
        self._fused_outputs[norm.id] = normed
        return total

    def _op_sub(self, node: Node) -> str:
        return self._binary(node, "Sub")

    def _op_mul(self, node: Node) -> str:
        return self._binary(node, "Mul")

    def _unary(self, node: Node, op_type: str, *extra: str, **attrs: Any) -> str:
        (x,) = node.inputs
        return self.e.op(op_type, [self.value(x), *extra], **attrs)

    def _op_scale(self, node: Node) -> str:
        return self._unary(node, "Mul", self.e.const(node.attrs["s"], F32))

    def _op_silu(self, node: Node) -> str:
        (x,) = node.inputs
        xv = self.value(x)
        return self.e.op("Mul", [xv, self.e.op("Sigmoid", [xv])], hint="silu")

    def _op_relu(self, node: Node) -> str:
        return self._unary(node, "Relu")

    def _op_gelu(self, node: Node) -> str:
        # com.microsoft FastGelu is exactly ggml's tanh approximation 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))
        return self._unary(node, "FastGelu", domain="com.microsoft")

    def _op_softcap(self, node: Node) -> str:
        (x,) = node.inputs
        return self._softcap(self.value(x), float(node.attrs["cap"]))

    def _softcap(self, x: str, cap: float) -> str:
        squashed = self.e.op("Tanh", [self.e.op("Mul", [x, self.e.const(1.0 / cap, F32)])])
        return self.e.op("Mul", [squashed, self.e.const(cap, F32)], hint="softcap")

    def _op_clamp(self, node: Node) -> str:
        return self._unary(node, "Clip", self.e.const(node.attrs["min"], F32), self.e.const(node.attrs["max"], F32))

    def _op_rms_norm(self, node: Node) -> str:
        # the canonical pattern (Pow, ReduceMean, Add, Sqrt, Div) that ORT fuses into SimplifiedLayerNormalization
        x = node.inputs[0]
        xv = self.value(x)
        mean_sq = self.e.op("ReduceMean", [self.e.op("Pow", [xv, self.e.const(2.0, F32)])], axes=[-1], keepdims=1)
        rms = self.e.op("Sqrt", [self.e.op("Add", [mean_sq, self.e.const(node.attrs["eps"], F32)])])
        return self._times_norm_weight(node, self.e.op("Div", [xv, rms], hint="rms_norm"))

    def _times_norm_weight(self, node: Node, normed: str) -> str:
        """× the norm's weight, the optional 2nd input the core pass folded in (ORT fuses the whole pattern)."""
        return self.e.op("Mul", [normed, self.value(node.inputs[1])]) if len(node.inputs) > 1 else normed

    def _op_norm(self, node: Node) -> str:
        x = node.inputs[0]
        xv = self.value(x)
        centred = self.e.op("Sub", [xv, self.e.op("ReduceMean", [xv], axes=[-1], keepdims=1)])
        var = self.e.op("ReduceMean", [self.e.op("Pow", [centred, self.e.const(2.0, F32)])], axes=[-1], keepdims=1)
        std = self.e.op("Sqrt", [self.e.op("Add", [var, self.e.const(node.attrs["eps"], F32)])])
        return self._times_norm_weight(node, self.e.op("Div", [centred, std], hint="norm"))

    def _op_reshape(self, node: Node) -> str:
        (x,) = node.inputs
        shape = tuple(int(d) for d in node.attrs["shape"])
        return self.e.op("Reshape", [self.value(x), self.e.const(shape)])

    def _op_slice(self, node: Node) -> str:
        (x,) = node.inputs
        axis = int(node.attrs.get("axis", -1))
        start, stop = node.attrs.get("start"), node.attrs.get("stop")
        big = np.iinfo(np.int64).max
        return self.e.op("Slice", [self.value(x), self.e.const([0 if start is None else start]),
                                   self.e.const([big if stop is None else stop]), self.e.const([axis])])

    # -- values shared by every layer of a split (computed once per run) -----------------------------------
    def shared(self, key: tuple, make: Callable[[], Any]) -> Any:
        value = self._shared.get(key)
        if value is None:
            value = self._shared[key] = make()
        return value
