"""The native backend's compiler: a split → one checked flat program (program.py) over one arena; the weights in the
kernels' layout. compiled.py runs what it makes."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from math import prod
from typing import Literal, Mapping, Protocol, Sequence

import numpy as np

from llmfw.core.exec.backend import Split, WeightHandle
from llmfw.core.exec.compiler import SplitCompilerBase
from llmfw.core.exec.weight_cache import CacheOptions
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import DYNAMIC, Node
from llmfw.core.ir.ops import attention_extras
from llmfw.core.ir.rope import yarn_magnitude, yarn_ramp_mix
import llmfw.plugins.backends.native.kernels as kernels
import llmfw.plugins.backends.native.program as pg
import llmfw.plugins.backends.native.recurrent as recurrent
from llmfw.plugins.backends.native.experts import NativeExperts
from llmfw.plugins.backends.native.repack import QUANTIZED_KINDS
# the values' names stay importable from here, where they were first defined (``X as X``: re-exported)
from llmfw.plugins.backends.native.values import (WORDS_PER, NativeMatrix as NativeMatrix, OutputSlot,
                                                  Value as Value, broadcast_strides as broadcast_strides,
                                                  native_matrix as native_matrix, row_layout as row_layout)
from llmfw.plugins.backends.numpy.kernels import F32, NumpyKV


class NativeOptions(CacheOptions):
    """``backend_options: {native: {...}}``."""

    #: the kernels' instruction set: auto = the widest this CPU runs; a named one is an error where it cannot run
    isa: Literal["auto", "scalar", "avx2", "avx512", "amx"] = "auto"
    #: time every instruction of every program (``NativeBackend.profile()`` sums them per op)
    profile: bool = False
    #: the KV cache's values: f16 (llama.cpp's default cache type: half the memory, and half the bytes attention
    #: reads per step) or f32 (the exact float32 the ops compute)
    kv_type: Literal["f16", "f32"] = "f16"



class ProgramHost(Protocol):
    """What a program needs of its backend (NativeBackend): its weights, options, instruction set and threads."""

    native_options: "NativeOptions"
    isa: str

    @property
    def pool(self) -> kernels.ThreadPool: ...

    def weight(self, name: str) -> WeightHandle: ...


class NativeCompiler(SplitCompilerBase[NumpyKV]):
    """A split → one checked :class:`~llmfw.plugins.backends.native.program.Program` (``input_shapes``: the concrete
    shapes of inputs the graph left DYNAMIC, e.g. the K-shift's)."""

    backend_name = "native"
    kv_class = NumpyKV

    def __init__(self, backend: ProgramHost, split: Split, kv: Mapping[tuple[str, int], NumpyKV],
                 input_shapes: Mapping[int, tuple[int, ...]] | None = None):
        super().__init__(split, kv)
        self.backend = backend
        self.input_shapes = dict(input_shapes or {})
        self.arena = pg.Arena()
        self.instrs: list[pg.Instr] = []
        self.values: dict[int, Value] = {}
        self.buffers: list[np.ndarray] = []
        self.writable: list[bool] = []
        self._buffer_ids: dict[int, int] = {}
        self.weights: list[kernels.NatWeight] = []
        self.weight_infos: list[pg.WeightInfo] = []
        self._weight_ids: dict[str, int] = {}
        self.refs: dict[int, int] = {}  # arena root → live values viewing it
        self.roots: dict[int, tuple[int, int]] = {}  # root id → (offset, words)
        self._rope_tables: dict[tuple[object, ...], pg.Operand] = {}  # rope_angles: key → the run's table
        self.uses = Counter(i.id for n in split.nodes for i in n.inputs)  # readers of each node's value
        #: output buffer → the split output it holds (each run hands it out as a new array: see output_value)
        self.output_owners: dict[int, int] = {}

    # -- values -------------------------------------------------------------------------------------------------
    def node_shape(self, node: Node) -> tuple[int, ...]:
        shape = self.input_shapes.get(node.id, node.shape)
        if shape is None or DYNAMIC in shape:
            raise ModelError(f"native backend: the shape of {node!r} is not known when its split compiles")
        return tuple(int(d) for d in shape)

    def new_value(self, shape: tuple[int, ...], dtype: str) -> Value:
        words = prod(shape) * WORDS_PER[dtype]
        off = self.arena.alloc(words)
        root = len(self.roots)
        self.roots[root] = (off, words)
        self.refs[root] = 1
        return Value(0, off, shape, dtype, root=root)

    def define(self, node: Node) -> Value:
        """A fresh value for ``node``'s output: in the arena, or in a buffer of its own for a split output."""
        shape, dtype = self.node_shape(node), node.dtype or "f32"
        is_output = node.id in self.split.output_ids and node.op != "input"
        value = self.output_value(node.id, shape, dtype) if is_output else self.new_value(shape, dtype)
        self.values[node.id] = value
        return value

    def output_value(self, node_id: int, shape: tuple[int, ...], dtype: str) -> Value:
        """A value in a buffer of its own for split output ``node_id``: the op producing it writes there, and
        CompiledProgram points the buffer at a new array before each run, so the output it hands back is that array,
        the caller's to keep, with no copy out of the arena (a step's logits: megabytes for a large vocabulary)."""
        self.buffers.append(pg.output_array(prod(shape) * WORDS_PER[dtype]))
        self.writable.append(True)
        index = len(self.buffers)  # buffer 0 is the arena
        self.output_owners[index] = node_id
        return Value(index, 0, shape, dtype)

    def holds_output(self, node_id: int, value: Value) -> bool:
        """Whether ``value`` is node ``node_id``'s own output buffer (not a view of another value)."""
        return self.output_owners.get(value.buf) == node_id and value.off == 0 and not value.row_stride

    def alias(self, node: Node, base: Value, shape: tuple[int, ...], extra_words: int = 0) -> None:
        """``node`` is a view of ``base`` (same memory, another shape, ``extra_words`` further on)."""
        self.values[node.id] = replace(base, off=base.off + extra_words, shape=shape)
        if base.root >= 0:
            self.refs[base.root] += 1

    def release(self, value: Value) -> None:
        if value.root < 0:
            return
        self.refs[value.root] -= 1
        if self.refs[value.root] == 0:
            self.arena.release(*self.roots[value.root])

    def buffer(self, array: np.ndarray, writable: bool = False) -> int:
        """The index of ``array`` (kept alive by the program) in the buffer table."""
        key = id(array)
        if key not in self._buffer_ids:
            if array.dtype not in (np.float32, np.int32, np.int64, np.float16) or not array.flags.c_contiguous:
                array = np.ascontiguousarray(array, dtype=np.float32)
            self.buffers.append(array)
            self.writable.append(writable)
            self._buffer_ids[key] = len(self.buffers)  # buffer 0 is the arena
        return self._buffer_ids[key]

    def constant(self, values: np.ndarray) -> pg.Operand:
        array = np.ascontiguousarray(values, dtype=np.float32)
        self.buffers.append(array)
        self.writable.append(False)
        return pg.Operand(len(self.buffers), 0)

    def v(self, node: Node) -> Value:
        """``node``'s activation, contiguous (a strided view is copied out once, where an op first needs it so)."""
        value = self.v_rows(node)
        if value.row_stride:
            value = self.contiguous(node.id, value)
        return value

    def v_rows(self, node: Node) -> Value:
        """``node``'s activation as it is, possibly a strided view (for the ops that take row strides)."""
        value = self.values.get(node.id)
        if value is None or value.weight >= 0:
            raise ModelError(f"native backend: {node!r} is used as an activation but is a matrix")
        return value

    def contiguous(self, node_id: int, view: Value) -> Value:
        """Copy the strided ``view`` of node ``node_id`` into a fresh value, which stands for it from now on."""
        out = self.new_value(view.shape, view.dtype)
        self.copy_rows(view, out)
        self.values[node_id] = out
        self.release(view)
        return out

    def emit(self, op: int, args: Sequence[pg.Operand], n: Sequence[int] = (), f: Sequence[float] = (),
             label: str = "") -> None:
        self.instrs.append(pg.Instr(op, list(args), list(n), [float(x) for x in f], label))

    # -- the walk -------------------------------------------------------------------------------------------------
    def compile_weight(self, node: Node) -> None:
        name = str(node.attrs["name"])
        handle = self.backend.weight(name)
        if isinstance(handle, NativeMatrix):
            if name not in self._weight_ids:
                self._weight_ids[name] = len(self.weights)
                self.weights.append(handle.c_struct)
                packed = handle.packed
                self.weight_infos.append(pg.WeightInfo(packed.kind, packed.n_rows, packed.n_cols))
            self.values[node.id] = Value(-1, 0, handle.shape, "f32", weight=self._weight_ids[name])
            return
        if isinstance(handle, NativeExperts):  # E weight records side by side: the first one's index
            if name not in self._weight_ids:
                self._weight_ids[name] = len(self.weights)
                self.weights.extend(handle.c_structs)
                info = pg.WeightInfo(handle.packed.kind, handle.n_out, handle.packed.n_cols)
                self.weight_infos.extend([info] * handle.n_expert)
            self.values[node.id] = Value(-1, 0, handle.shape, "f32", weight=self._weight_ids[name])
            return
        if not isinstance(handle, np.ndarray):
            raise ModelError(f"native backend: weight {name!r} is stored as {type(handle).__name__}, which the "
                             "kernels cannot read")
        self.values[node.id] = Value(self.buffer(handle), 0, tuple(handle.shape), "f32")

    def compile_release(self, node_ids: Sequence[int]) -> None:
        for node_id in node_ids:
            value = self.values.get(node_id)
            if value is not None:
                self.release(value)

    def compile_program(self) -> tuple[pg.Program, list[tuple[int, np.ndarray]], list[tuple[int, OutputSlot]]]:
        """The program, the arena views its inputs are copied into, and the buffers of its outputs."""
        graph_inputs = {n.id: n for n in self.split.nodes if n.op == "input"}
        consumers = {i.id: i for n in self.split.nodes for i in n.inputs}
        for node_id, _ in self.required_inputs():
            node = graph_inputs.get(node_id) or consumers[node_id]
            self.define(node)
        self.walk()
        for node_id in self.split.output_ids:
            value = self.values[node_id]
            if not self.holds_output(node_id, value):  # a view of another value, or an input passed through
                self.copy_to_output(node_id, value)
        program = pg.Program(self.instrs, self.arena.size, self.buffers, self.writable, self.weights,
                             self.weight_infos, outputs=list(self.output_owners))
        inputs = [(i, self.view_of(program, self.values[i])) for i, _ in self.required_inputs()]
        outputs = [(i, OutputSlot(self.values[i].buf, self.values[i].shape, self.values[i].dtype))
                   for i in self.split.output_ids]
        return program, inputs, outputs

    def copy_to_output(self, node_id: int, value: Value) -> None:
        """Copy ``value`` (possibly strided) into a buffer of its own for output ``node_id``."""
        out = self.output_value(node_id, value.shape, value.dtype)
        self.copy_rows(value, out)
        self.values[node_id] = out

    def copy_rows(self, view: Value, out: Value) -> None:
        """One slice instruction copying ``view``'s rows (possibly strided) into the contiguous ``out``, in words;
        none for a value without elements."""
        rows, width, _ = row_layout(view)
        words = width * WORDS_PER[view.dtype]
        if rows and words:
            self.emit(pg.SLICE, [out.operand, view.operand], [rows, view.row_stride or words, 0, words],
                      label="slice")

    @staticmethod
    def view_of(program: pg.Program, value: Value) -> np.ndarray:
        if value.buf != 0:
            raise ModelError("native backend: a split input or output that is not an activation")
        return program.view(value.off, value.shape, value.dtype)

    # -- ops ---------------------------------------------------------------------------------------------------------
    def _op_reshape(self, node: Node) -> None:
        shape = self.node_shape(node)
        base = self.v_rows(node.inputs[0])
        if base.row_stride and (len(shape) < 2 or shape[0] != base.shape[0]):  # the rows must stay the rows
            base = self.v(node.inputs[0])
        self.alias(node, base, shape)

    def _op_slice(self, node: Node) -> None:
        base = self.v(node.inputs[0])
        shape = base.shape
        axis = node.attr_int("axis", -1) % len(shape)
        start, stop, _ = slice(node.attrs.get("start"), node.attrs.get("stop")).indices(shape[axis])
        inner = prod(shape[axis + 1:]) * WORDS_PER[base.dtype]
        outer = prod(shape[:axis])
        out_shape = self.node_shape(node)
        if outer == 1 or out_shape[axis] == shape[axis]:  # one contiguous range: a view
            self.alias(node, base, out_shape, start * inner)
            return
        if len(shape) == 2 and axis == 1:  # columns of every row: a strided view, copied only if an op needs it
            self.alias(node, base, out_shape, start * inner)
            self.values[node.id] = replace(self.values[node.id], row_stride=shape[1] * inner)
            return
        out = self.define(node)
        self.emit(pg.SLICE, [out.operand, base.operand], [outer, shape[axis] * inner, start * inner,
                                                          (stop - start) * inner], label="slice")

    def _op_get_rows(self, node: Node) -> None:
        table, ids = node.inputs
        id_value = self.v(ids)
        id_bytes = 4 * WORDS_PER[id_value.dtype]
        table_value = self.values[table.id]
        out = self.define(node)
        if table_value.weight >= 0:
            self.emit(pg.GET_ROWS_W, [out.operand, id_value.operand], [id_value.size, table_value.weight, 0,
                                                                       id_bytes], label="get_rows")
            return
        row_words = prod(table_value.shape[1:]) * WORDS_PER[table_value.dtype]
        self.emit(pg.GET_ROWS, [out.operand, table_value.operand, id_value.operand],
                  [id_value.size, row_words, table_value.shape[0], id_bytes], label="get_rows")

    def _op_mul_mat(self, node: Node) -> None:
        weight = self.values[node.inputs[0].id]
        if weight.weight < 0:
            raise ModelError(f"native backend cannot compile op 'mul_mat' of {node!r}: its first input is not a "
                             "repacked weight matrix")
        x = self.v(node.inputs[1])
        m = x.size // weight.shape[1]
        info = self.weight_infos[weight.weight]
        scratch = pg.NONE
        temp = None
        if info.kind in QUANTIZED_KINDS:
            temp = self.new_value((pg.activation_words(m, info.n_cols),), "f32")
            scratch = temp.operand
        out = self.define(node)
        self.emit(pg.MUL_MAT, [out.operand, x.operand, scratch], [weight.weight, m], label="mul_mat")
        if temp is not None:
            self.release(temp)

    def _binary(self, node: Node) -> None:
        a, b = (self.v_rows(i) for i in node.inputs)
        if node.op == "add" and self.fuse_residual(node, a, b):
            return
        out = self.define(node)
        dims, sa, sb = broadcast_strides(out.shape, a.shape, b.shape)
        for value, strides in ((a, sa), (b, sb)):  # a strided view's rows (its first axis) are row_stride apart
            first = 4 - len(value.shape)
            if value.row_stride and strides[first]:
                strides[first] = value.row_stride
        self.emit(pg.BINARY, [out.operand, a.operand, b.operand], [pg.BINARY_KINDS[node.op], *dims, *sa, *sb],
                  label=node.op)

    _op_add = _op_sub = _op_mul = _op_div = _binary

    def fuse_residual(self, node: Node, a: Value, b: Value) -> bool:
        """``add`` of the product the last instruction wrote (read by nothing else) and a value of its shape: the
        matmul adds it as each thread finishes its rows (a residual connection), and the sum takes the product's
        place. The residual existed before the matmul ran: it is an input of this add, which follows the matmul
        directly. Same bits: one float add per element either way."""
        last = self.instrs[-1] if self.instrs else None
        if last is None or last.op != pg.MUL_MAT or len(last.args) != 3:  # out, x, scratch: no residual yet
            return False
        for product, residual in ((a, b), (b, a)):
            source = node.inputs[0] if product is a else node.inputs[1]
            if (product.operand == last.args[0] and product.root >= 0 and self.uses.get(source.id, 0) == 1
                    and source.id not in self.split.output_ids and residual.shape == product.shape
                    and not residual.row_stride and residual.operand != product.operand):
                last.args.append(residual.operand)
                if node.id in self.split.output_ids:  # the matmul writes the sum into the output's own buffer
                    last.args[0] = self.define(node).operand
                    self.release(product)
                else:
                    self.alias(node, product, product.shape)
                return True
        return False

    def _unary(self, node: Node, params: Sequence[float] = ()) -> None:
        x = self.v_rows(node.inputs[0])
        _, width, stride = row_layout(x)
        out = self.define(node)
        self.emit(pg.UNARY, [out.operand, x.operand], [pg.UNARY_KINDS[node.op], x.size, width, stride], params,
                  label=node.op)

    _op_silu = _op_relu = _op_gelu = _op_sigmoid = _op_softplus = _unary

    def _op_scale(self, node: Node) -> None:
        self._unary(node, [float(F32(node.attr_float("s")))])

    def _op_softcap(self, node: Node) -> None:
        self._unary(node, [float(F32(node.attr_float("cap")))])

    def _op_clamp(self, node: Node) -> None:
        self._unary(node, [float(F32(node.attr_float("min"))), float(F32(node.attr_float("max")))])

    def _op_swiglu(self, node: Node) -> None:
        gate, up = (self.v_rows(i) for i in node.inputs)
        if gate.shape != up.shape:
            raise ModelError(f"native backend: swiglu of shapes {gate.shape} and {up.shape}")
        (rows, width, gate_stride), (_, _, up_stride) = row_layout(gate), row_layout(up)
        out = self.define(node)
        self.emit(pg.SWIGLU, [out.operand, gate.operand, up.operand], [rows, width, gate_stride, up_stride],
                  label="swiglu")

    def row_groups(self, node: Node) -> tuple[Value, list[int]]:
        """``node``'s activation for a row op over its last axis, and the op's rows, row length, rows per group and
        group stride (a strided view's groups: the rows of one of its rows, e.g. a token's heads)."""
        x = self.v_rows(node.inputs[0])
        n = x.shape[-1]
        rows = x.size // n if n else 0
        if x.row_stride and len(x.shape) > 1:
            return x, [rows, n, x.size // x.shape[0] // n, x.row_stride]
        return x, [rows, n, max(rows, 1), rows * n]

    def _norm(self, node: Node) -> None:
        x, shape = self.row_groups(node)
        n = x.shape[-1]
        w = pg.NONE
        if len(node.inputs) > 1:
            weight = self.v(node.inputs[1])
            if weight.size != n:
                raise ModelError(f"native backend: a norm weight of shape {weight.shape} for rows of {n}")
            w = weight.operand
        out = self.define(node)
        op = pg.RMS_NORM if node.op == "rms_norm" else pg.NORM
        self.emit(op, [out.operand, x.operand, w], shape, [node.attr_float("eps")], label=node.op)

    _op_rms_norm = _op_norm = _norm

    def _op_softmax(self, node: Node) -> None:
        x, shape = self.row_groups(node)
        out = self.define(node)
        self.emit(pg.SOFTMAX, [out.operand, x.operand], shape, label="softmax")

    def rope(self, node: Node, x: pg.Operand, out: pg.Operand, pos: Value, factors: Node | None,
             dims: tuple[int, int, int], strides: tuple[int, int, int, int], label: str, f16: bool = False) -> None:
        n_dims, mode = node.attr_int("n_dims"), node.attr_str("mode")
        if mode not in ("norm", "neox"):
            raise ModelError(f"native backend: rope mode {mode!r} has no kernel")
        if pos.dtype != "i32":
            raise ModelError(f"native backend: rope positions of type {pos.dtype}")
        freq_base, freq_scale = node.attr_float("freq_base"), node.attr_float("freq_scale")
        ext = node.attr_float("ext_factor", 0.0)
        mix = None
        if ext != 0.0:
            mix = yarn_ramp_mix(n_dims, node.attr_int("n_ctx_orig"), freq_base, node.attr_float("beta_fast"),
                                node.attr_float("beta_slow"), ext)
        ff = pg.NONE if factors is None else self.v(factors).operand
        theta_scale = F32(freq_base ** (-2.0 / n_dims))
        magnitude = F32(F32(node.attr_float("attn_factor", 1.0)) * yarn_magnitude(freq_scale, ext))
        f = [float(theta_scale), float(F32(freq_scale)), float(magnitude), float(ext != 0.0)]
        angles = self.rope_angles(pos, ff, mix, n_dims, f)  # the rope reads its angles there, not ff and mix
        self.emit(pg.ROPE, [out, x, pos.operand, pg.NONE, pg.NONE, angles],
                  [*dims, n_dims, int(mode == "neox"), *strides, int(f16)], f, label=label)

    def rope_angles(self, pos: Value, ff: pg.Operand, mix: np.ndarray | None, n_dims: int,
                    f: list[float]) -> pg.Operand:
        """The table of cos / sin that every rope of these positions and parameters reads (each layer rotates q
        and k by the same angles: their sines and cosines are worked out once a run, not per rope and layer)."""
        mix_key = b"" if mix is None else np.asarray(mix, dtype=np.float32).tobytes()
        key = (pos.buf, pos.off, pos.root, ff, mix_key, n_dims, *f)
        table = self._rope_tables.get(key)
        if table is None:
            table = pg.Operand(0, self.arena.alloc(pos.size * n_dims))  # for the whole run: never released
            mix_operand = pg.NONE if mix is None else self.constant(mix)
            self.emit(pg.ROPE_ANGLES, [table, pg.NONE, pos.operand, ff, mix_operand], [pos.size, 0, 0, n_dims], f,
                      label="rope")
            self._rope_tables[key] = table
        return table

    def _op_rope(self, node: Node) -> None:
        x, pos = self.v_rows(node.inputs[0]), self.v(node.inputs[1])
        n_tokens, n_head, dim = x.shape
        out = self.define(node)
        factors = node.inputs[2] if len(node.inputs) > 2 else None
        self.rope(node, x.operand, out.operand, pos, factors, (n_tokens, n_head, dim),
                  (row_layout(x)[2], dim, n_head * dim, dim), "rope")

    def _op_k_shift(self, node: Node) -> None:
        storage = self.kv_storage(node)
        shift = self.v(node.inputs[0])
        n_head_kv, n_cells, dim = storage.k.shape
        cache = pg.Operand(self.buffer(storage.k, writable=True), 0)
        factors = node.inputs[1] if len(node.inputs) > 1 else None
        self.rope(node, cache, cache, shift, factors, (shift.size, n_head_kv, dim),
                  (dim, n_cells * dim, dim, n_cells * dim), "k_shift", f16=storage.k.dtype == np.float16)
        self.define(node)

    def _op_attention(self, node: Node) -> None:
        q, idx, mask = self.v(node.inputs[0]), self.v(node.inputs[3]), self.v(node.inputs[4])
        storage = self.kv_storage(node)
        n_head_kv, n_cells, dk = storage.k.shape
        dv = storage.v.shape[2]
        n_tokens, n_head = q.shape[0], q.shape[1]
        k, v = (self.token_rows(i, n_tokens) for i in node.inputs[1:3])
        if idx.dtype != "i64" or k.size != n_tokens * n_head_kv * dk or v.size != n_tokens * n_head_kv * dv:
            raise ModelError(f"native backend: attention inputs {q.shape}, {k.shape}, {v.shape} do not fit the KV "
                             f"cache {storage.k.shape}")
        k_cache = pg.Operand(self.buffer(storage.k, writable=True), 0)
        v_cache = pg.Operand(self.buffer(storage.v, writable=True), 0)
        f16 = int(storage.k.dtype == np.float16)
        self.emit(pg.KV_WRITE, [k_cache, v_cache, k.operand, v.operand, idx.operand],
                  [n_tokens, n_head_kv, dk, dv, n_cells, k.row_stride or n_head_kv * dk,
                   v.row_stride or n_head_kv * dv, f16], label="kv_write")
        order, sinks = attention_extras(node.inputs)
        out = self.define(node)
        softcap = node.attr_float("softcap", 0.0)
        self.emit(pg.ATTEND, [out.operand, q.operand, k_cache, v_cache, mask.operand,
                              pg.NONE if sinks is None else self.v(sinks).operand, self.cell_order(order, mask)],
                  [n_tokens, n_head, n_head_kv, dk, dv, mask.shape[1], n_cells, f16],
                  [node.attr_float("scale"), softcap], label="attention")

    def token_rows(self, node: Node, n_tokens: int) -> Value:
        """``node``'s activation with a row per token, possibly strided (contiguous if its rows are not the tokens)."""
        value = self.v_rows(node)
        return value if value.shape[:1] == (n_tokens,) else self.v(node)

    def cell_order(self, order: Node | None, mask: Value) -> pg.Operand:
        """The attention's kv_order operand (the cells in the order their terms are summed: by position, so a row
        has the same bits wherever its cells sit), or none (cell order) for a graph without one."""
        if order is None:
            return pg.NONE
        value = self.v(order)
        if value.dtype != "i32" or value.shape != (mask.shape[1],):
            raise ModelError(f"native backend: an attention kv_order {value.dtype}{list(value.shape)} for "
                             f"{mask.shape[1]} cells")
        return value.operand

    # the recurrent ops (recurrent.py)
    _op_ssm_conv = recurrent.compile_ssm_conv
    _op_conv_window = recurrent.compile_conv_window
    _op_ssm_scan = recurrent.compile_ssm_scan
    _op_gated_delta = recurrent.compile_gated_delta

    # -- the mixture-of-experts ops (csrc/moe.c) ---------------------------------------------------------------------
    def expert_matmul(self, node: Node, x: Value, ids: pg.Operand, n_tokens: int, n_used: int, id_bytes: int) -> None:
        """Row (t, j) of the output = x's row of (t, j) times expert ids[t, j]'s matrix (x: a row per token, or
        per (token, slot))."""
        weight = self.values[node.inputs[0].id]
        if weight.weight < 0 or len(weight.shape) != 3:
            raise ModelError(f"native backend cannot compile op {node.op!r} of {node!r}: its first input is not a "
                             "repacked 3-D weight")
        n_expert, _, n_in = weight.shape
        per_slot = int(len(x.shape) == 3)
        if x.shape[-1] != n_in or x.size != n_tokens * (n_used if per_slot else 1) * n_in:
            raise ModelError(f"native backend: {node.op} of activations {x.shape} by matrices {weight.shape}")
        info = self.weight_infos[weight.weight]
        scratch = self.new_value((pg.moe_scratch_words(n_expert, n_tokens * n_used, x.size // n_in, info),), "f32")
        out = self.define(node)
        self.emit(pg.MUL_MAT_ID, [out.operand, x.operand, ids, scratch.operand],
                  [weight.weight, n_expert, n_tokens, n_used, per_slot, id_bytes], label=node.op)
        self.release(scratch)

    def ids(self, node: Node) -> tuple[Value, int]:
        """An id operand and its bytes per id."""
        value = self.v(node)
        if value.dtype not in ("i32", "i64"):
            raise ModelError(f"native backend: ids of type {value.dtype}")
        return value, 4 * WORDS_PER[value.dtype]

    def _op_mul_mat_id(self, node: Node) -> None:
        ids, id_bytes = self.ids(node.inputs[2])
        n_tokens, n_used = ids.shape
        self.expert_matmul(node, self.v(node.inputs[1]), ids.operand, n_tokens, n_used, id_bytes)

    def _op_mul_mat_heads(self, node: Node) -> None:
        """Head h's rows times matrix h: a mul_mat_id whose ids are 0..H-1 on every token."""
        x = self.v(node.inputs[1])
        n_tokens, n_head = x.shape[0], x.shape[1]
        heads = np.tile(np.arange(n_head, dtype=np.int32), n_tokens)
        self.expert_matmul(node, x, pg.Operand(self.buffer(heads), 0), n_tokens, n_head, 4)

    def _op_add_id(self, node: Node) -> None:
        a, b = self.v(node.inputs[0]), self.v(node.inputs[1])
        ids, id_bytes = self.ids(node.inputs[2])
        width = a.shape[-1]
        if len(b.shape) != 2 or b.shape[1] != width or ids.size * width != a.size:
            raise ModelError(f"native backend: add_id of {a.shape}, {b.shape} and ids {ids.shape}")
        out = self.define(node)
        self.emit(pg.ADD_ID, [out.operand, a.operand, b.operand, ids.operand], [ids.size, width, b.shape[0], id_bytes],
                  label="add_id")

    def _op_top_k(self, node: Node) -> None:
        x = self.v(node.inputs[0])
        width, k = x.shape[-1], node.attr_int("k")
        out = self.define(node)
        self.emit(pg.TOP_K, [out.operand, x.operand], [x.size // width, width, k], label="top_k")

    def _rows_by_ids(self, node: Node) -> None:
        x = self.v(node.inputs[0])
        ids, id_bytes = self.ids(node.inputs[1])
        width, k = x.shape[-1], ids.shape[-1]
        if x.size // width != ids.size // k:
            raise ModelError(f"native backend: {node.op} of {x.shape} by ids {ids.shape}")
        out = self.define(node)
        op = pg.TAKE if node.op == "take" else pg.ID_MASK
        self.emit(op, [out.operand, x.operand, ids.operand], [x.size // width, width, k, id_bytes], label=node.op)

    _op_take = _op_id_mask = _rows_by_ids

    def _op_sum_rows(self, node: Node) -> None:
        x = self.v(node.inputs[0])
        out = self.define(node)
        self.emit(pg.SUM_ROWS, [out.operand, x.operand], [x.size // x.shape[-1], x.shape[-1]], label="sum_rows")

    def _op_swiglu_oai(self, node: Node) -> None:
        gate, up = (self.v(i) for i in node.inputs)
        if gate.shape != up.shape:
            raise ModelError(f"native backend: swiglu_oai of shapes {gate.shape} and {up.shape}")
        out = self.define(node)
        self.emit(pg.SWIGLU_OAI, [out.operand, gate.operand, up.operand], [gate.size],
                  [float(F32(node.attr_float("alpha"))), float(F32(node.attr_float("limit")))], label="swiglu_oai")

    def _op_concat(self, node: Node) -> None:
        a, b = (self.v(i) for i in node.inputs)
        if a.shape[:-1] != b.shape[:-1]:
            raise ModelError(f"native backend: concat of shapes {a.shape} and {b.shape}")
        out = self.define(node)
        self.emit(pg.CONCAT, [out.operand, a.operand, b.operand], [a.size // a.shape[-1], a.shape[-1], b.shape[-1]],
                  label="concat")
