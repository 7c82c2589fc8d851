"""Graph IR → ONNX: one split becomes one ONNX model (ops in the default and com.microsoft domains).

The KV cache of a layer is a pair of float32 arrays ``[n_head_kv, n_cells, head_dim]``. The ``attention`` node
writes the ubatch's K/V rows with ``ScatterND`` whose input and output are bound (IOBinding) to the *same*
buffer, so ONNX Runtime updates the cache in place — no cache-sized copy per token.

One model serves a split structure for every ubatch size and every KV length: token counts and ``n_kv`` are
dynamic axes (the graph's reshapes use ``-1`` for the token axis).

The attention form (``attention``, see :mod:`.fused`): ``"op"`` translates it op by op; ``"gqa"`` makes each
``attention`` one ``GroupQueryAttention`` (a model for the batches whose cells are one causal run); with
``"switch"`` each ``attention`` is an ``If`` on the graph input ``use_gqa``:
one ``GroupQueryAttention`` whose past and present K/V are the cache's own memory, seen as
``[1, Hkv, n_cells, D]``, for a batch whose cells are one causal run, else the op-by-op attention over the same
memory — one model (one session: ORT prepacks the weights per session) for every batch. Both branches write the
cache in place: the If's cache outputs are bound to the caches' buffers, and ORT hands them to the branch.
A residual ``add`` read by an RMS norm becomes ``SkipSimplifiedLayerNormalization`` (sum and norm in one kernel;
the sum is its 4th output for the later residual).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from llmfw.core.exec.backend import Split
from llmfw.core.exec.compiler import SplitCompilerBase
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import DYNAMIC, Node, Shape
from llmfw.core.ir.rope import rope_angle_slopes
from llmfw.plugins.backends.onnx.emit import (
    ONNX_BOOL, ONNX_FLOAT, ONNX_INT32, ONNX_INT64, OPSET, Emitter, external_tensor_proto, freeze, kv_name, live_nodes,
)
from llmfw.plugins.backends.onnx.fused import USE_GQA, AttentionForm, fusable_rope, kv_cells, packed_qkv
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

#: the most key values one attention score sums in one go: MLAS's default reduction slice, which it only ever
#: widens (see :meth:`SplitTranslator._scores`)
SCORE_SLICE = 128


def score_rows(group: int) -> int:
    """The score rows per KV head and token: the query heads sharing the KV head, but at least two. MLAS runs a
    one-row product (a one-token decode with one query head per KV head) through a kernel of its own that sums
    in another order than its many-row kernel, so with a single query head per KV head the row is repeated and
    the scores always go through the many-row kernel: a one-token step then gets the bits of the same row in a
    verify batch or a prompt chunk."""
    return max(group, 2)


def score_slice(head_dim: int) -> int:
    """The widest slice of at most :data:`SCORE_SLICE` values that divides a key head."""
    return next(width for width in range(min(head_dim, SCORE_SLICE), 0, -1) if head_dim % width == 0)


# ---------------------------------------------------------------------------------------------------------------
# split → ONNX model
# ---------------------------------------------------------------------------------------------------------------

class SplitTranslator(MoeTranslation, RecurrentTranslation, ScanTranslation, SplitCompilerBase[OnnxKV]):
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

    # -- rope --------------------------------------------------------------------------------------------
    def _rope_table(self, pos: str, attrs: Mapping[str, Any], factors: Node | None) -> tuple[str, str, str]:
        """cos/sin [T, n_dims/2] for a position input and ``arange(T)`` as RotaryEmbedding's position ids:
        the table holds exactly this ubatch's rows (row t = position pos[t])."""
        rope_attrs = {k: v for k, v in attrs.items() if k not in ("layer", "cache")}
        key = ("rope", pos, freeze(rope_attrs), None if factors is None else factors.attrs.get("name"))
        return self.shared(key, lambda: self._make_rope_table(pos, rope_attrs, factors))

    def _make_rope_table(self, pos: str, attrs: Mapping[str, Any], factors: Node | None) -> tuple[str, str, str]:
        ff = None if factors is None else self.backend.dense_copy(factors.attrs["name"])
        slope, mscale = rope_angle_slopes(freq_factors=ff, **attrs)
        positions = self.e.op("Unsqueeze", [self.e.op("Cast", [pos], to=ONNX_FLOAT), self.e.const([-1])])
        theta = self.e.op("Mul", [positions, self.e.const(slope, F32)], hint="theta")
        cos, sin = self.e.op("Cos", [theta], hint="cos"), self.e.op("Sin", [theta], hint="sin")
        if mscale != 1.0:
            cos = self.e.op("Mul", [cos, self.e.const(mscale, F32)], hint="cos")
            sin = self.e.op("Mul", [sin, self.e.const(mscale, F32)], hint="sin")
        n = self.e.op("Squeeze", [self.e.op("Shape", [pos], start=0, end=1)])
        row_ids = self.e.op("Unsqueeze", [self.e.op("Range", [self.e.const(0), n, self.e.const(1)]),
                                          self.e.const([0])], hint="rope_rows")
        return cos, sin, row_ids

    def _rotate(self, x: str, n_head: int, head_dim: int, table: tuple[str, str, str], attrs: Mapping[str, Any]
                ) -> str:
        """x [T, H, D] rotated on its first n_dims by com.microsoft RotaryEmbedding (interleaved = NORM mode's
        adjacent pairs, else NEOX halves; dims past n_dims pass through)."""
        cos, sin, row_ids = table
        n_dims = int(attrs["n_dims"])
        extra = {"rotary_embedding_dim": n_dims} if n_dims < head_dim else {}
        flat = self.e.op("Reshape", [x, self.e.const([1, -1, n_head * head_dim])])
        rotated = self.e.op("RotaryEmbedding", [flat, row_ids, cos, sin], domain="com.microsoft", hint="rope",
                            interleaved=int(attrs["mode"] != "neox"), num_heads=n_head, **extra)
        self.e.keeps_shape(rotated, flat)
        return self.e.op("Reshape", [rotated, self.e.const([-1, n_head, head_dim])])

    def _op_rope(self, node: Node) -> str:
        x, pos = node.inputs[0], node.inputs[1]
        factors = node.inputs[2] if len(node.inputs) > 2 else None
        if len(self.shape(x)) != 3:
            raise ModelError(f"onnx backend: rope expects x [T, H, D], got shape {self.shape(x)}")
        table = self._rope_table(self.value(pos), node.attrs, factors)
        return self._rotate(self.value(x), self.known_dim(x, 1), self.known_dim(x, 2), table, node.attrs)

    # -- KV cache: [n_head_kv, n_cells, head_dim] per layer, updated in place ---------------------------------
    def _kv_input(self, key: tuple[str, int], which: str) -> str:
        """The current value of a cache tensor: the bound graph input, or the last in-place update of it."""
        current = self._kv_current.get((key, which))
        if current is not None:
            return current
        name = kv_name(key, which)
        if name not in self._kv_declared:
            storage: OnnxKV = self.kv[key]
            array = storage.k if which == "k" else storage.v
            dims = [array.shape[0], f"{name}_cells", array.shape[2]]
            if self.kv_rank == 4:
                dims = [1, *dims]
            self.graph_inputs.append(self.e.helper.make_tensor_value_info(name, ONNX_FLOAT, dims))
            self._kv_declared.add(name)
        return name

    def _kv_write(self, node: Node, key: tuple[str, int], which: str, index: str, rows: str) -> str:
        """ScatterND of ``rows`` [T, Hkv, D] (the projection's own layout: no transpose) at ``index`` [T, Hkv, 2]
        (head, cell) — in place: the last update of a cache is a graph output bound to the input's own buffer,
        so ORT skips ScatterND's copy."""
        current = self._kv_input(key, which)
        if self._last_kv_writer.get((key, which)) == node.id and not self._in_branch:
            updated = kv_name(key, which) + "_out"
            self.e.nodes.append(self.e.helper.make_node("ScatterND", [current, index, rows], [updated]))
        else:
            updated = self.e.op("ScatterND", [current, index, rows], hint=f"kv_{which}")
        self._kv_current[(key, which)] = updated
        return updated

    def _kv_storage(self, node: Node) -> tuple[tuple[str, int], OnnxKV]:
        return self.kv_key(node), self.kv_storage(node)

    def _scatter_index(self, cells: str, n_head_kv: int) -> str:
        """[T, Hkv, 2] pairs (head, cell) for cells [T] (int), shared by the layers with n_head_kv heads."""
        def make() -> str:
            cells64 = self.e.op("Cast", [cells], to=ONNX_INT64)
            n = self.e.op("Shape", [cells64])
            grid = self.e.op("Concat", [n, self.e.const([n_head_kv, 1])], axis=0)
            heads = self.e.op("Expand", [self.e.const(np.arange(n_head_kv).reshape(1, -1, 1)), grid])
            cols = self.e.op("Expand", [self.e.op("Unsqueeze", [cells64, self.e.const([1, 2])]), grid])
            if self.kv_rank == 4:  # (0, head, cell) into [1, Hkv, n_cells, D]
                zeros = self.e.op("Expand", [self.e.const(np.zeros((1, 1, 1), np.int64)), grid])
                return self.e.op("Concat", [zeros, heads, cols], axis=-1, hint="kv_index")
            return self.e.op("Concat", [heads, cols], axis=-1, hint="kv_index")
        return self.shared(("kv_index", cells, n_head_kv), make)

    def _cached_prefix(self, cache: str, n_kv: str, n_head_kv: int, head_dim: int) -> str:
        """Cells 0 .. n_kv-1 of a cache tensor, as [Hkv, n_kv, D]."""
        axis = self.kv_rank - 2
        prefix = self.e.op("Slice", [cache, self.e.const([0]), n_kv, self.e.const([axis])])
        return prefix if self.kv_rank == 3 else self.e.op("Reshape", [prefix, self.e.const([n_head_kv, -1, head_dim])])

    def _cells_input(self, mask: Node, cache: tuple[str, int] | None = None) -> str:
        """The graph input ``cells_<mask>`` [S, L/B] int64: the blocks of B cache cells each of S consecutive row
        groups attends, under a mask [T, L] the runtime puts in the core's mask's place (see groups.py)."""
        if cache is not None:
            self.cell_caches.setdefault(mask.id, set()).add(cache)
        name = self.cell_inputs.get(mask.id)
        if name is None:
            if mask.id not in self.input_shapes:
                raise ModelError(f"onnx backend: the attention mask {mask!r} is not an input of its split")
            name = self.cell_inputs[mask.id] = f"cells_{mask.id}"
            self.graph_inputs.append(self.e.helper.make_tensor_value_info(
                name, ONNX_INT64, [f"{name}_groups", f"{name}_width"]))
        return name

    def _grouped_cells(self, cache: str, mask: Node, n_head_kv: int, head_dim: int) -> str:
        """The cells a group attends, gathered from a cache tensor in blocks of B = L / (L/B) cells (a plain
        prefix is a few big blocks, as cheap as a Slice; a row's own cells are blocks of one): [Hkv, S, L, D]."""
        blocks = self.e.op("Reshape", [cache, self._cell_blocks_shape(mask, n_head_kv, head_dim)])
        gathered = self.e.op("Gather", [blocks, self._cells_input(mask)], axis=1)  # [Hkv, S, L/B, B*D]
        return self.e.op("Reshape", [gathered, self.e.const([n_head_kv, 0, -1, head_dim])])

    def _cell_blocks_shape(self, mask: Node, n_head_kv: int, head_dim: int) -> str:
        """[Hkv, -1, B*D]: a cache tensor seen as blocks of B cells (B = L / (L/B), the mask's and the cells'
        widths)."""
        cells, mask_name = self._cells_input(mask), self.value(mask)

        def make() -> str:
            block = self.e.op("Div", [self.e.op("Shape", [mask_name], start=1, end=2),
                                      self.e.op("Shape", [cells], start=1, end=2)], hint="cell_block")
            row = self.e.op("Mul", [block, self.e.const([head_dim])])
            return self.e.op("Concat", [self.e.const([n_head_kv, -1]), row], axis=0)
        return self.shared(("cell_blocks", cells, n_head_kv, head_dim), make)

    def _group_count(self, cells: str) -> str:
        """S, the row groups of a call, as a [1] shape piece."""
        return self.shared(("groups", cells), lambda: self.e.op("Shape", [cells], start=0, end=1))

    def _query_groups_shape(self, cells: str, n_head_kv: int, group: int, head_dim: int) -> str:
        """[S, -1, Hkv, G, D]: the queries [T, H, D] split into the row groups (``D`` as ``slices, width`` when
        the keys are scored in slices, see :meth:`_scores`)."""
        width = score_slice(head_dim)
        head = [head_dim] if width == head_dim else [head_dim // width, width]
        return self.shared(("q_groups", cells, n_head_kv, group, head_dim), lambda: self.e.op(
            "Concat", [self._group_count(cells), self.e.const([-1, n_head_kv, group, *head])], axis=0))

    def _grouped_mask(self, mask: Node, group: int) -> str:
        """The mask [T, L] as [S, G*T/S, L], row g*(T/S) + t of a group for query head g of a KV head: the
        scores' rows (shared by the layers with the same group size)."""
        mask_name, cells = self.value(mask), self._cells_input(mask)

        def make() -> str:
            width = self.e.op("Shape", [mask_name], start=1, end=2)
            shape = self.e.op("Concat", [self._group_count(cells), self.e.const([-1]), width], axis=0)
            rows = self.e.op("Reshape", [mask_name, shape])
            return self.e.op("Tile", [rows, self.e.const([1, group, 1])], hint="mask")
        return self.shared(("mask", mask_name, group), make)

    def _op_attention(self, node: Node) -> str:
        if self.attention == "switch":
            return self._switched_attention(node)
        if self.attention == "gqa":
            return self._group_query_attention(node)
        return self._attention_op_by_op(node)

    def _attention_op_by_op(self, node: Node) -> str:
        """Each row group (see groups.py) scores the cells it lists: [Hkv, S, G*T/S, L] scores per KV head."""
        q, k, v, kv_idx, mask = node.inputs[:5]
        key, storage = self._kv_storage(node)
        n_head_kv, _, head_dim_k = storage.k.shape
        head_dim_v = storage.v.shape[2]
        n_head = self.known_dim(q, 1)
        if n_head % n_head_kv:
            raise ModelError(f"onnx backend: {n_head} query heads are not a multiple of {n_head_kv} KV heads")
        group = n_head // n_head_kv
        index = self._scatter_index(self.value(kv_idx), n_head_kv)
        keys = self._kv_write(node, key, "k", index, self.value(k))
        values = self._kv_write(node, key, "v", index, self.value(v))
        cells = self._cells_input(mask, key)
        keys = self._grouped_cells(keys, mask, n_head_kv, head_dim_k)
        values = self._grouped_cells(values, mask, n_head_kv, head_dim_v)
        # query head h uses KV head h // G: [T, H, Dk] → [S, T/S, Hkv, G, Dk] → [Hkv, S, R*T/S, Dk]
        rows = score_rows(group)
        scores = self._scores(self.value(q), cells, keys, n_head_kv, group, head_dim_k, float(node.attrs["scale"]))
        softcap = float(node.attrs.get("softcap", 0.0) or 0.0)
        if softcap:
            scores = self._softcap(scores, softcap)
        logits = self.e.op("Add", [scores, self._grouped_mask(mask, rows)])
        if len(node.inputs) > 5:
            probs = self._softmax_with_sinks(logits, node.inputs[5], n_head_kv, group, rows)
        else:
            probs = self.e.op("Softmax", [logits], axis=-1)
        out = self.e.op("MatMul", [probs, values], hint="kqv")                 # [Hkv, S, R*T/S, Dv]
        out = self.e.op("Reshape", [out, self.e.const([n_head_kv, 0, rows, -1, head_dim_v])])
        if rows != group:  # the query rows repeated for MLAS's sake (score_rows): the first copy
            out = self.e.op("Slice", [out, self.e.const([0]), self.e.const([group]), self.e.const([2])])
        out = self.e.op("Transpose", [out], perm=[1, 3, 0, 2, 4])               # [S, T/S, Hkv, G, Dv]
        return self.e.op("Reshape", [out, self.e.const([-1, n_head * head_dim_v])], hint="attn")

    def _softmax_with_sinks(self, logits: str, sinks: Node, n_head_kv: int, group: int, rows: int) -> str:
        """Softmax of the logits [Hkv, S, R*T/S, L] with each head's sink logit as one more column (dropped
        after): row g*(T/S) + t of KV head j belongs to query head j*G + g (repeated when R > G)."""
        per_row = self.backend.dense_copy(sinks.attrs["name"]).reshape(n_head_kv, group)
        per_row = np.repeat(per_row, rows // group, axis=1) if rows != group else per_row
        column = self.e.const(per_row.reshape(n_head_kv, 1, rows, 1).astype(F32), F32)
        shape = self.e.op("Shape", [logits])
        per_group = self.e.op("Div", [self.e.op("Slice", [shape, self.e.const([2]), self.e.const([3])]),
                                      self.e.const([rows])])
        column = self.e.op("Expand", [column, self.e.op("Concat", [self.e.const([n_head_kv, 1, rows]), per_group],
                                                        axis=0)])
        column = self.e.op("Reshape", [column, self.e.const([n_head_kv, 1, -1, 1])])
        column = self.e.op("Expand", [column, self.e.op("Concat", [self.e.op("Slice", [
            shape, self.e.const([0]), self.e.const([3])]), self.e.const([1])], axis=0)])
        probs = self.e.op("Softmax", [self.e.op("Concat", [logits, column], axis=-1)], axis=-1)
        return self.e.op("Slice", [probs, self.e.const([0]), self.e.const([-1]), self.e.const([-1])], hint="sinks")

    def _scores(self, q: str, cells: str, keys: str, n_head_kv: int, group: int, head_dim: int,
                scale: float) -> str:
        """``scale * q @ keys.T`` per row group and KV head, [Hkv, S, R*T/S, L], for q [T, H, D] (query head h
        uses KV head h // G: [T, H, D] → [S, T/S, Hkv, G, D] → [Hkv, S, G*T/S, D]; R = :func:`score_rows`, the
        G query heads or each repeated when G = 1) and keys [Hkv, S, L, D].

        ONNX Runtime's float GEMM (MLAS) sums a dot product over one slice of at most 128 values, or over several
        whose boundaries depend on how many cells are scored: with longer keys a row's score would round
        differently in a batch of another width (a sequence decoding among others, not alone). So a longer key
        head is scored in slices of :data:`SCORE_SLICE` values — one FusedMatMul over all of them, the slices'
        scores then added in a fixed order."""
        groups = self.e.op("Reshape", [q, self._query_groups_shape(cells, n_head_kv, group, head_dim)])
        width = score_slice(head_dim)
        rows = score_rows(group)
        if rows != group:  # [S, T/S, Hkv, 1, ...] → [S, T/S, Hkv, R, ...]: each query row R times
            trailing = [1] if width == head_dim else [1, 1]
            groups = self.e.op("Expand", [groups, self.e.const([1, 1, 1, rows, *trailing])])
        if width == head_dim:
            qg = self.e.op("Reshape", [self.e.op("Transpose", [groups], perm=[2, 0, 3, 1, 4]),
                                       self.e.const([n_head_kv, 0, -1, head_dim])])
            return self.e.op("FusedMatMul", [qg, keys], domain="com.microsoft", alpha=scale, transB=1, hint="kq")
        n_slices = head_dim // width
        # [S, T/S, Hkv, G, slices, width] → [Hkv, S, slices, G*T/S, width]; keys → [Hkv, S, slices, L, width]
        qg = self.e.op("Reshape", [self.e.op("Transpose", [groups], perm=[2, 0, 4, 3, 1, 5]),
                                   self.e.const([n_head_kv, 0, n_slices, -1, width])])
        ks = self.e.op("Transpose", [self.e.op("Reshape", [keys, self.e.const([n_head_kv, 0, -1, n_slices, width])])],
                       perm=[0, 1, 3, 2, 4])
        scores = self.e.op("FusedMatMul", [qg, ks], domain="com.microsoft", alpha=scale, transB=1, hint="kq")
        return self.e.op("ReduceSum", [scores, self.e.const([2])], keepdims=0, hint="kq")

    def _op_k_shift(self, node: Node) -> str:
        shift = node.inputs[0]
        factors = node.inputs[1] if len(node.inputs) > 1 else None
        key, storage = self._kv_storage(node)
        n_head_kv, _, head_dim = storage.k.shape
        shift_name = self.value(shift)
        n_kv = self.e.op("Shape", [shift_name])
        cached = self._cached_prefix(self._kv_input(key, "k"), n_kv, n_head_kv, head_dim)  # [Hkv, n_kv, D]
        table = self._rope_table(shift_name, node.attrs, factors)
        rotated = self._rotate(self.e.op("Transpose", [cached], perm=[1, 0, 2]), n_head_kv, head_dim, table,
                               node.attrs)                                     # [n_kv, Hkv, D]
        cells = self.e.op("Range", [self.e.const(0), self.e.op("Squeeze", [n_kv]), self.e.const(1)])
        self._kv_write(node, key, "k", self._scatter_index(cells, n_head_kv), rotated)
        return self.e.const(np.zeros(0, F32), F32)

    # -- GroupQueryAttention (the batch is one causal run of cells, see fused.py) -------------------------------
    def _group_query_attention(self, node: Node) -> str:
        """One GQA over the layer's cache, past and present bound to the same memory: it writes the ubatch's K/V
        at cells c0 .. c0+T-1 and attends to cells 0 .. c0+t (the mask's pattern, checked before the call)."""
        q, k, v, kv_idx, _ = node.inputs[:5]
        key, storage = self._kv_storage(node)
        n_head_kv, n_cells, head_dim = storage.k.shape
        n_head = self.known_dim(q, 1)
        if n_head % n_head_kv:
            raise ModelError(f"onnx backend: {n_head} query heads are not a multiple of {n_head_kv} KV heads")
        rope = fusable_rope(node, n_cells)
        rotary: list[str] = []
        rotary_attrs: dict[str, int] = {}
        if rope is not None:  # GQA rotates q and k itself, at position = cell (checked per call)
            q, k = q.inputs[0], k.inputs[0]
            rotary = list(self._rotary_tables(rope, n_cells))
            rotary_attrs = {"do_rotary": 1, "rotary_interleaved": int(rope.attrs["mode"] != "neox")}
        qkv = packed_qkv(q, k, v) if rope is not None else None
        # the inputs as [1, T, heads * D], made in the outer graph when this is an If branch (a branch of one
        # node costs ONNX Runtime least)
        reshape = self._outer_op if self._in_branch else self.e.op
        if qkv is not None:  # the fused QKV projection's output as it is: GQA splits it
            width = (n_head + 2 * n_head_kv) * head_dim
            rows = [reshape("Reshape", [self.value(qkv), self.e.const([1, -1, width])]), "", ""]
        else:
            rows = [reshape("Reshape", [self.value(x), self.e.const([1, -1, heads * head_dim])])
                    for x, heads in ((q, n_head), (k, n_head_kv), (v, n_head_kv))]
        seqlens, total = self._gqa_lengths(self.value(kv_idx))
        past = [self._kv_input(key, which) for which in ("k", "v")]
        present = [self.e.fresh(f"present_{which}") for which in ("k", "v")]
        out = self.e.fresh("gqa")
        window = int(node.attrs.get("window", 0) or 0)
        self.e.nodes.append(self.e.helper.make_node(
            "GroupQueryAttention", [*rows, *past, seqlens, total, *rotary], [out, *present], domain="com.microsoft",
            num_heads=n_head, kv_num_heads=n_head_kv, scale=float(node.attrs["scale"]),
            softcap=float(node.attrs.get("softcap", 0.0) or 0.0), local_window_size=window if window > 0 else -1,
            **rotary_attrs))
        for which, name in zip(("k", "v"), present):
            self._kv_current[(key, which)] = name
        if self._in_branch:  # [1, T, H*D]: the If's output is reshaped after it
            return out
        return self.e.op("Reshape", [out, self.e.const([-1, n_head * head_dim])], hint="attn")

    def _outer_op(self, op_type: str, inputs: list[str]) -> str:
        """A node of the graph around the If being built (its branches read the value)."""
        branch_nodes, self.e.nodes = self.e.nodes, self._outer_nodes[-1]
        try:
            return self.e.op(op_type, inputs)
        finally:
            self.e.nodes = branch_nodes

    def _switched_attention(self, node: Node) -> str:
        """``If(use_gqa)``: GroupQueryAttention, else the op-by-op attention; each branch returns the attention
        output and both caches, and the If's cache outputs are the bound graph outputs (written in place)."""
        key, storage = self._kv_storage(node)
        self._warm_shared(node, storage)
        then_branch = self._branch(node, key, self._group_query_attention)
        else_branch = self._branch(node, key, self._attention_op_by_op)
        out = self.e.fresh("attn")
        present = [kv_name(key, which) + "_out" for which in ("k", "v")]
        self.e.nodes.append(self.e.helper.make_node("If", [USE_GQA], [out, *present], then_branch=then_branch,
                                                    else_branch=else_branch))
        for which, name in zip(("k", "v"), present):
            self._kv_current[(key, which)] = name
        width = self.known_dim(node.inputs[0], 1) * storage.v.shape[2]
        return self.e.op("Reshape", [out, self.e.const([-1, width])], hint="attn")  # GQA's [1, T, H*D]

    def _warm_shared(self, node: Node, storage: OnnxKV) -> None:
        """The values every layer's branches share, made in the outer graph (a value made inside a branch is not
        visible to the other layers' branches)."""
        q, _, _, kv_idx, mask = node.inputs[:5]
        n_head_kv = storage.k.shape[0]
        self._gqa_lengths(self.value(kv_idx))
        self._scatter_index(self.value(kv_idx), n_head_kv)
        group = self.known_dim(q, 1) // n_head_kv
        self._grouped_mask(mask, score_rows(group))
        cells = self._cells_input(mask, (node.attrs["cache"], int(node.attrs["layer"])))
        self._query_groups_shape(cells, n_head_kv, group, storage.k.shape[2])
        for head_dim in {storage.k.shape[2], storage.v.shape[2]}:
            self._cell_blocks_shape(mask, n_head_kv, head_dim)
        for rope in node.inputs[:2]:
            if rope.id in self._deferred_ropes:
                factors = rope.inputs[2] if len(rope.inputs) > 2 else None
                self._rope_table(self.value(rope.inputs[1]), rope.attrs, factors)

    def _branch(self, node: Node, key: tuple[str, int], emit: Callable[[Node], str]) -> Any:
        """A subgraph of the nodes ``emit`` makes for ``node``: outputs (attention, K cache, V cache)."""
        outer_nodes, outer_shared, outer_current = self.e.nodes, self._shared, dict(self._kv_current)
        self._outer_nodes.append(outer_nodes)
        self.e.nodes, self._shared, self._in_branch = [], dict(outer_shared), True
        try:
            out = emit(node)
            made_here = {name for n in self.e.nodes for name in n.output}
            if out not in made_here:  # a branch output must be made in the branch
                out = self.e.op("Identity", [out], hint="branch_out")
            outputs = [out] + [self._kv_current[(key, which)] for which in ("k", "v")]
            nodes = self.e.nodes
        finally:
            self._outer_nodes.pop()
            self.e.nodes, self._shared, self._kv_current, self._in_branch = (outer_nodes, outer_shared,
                                                                             outer_current, False)
        helper = self.e.helper
        return helper.make_graph(nodes, self.e.fresh("branch"), [],
                                 [helper.make_tensor_value_info(name, ONNX_FLOAT, None) for name in outputs])

    def _rotary_tables(self, rope: Node, n_cells: int) -> tuple[str, str]:
        """GQA's cos/sin caches [n_cells, n_dims/2] (row = position = cell), the angles of :meth:`_rope_table`
        computed once per rope parameters and cache size (external initializers shared by the sessions)."""
        factors = rope.inputs[2] if len(rope.inputs) > 2 else None
        attrs = {k: v for k, v in rope.attrs.items() if k not in ("layer", "cache")}
        key = (freeze(attrs), None if factors is None else factors.attrs.get("name"), n_cells)
        name = f"rotary:{abs(hash(key)):x}"

        def table(which: str) -> np.ndarray:
            def make() -> np.ndarray:
                ff = None if factors is None else self.backend.dense_copy(factors.attrs["name"])
                slope, mscale = rope_angle_slopes(freq_factors=ff, **attrs)
                theta = np.arange(n_cells, dtype=F32)[:, None] * slope[None, :]
                return ((np.cos(theta) if which == "cos" else np.sin(theta)) * F32(mscale)).astype(F32)
            return self.backend.derived(name, which, make)

        return self.e.external(f"{name}:cos", table("cos")), self.e.external(f"{name}:sin", table("sin"))

    def _gqa_lengths(self, kv_idx: str) -> tuple[str, str]:
        """``seqlens_k`` [1] = the last cell written (c0 + T - 1) and ``total_sequence_length`` (a scalar, + 1),
        int32, from the ubatch's cells — shared by the layers of one cache."""
        def make() -> tuple[str, str]:
            last = self.e.op("Slice", [kv_idx, self.e.const([-1]), self.e.const([np.iinfo(np.int64).max])])
            seqlens = self.e.op("Cast", [last], to=ONNX_INT32, hint="seqlens_k")
            total = self.e.op("Squeeze", [self.e.op("Add", [seqlens, self.e.const([1], np.int32)])], hint="total_len")
            return seqlens, total
        return self.shared(("gqa_lengths", kv_idx), make)
