"""The native Backend class: every op of a split in the C kernels (csrc/), weights repacked at load in their own
bits (repack.py). A split compiles once into a flat program (program.py) that one C call runs per compute, with the
GIL released: no Python per op per token. An op the kernels lack makes the backend decline the model with a
:class:`ModelError` naming it."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from dataclasses import dataclass, field, replace
from math import prod
from typing import Any, Hashable, Literal, Mapping, Sequence

import numpy as np

from llmfw.core.exec.backend import (Backend, BackendOptions, CompiledSplit, KVLayerShape, Split, WeightSource,
                                     release_freed_memory)
from llmfw.core.exec.compiler import SplitCompilerBase, check_inputs
from llmfw.core.exec.weight_cache import CachedLoad, CacheOptions, cache_dirs_from
from llmfw.core.errors import BackendUnavailable, ModelError
from llmfw.core.format.quants import GGMLType
from llmfw.core.ir.graph import DYNAMIC, Node
from llmfw.core.ir.rope import yarn_magnitude, yarn_ramp_mix
import llmfw.plugins.backends.native.kernels as kernels
import llmfw.plugins.backends.native.program as pg
from llmfw.plugins.backends.native.cache import NativeCache
from llmfw.plugins.backends.native.repack import ROWS, SUPPORTED_TYPES, PackedWeight, repack
from llmfw.plugins.backends.numpy.kernels import F32, NumpyKV
from llmfw.plugins.backends.numpy.runtime import SWIGLU
from llmfw.plugins.backends.numpy.weights import NumpyWeights

log = logging.getLogger(__name__)

#: the graph ops the programs run (and ``swiglu``, this backend's rewrite rule)
NATIVE_OPS = frozenset({"get_rows", "mul_mat", "add", "sub", "mul", "div", "scale", "rms_norm", "norm", "silu",
                        "relu", "gelu", "sigmoid", "softplus", "softcap", "clamp", "softmax", "reshape", "slice",
                        "rope", "attention", "k_shift"})
#: GGML types whose weights the kernels take (as matrices, or as the float arrays of norms and biases)
_KNOWN_TYPES = frozenset(int(t) for t in SUPPORTED_TYPES)
WORDS_PER = {"f32": 1, "i32": 1, "i64": 2}
NP_DTYPES = {"f32": np.float32, "i32": np.int32, "i64": np.int64}


class NativeOptions(CacheOptions):
    """``backend_options: {native: {...}}``."""

    #: the kernels' instruction set: auto = the widest this CPU runs; a named one is an error where it cannot run
    isa: Literal["auto", "scalar", "avx2", "avx512"] = "auto"
    #: time every instruction of every program (``NativeBackend.profile()`` sums them per op)
    profile: bool = False


@dataclass
class NativeMatrix:
    """A matmul (or row lookup) weight in the kernels' layout."""

    packed: PackedWeight
    c_struct: kernels.NatWeight = field(repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape

    @property
    def ndim(self) -> int:
        return 2


def native_matrix(packed: PackedWeight) -> NativeMatrix:
    return NativeMatrix(packed, kernels.c_weight(packed))


@dataclass
class Value:
    """Where a graph value lives in a program: buffer (0 = the arena) and word offset, its shape and type; a
    matrix is ``weight`` (an index into the program's weight table) instead."""

    buf: int
    off: int
    shape: tuple[int, ...]
    dtype: str
    weight: int = -1
    #: the arena allocation this value is a view of (reshapes and contiguous slices share it)
    root: int = -1

    @property
    def operand(self) -> pg.Operand:
        return pg.Operand(self.buf, self.off)

    @property
    def size(self) -> int:
        return prod(self.shape)



class NativeCompiler(SplitCompilerBase[NumpyKV]):
    """A split → one checked :class:`~llmfw.plugins.backends.native.program.Program` (``input_shapes``: the concrete
    shapes of inputs the graph left DYNAMIC, e.g. the K-shift's)."""

    backend_name = "native"
    kv_class = NumpyKV

    def __init__(self, backend: "NativeBackend", split: Split, kv: Mapping[tuple[str, int], NumpyKV],
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
        """A fresh arena value for ``node``'s output."""
        value = self.new_value(self.node_shape(node), node.dtype or "f32")
        self.values[node.id] = value
        return value

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
            if array.dtype not in (np.float32, np.int32, np.int64) or not array.flags.c_contiguous:
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
        value = self.values.get(node.id)
        if value is None or value.weight >= 0:
            raise ModelError(f"native backend: {node!r} is used as an activation but is a matrix")
        return value

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
        if not isinstance(handle, np.ndarray):
            raise ModelError(f"native backend: weight {name!r} is stored as {type(handle).__name__}, which the "
                             "kernels cannot read")
        self.values[node.id] = Value(self.buffer(handle), 0, tuple(handle.shape), "f32")

    def compile_release(self, node_ids: Sequence[int]) -> None:
        for node_id in node_ids:
            value = self.values.get(node_id)
            if value is not None:
                self.release(value)

    def compile_program(self) -> tuple[pg.Program, list[tuple[int, np.ndarray]], list[tuple[int, np.ndarray]]]:
        """The program, and the arena views its inputs are copied into and its outputs read from."""
        graph_inputs = {n.id: n for n in self.split.nodes if n.op == "input"}
        consumers = {i.id: i for n in self.split.nodes for i in n.inputs}
        for node_id, _ in self.required_inputs():
            node = graph_inputs.get(node_id) or consumers[node_id]
            self.define(node)
        self.walk()
        program = pg.Program(self.instrs, self.arena.size, self.buffers, self.writable, self.weights,
                             self.weight_infos)
        inputs = [(i, self.view_of(program, self.values[i])) for i, _ in self.required_inputs()]
        outputs = [(i, self.view_of(program, self.values[i])) for i in self.split.output_ids]
        return program, inputs, outputs

    @staticmethod
    def view_of(program: pg.Program, value: Value) -> np.ndarray:
        if value.buf != 0:
            raise ModelError("native backend: a split input or output that is not an activation")
        return program.view(value.off, value.shape, value.dtype)

    # -- ops ---------------------------------------------------------------------------------------------------------
    def _op_reshape(self, node: Node) -> None:
        base = self.v(node.inputs[0])
        self.alias(node, base, self.node_shape(node))

    def _op_slice(self, node: Node) -> None:
        base = self.v(node.inputs[0])
        shape = base.shape
        axis = int(node.attrs.get("axis", -1)) % len(shape)
        start, stop, _ = slice(node.attrs.get("start"), node.attrs.get("stop")).indices(shape[axis])
        inner = prod(shape[axis + 1:]) * WORDS_PER[base.dtype]
        outer = prod(shape[:axis])
        out_shape = self.node_shape(node)
        if outer == 1 or out_shape[axis] == shape[axis]:  # one contiguous range: a view
            self.alias(node, base, out_shape, start * inner)
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
        if info.kind in (pg.KIND_QNIB, pg.KIND_QBYTE):
            temp = self.new_value((pg.activation_words(m, info.n_cols),), "f32")
            scratch = temp.operand
        out = self.define(node)
        self.emit(pg.MUL_MAT, [out.operand, x.operand, scratch], [weight.weight, m], label="mul_mat")
        if temp is not None:
            self.release(temp)

    def _binary(self, node: Node) -> None:
        a, b = (self.v(i) for i in node.inputs)
        out = self.define(node)
        dims, sa, sb = broadcast_strides(out.shape, a.shape, b.shape)
        self.emit(pg.BINARY, [out.operand, a.operand, b.operand], [pg.BINARY_KINDS[node.op], *dims, *sa, *sb],
                  label=node.op)

    _op_add = _op_sub = _op_mul = _op_div = _binary

    def _unary(self, node: Node, params: Sequence[float] = ()) -> None:
        x = self.v(node.inputs[0])
        out = self.define(node)
        self.emit(pg.UNARY, [out.operand, x.operand], [pg.UNARY_KINDS[node.op], x.size], params, label=node.op)

    _op_silu = _op_relu = _op_gelu = _op_sigmoid = _op_softplus = _unary

    def _op_scale(self, node: Node) -> None:
        self._unary(node, [float(F32(node.attr_float("s")))])

    def _op_softcap(self, node: Node) -> None:
        self._unary(node, [float(F32(node.attr_float("cap")))])

    def _op_clamp(self, node: Node) -> None:
        self._unary(node, [float(F32(node.attr_float("min"))), float(F32(node.attr_float("max")))])

    def _op_swiglu(self, node: Node) -> None:
        gate, up = (self.v(i) for i in node.inputs)
        if gate.shape != up.shape:
            raise ModelError(f"native backend: swiglu of shapes {gate.shape} and {up.shape}")
        out = self.define(node)
        self.emit(pg.SWIGLU, [out.operand, gate.operand, up.operand], [0, gate.size], label="swiglu")

    def _norm(self, node: Node) -> None:
        x = self.v(node.inputs[0])
        n = x.shape[-1]
        w = pg.NONE
        if len(node.inputs) > 1:
            weight = self.v(node.inputs[1])
            if weight.size != n:
                raise ModelError(f"native backend: a norm weight of shape {weight.shape} for rows of {n}")
            w = weight.operand
        out = self.define(node)
        op = pg.RMS_NORM if node.op == "rms_norm" else pg.NORM
        self.emit(op, [out.operand, x.operand, w], [x.size // n, n], [node.attr_float("eps")], label=node.op)

    _op_rms_norm = _op_norm = _norm

    def _op_softmax(self, node: Node) -> None:
        x = self.v(node.inputs[0])
        out = self.define(node)
        self.emit(pg.SOFTMAX, [out.operand, x.operand], [x.size // x.shape[-1], x.shape[-1]], label="softmax")

    def rope(self, node: Node, x: pg.Operand, out: pg.Operand, pos: Value, factors: Node | None,
             dims: tuple[int, int, int], strides: tuple[int, int, int, int], label: str) -> None:
        attrs = node.attrs
        n_dims, mode = node.attr_int("n_dims"), node.attr_str("mode")
        if mode not in ("norm", "neox"):
            raise ModelError(f"native backend: rope mode {mode!r} has no kernel")
        if pos.dtype != "i32":
            raise ModelError(f"native backend: rope positions of type {pos.dtype}")
        freq_base, freq_scale = node.attr_float("freq_base"), node.attr_float("freq_scale")
        ext = node.attr_float("ext_factor", 0.0)
        mix = pg.NONE
        if ext != 0.0:
            mix = self.constant(yarn_ramp_mix(n_dims, node.attr_int("n_ctx_orig"), freq_base,
                                              node.attr_float("beta_fast"), node.attr_float("beta_slow"), ext))
        ff = pg.NONE if factors is None else self.v(factors).operand
        theta_scale = F32(freq_base ** (-2.0 / n_dims))
        magnitude = F32(F32(attrs.get("attn_factor", 1.0)) * yarn_magnitude(freq_scale, ext))
        self.emit(pg.ROPE, [out, x, pos.operand, ff, mix], [*dims, n_dims, int(mode == "neox"), *strides],
                  [float(theta_scale), float(F32(freq_scale)), float(magnitude), float(ext != 0.0)], label=label)

    def _op_rope(self, node: Node) -> None:
        x, pos = self.v(node.inputs[0]), self.v(node.inputs[1])
        n_tokens, n_head, dim = x.shape
        out = self.define(node)
        factors = node.inputs[2] if len(node.inputs) > 2 else None
        self.rope(node, x.operand, out.operand, pos, factors, (n_tokens, n_head, dim),
                  (n_head * dim, dim, n_head * dim, dim), "rope")

    def _op_k_shift(self, node: Node) -> None:
        storage = self.kv_storage(node)
        shift = self.v(node.inputs[0])
        n_head_kv, n_cells, dim = storage.k.shape
        cache = pg.Operand(self.buffer(storage.k, writable=True), 0)
        factors = node.inputs[1] if len(node.inputs) > 1 else None
        self.rope(node, cache, cache, shift, factors, (shift.size, n_head_kv, dim),
                  (dim, n_cells * dim, dim, n_cells * dim), "k_shift")
        self.define(node)

    def _op_attention(self, node: Node) -> None:
        q, k, v, idx, mask = (self.v(i) for i in node.inputs[:5])
        storage = self.kv_storage(node)
        n_head_kv, n_cells, dk = storage.k.shape
        dv = storage.v.shape[2]
        n_tokens, n_head = q.shape[0], q.shape[1]
        if idx.dtype != "i64" or k.size != n_tokens * n_head_kv * dk or v.size != n_tokens * n_head_kv * dv:
            raise ModelError(f"native backend: attention inputs {q.shape}, {k.shape}, {v.shape} do not fit the KV "
                             f"cache {storage.k.shape}")
        k_cache = pg.Operand(self.buffer(storage.k, writable=True), 0)
        v_cache = pg.Operand(self.buffer(storage.v, writable=True), 0)
        self.emit(pg.KV_WRITE, [k_cache, v_cache, k.operand, v.operand, idx.operand],
                  [n_tokens, n_head_kv, dk, dv, n_cells], label="kv_write")
        sinks = self.v(node.inputs[5]).operand if len(node.inputs) > 5 else pg.NONE
        out = self.define(node)
        softcap = float(node.attrs.get("softcap", 0.0) or 0.0)
        self.emit(pg.ATTEND, [out.operand, q.operand, k_cache, v_cache, mask.operand, sinks],
                  [n_tokens, n_head, n_head_kv, dk, dv, mask.shape[1], n_cells],
                  [node.attr_float("scale"), softcap], label="attention")


def broadcast_strides(out: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> tuple[list[int], list[int],
                                                                                                list[int]]:
    """numpy broadcasting as 4 dims and each operand's word strides (0 along a broadcast axis)."""
    if len(out) > 4:
        raise ModelError(f"native backend: an elementwise op over {len(out)} dimensions (at most 4)")
    dims = [1] * (4 - len(out)) + list(out)

    def strides(shape: tuple[int, ...]) -> list[int]:
        padded = [1] * (4 - len(shape)) + list(shape)
        result, step = [0] * 4, 1
        for axis in range(3, -1, -1):
            result[axis] = step if padded[axis] != 1 else 0
            step *= padded[axis]
        return result

    return dims, strides(a), strides(b)


class CompiledProgram:
    """A compiled split: copy the inputs into the arena, one C call, copy the outputs out. A split whose inputs the
    graph left DYNAMIC (the K-shift) compiles per input shape, at its first run with that shape."""

    def __init__(self, backend: "NativeBackend", split: Split, kv: Mapping[tuple[str, int], NumpyKV]):
        self.backend, self.split, self.kv = backend, split, kv
        compiler = NativeCompiler(backend, split, kv)
        self.required = compiler.required_inputs()
        nodes = {i.id: i for n in split.nodes for i in (n, *n.inputs)}
        self.dynamic = [i for i, _ in self.required if nodes[i].shape is None or DYNAMIC in (nodes[i].shape or ())]
        self.programs: dict[tuple[Any, ...], tuple[pg.Program, list[tuple[int, np.ndarray]],
                                                   list[tuple[int, np.ndarray]]]] = {}
        if not self.dynamic:
            self.programs[()] = compiler.compile_program()
        else:  # the ops must still be known now: decline at compile time, not at the first run
            for node in split.nodes:
                if node.op not in ("input", "weight"):
                    compiler.op_handler(node)

    def __call__(self, inputs: Mapping[int, Any]) -> dict[int, Any]:
        check_inputs(self.required, inputs)
        key = tuple(np.shape(inputs[i]) for i in self.dynamic)
        compiled = self.programs.get(key)
        if compiled is None:
            shapes = {i: tuple(np.shape(inputs[i])) for i in self.dynamic}
            compiled = self.programs[key] = NativeCompiler(self.backend, self.split, self.kv, shapes).compile_program()
        program, input_views, output_views = compiled
        for node_id, view in input_views:
            value = np.asarray(inputs[node_id])
            if value.shape != view.shape:
                raise ModelError(f"native backend: input %{node_id} has shape {value.shape}, its program "
                                 f"{view.shape}")
            np.copyto(view, value, casting="unsafe")
        program.run(self.backend.pool, self.backend.isa, self.backend.native_options.profile)
        return {node_id: view.copy() for node_id, view in output_views}


class NativeBackend(NumpyWeights):
    """Every op in llmfw's own C kernels (every GGUF block type in its own bits, integer dot products, batch
    invariant by construction), a split run as one compiled program; see the package docstring."""

    name = "native"
    options_schema = NativeOptions
    supported_ops = NATIVE_OPS
    rewrite_rules = (SWIGLU,)
    is_host = True
    environment_options = {"LLMFW_NATIVE_ISA": "isa", "LLMFW_NATIVE_CACHE": "cache",
                           "LLMFW_NATIVE_CACHE_DIR": "cache_dir"}
    #: the built extension: missing when the install could not compile it (``llmfw plugins`` says so)
    requires = (kernels.EXTENSION,)
    #: not a default yet (``--backend native`` opts in)
    default_priority: Mapping[str, int] = {}

    def __init__(self, device: str | None = None, options: BackendOptions | None = None):
        super().__init__(device, options)
        self.native_options = self.options_as(NativeOptions)
        self.isa = kernels.resolve_isa(self.native_options.isa)
        self._pool: kernels.ThreadPool | None = None
        self._programs: list[CompiledProgram] = []
        #: one repacked copy per file tensor: a tied head and the embedding it looks rows up in share it
        self._packed_by_source: dict[str, NativeMatrix] = {}
        self._load: CachedLoad[PackedWeight] | None = None
        #: weights the last load repacked from the model file rather than mapped from the cache (cache.py)
        self.weights_converted = 0

    @classmethod
    def install_hint(cls) -> str:
        return kernels.BUILD_HINT

    @classmethod
    def check_available(cls, device: str | None = None) -> None:
        if device not in (None, "cpu"):
            raise BackendUnavailable(f"the native backend runs on the CPU only, not on device {device!r}")
        kernels.load_library()

    @classmethod
    def cache_dirs(cls, environ: Mapping[str, str]) -> list[Path]:
        """The repacked-weight cache (``LLMFW_NATIVE_CACHE_DIR`` moves it, as the ``cache_dir`` option does)."""
        return cache_dirs_from(environ, "LLMFW_NATIVE_CACHE_DIR", "native")

    # -- threads ------------------------------------------------------------------------------------------
    @property
    def pool(self) -> kernels.ThreadPool:
        if self._pool is None:
            self._pool = kernels.ThreadPool(self.n_threads or os.cpu_count() or 1)
        return self._pool

    def set_n_threads(self, n_threads: int | None) -> None:
        Backend.set_n_threads(self, n_threads)
        if self._pool is not None and self._pool.n_threads != (n_threads or os.cpu_count() or 1):
            self._pool.close()
            self._pool = None

    def decline_reason(self, ops: frozenset[str], weight_types: Mapping[str, int]) -> str | None:
        """An op without a kernel, or a weight type without one: the programs would fail, not fall back."""
        missing = sorted(ops - self.supported_ops)
        if missing:
            return f"the native backend has no kernel for op {', '.join(map(repr, missing))}"
        types = sorted({GGMLType(t).name for t in weight_types.values() if t not in _KNOWN_TYPES})
        if types:
            return f"the native backend has no kernel for {', '.join(types)} weights"
        return None

    # -- weights ------------------------------------------------------------------------------------------
    def begin_loading(self, model_file: Path) -> None:
        root = self.native_options.cache_root("native")
        self._load = CachedLoad(None if root is None else NativeCache.for_file(root, model_file))

    def end_loading(self) -> None:
        """Store the repacked weights when any was repacked, and keep the copies mapped back from the entry."""
        if self._load is not None:
            self.weights_converted = self._load.converted
            # a matrix shared by several names (a tied head and its embedding) is stored and mapped back once
            names_of: dict[int, list[str]] = {}
            for name, handle in self.weights.items():
                if isinstance(handle, NativeMatrix):
                    names_of.setdefault(id(handle), []).append(name)
            stored = self._load.finish({names[0]: self.weights[names[0]].packed for names in names_of.values()})
            for names in names_of.values():
                if names[0] in stored:
                    mapped = native_matrix(stored[names[0]])
                    for name in names:
                        self.weights[name] = mapped
        self._packed_by_source.clear()
        self._load = None

    def _repacked(self, source: WeightSource) -> PackedWeight:
        def convert(s: WeightSource) -> PackedWeight:
            return repack(s.raw, s.ggml_type, s.ne)

        if self._load is None:
            return convert(source)
        packed = self._load.load(source, convert)
        # a stored weight was checked against its own description; this checks that against the tensor
        expected = (int(np.prod(source.ne[1:], dtype=np.int64)), int(source.ne[0]))
        if packed.shape == expected:
            return packed
        self._load.converted += 1  # so that the entry is rewritten
        return convert(source)

    def load_weight(self, source: WeightSource) -> Any:
        if not source.usage & {"mul_mat", "get_rows"} or len(source.ne) != 2:
            return super().load_weight(source)
        qtype = GGMLType(source.ggml_type)
        if qtype not in SUPPORTED_TYPES:
            raise ModelError(f"native backend: no kernel for {qtype.name} weights ({source.name}); use another "
                             "backend for this model")
        shared = self._packed_by_source.get(source.source_name)
        if shared is None or shared.packed.shape != tuple(reversed(source.ne)):
            shared = self._packed_by_source[source.source_name] = native_matrix(self._repacked(source))
        return shared

    def fusion_key(self, weight_name: str) -> Hashable | None:
        handle = self.weights.get(weight_name)
        if not isinstance(handle, NativeMatrix):
            return None
        packed = handle.packed
        if packed.n_rows % ROWS:
            return None  # row groups of a part must be whole to be stacked
        return (packed.kind, packed.n_scales, packed.has_offsets, packed.table.tobytes(), packed.n_cols)

    def fuse_weights(self, name: str, parts: tuple[str, ...]) -> bool:
        members = [self.weights.get(n) for n in parts]
        packed = [m.packed for m in members if isinstance(m, NativeMatrix)]
        if len(packed) != len(parts) or len({self.fusion_key(n) for n in parts}) != 1 or \
                self.fusion_key(parts[0]) is None:
            return False
        # the layout is row-group major, so stacking whole groups is stacking their bytes; each part then becomes a
        # view of its bytes in the fused copy, and its own copy is freed
        def fuse() -> PackedWeight:
            return replace(packed[0], n_rows=sum(p.n_rows for p in packed), data=np.concatenate([p.data for p in packed]))

        fused = fuse() if self._load is None else self._load.fused(name, parts, fuse)
        data = fused.data
        start = 0
        for part_name, part in zip(parts, packed):
            view = data[start:start + part.data.size]
            start += part.data.size
            self.weights[part_name] = native_matrix(replace(part, data=view))
        self.weights[name] = native_matrix(fused)
        self._packed_by_source = {source: handle for source, handle in self._packed_by_source.items()
                                  if not any(handle is member for member in members)}  # the parts' own copies go
        release_freed_memory()
        return True

    def weight_nbytes(self) -> int:
        """The numpy arrays (norm weights, biases) plus each buffer of repacked matrices once (a fused matrix and
        its parts' views share one)."""
        buffers = {}
        for handle in self.weights.values():
            if isinstance(handle, NativeMatrix):
                owner = handle.packed.data
                while isinstance(owner.base, np.ndarray):
                    owner = owner.base
                buffers[id(owner)] = int(owner.nbytes)
        return super().weight_nbytes() + sum(buffers.values())

    def free_weights(self) -> None:
        super().free_weights()
        self._programs.clear()
        self._packed_by_source.clear()
        self._load = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- KV, values ---------------------------------------------------------------------------------------
    def alloc_kv(self, shape: KVLayerShape) -> NumpyKV:
        return NumpyKV(k=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_k), dtype=F32),
                       v=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_v), dtype=F32))

    def from_numpy(self, array: np.ndarray) -> np.ndarray:
        return array

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    # -- compile ------------------------------------------------------------------------------------------
    def compile(self, split: Split, kv: Mapping[tuple[str, int], Any]) -> CompiledSplit:
        compiled = CompiledProgram(self, split, kv)
        if self.native_options.profile:
            self._programs.append(compiled)
        return compiled

    def profile(self) -> dict[str, float]:
        """Seconds spent per op over every run so far (``profile: true``), largest first."""
        totals: dict[str, float] = {}
        for compiled in self._programs:
            for program, _, _ in compiled.programs.values():
                for label, seconds in zip(program.labels, program.times):
                    totals[label] = totals.get(label, 0.0) + float(seconds)
        return dict(sorted(totals.items(), key=lambda item: -item[1]))
