"""The onnx backend: sessions (one per split structure, cached), OrtValues shared by every session, IOBinding.

A model is never serialized with its weights: each weight is an initializer with external data. Weights mapped
from the converted-weight cache point at its file (offset and length in ``weights.bin``): ONNX Runtime maps
those bytes, prepacks them into its own MatMulNBits / Gemm forms and unmaps them, so only the prepacked copy
stays resident, and lookup tables (``get_rows``) keep only the rows touched. Other arrays (a model too small to
cache, ``cache: false``, transposed copies) are handed over as OrtValues (``add_external_initializers``), which
ONNX Runtime copies.
"""
from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Literal, Mapping, Sequence

import numpy as np

from llmfw.core.exec.backend import Backend, BackendOptions, CompiledSplit, KVLayerShape, Split, WeightSource
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import OPS
from llmfw.core.exec.weight_cache import CacheOptions, cache_dir_variable, cache_dirs_from
from llmfw.plugins.backends.onnx.cache import CachedLoad, MappedBlob, OnnxCache
from llmfw.plugins.backends.onnx.emit import external_tensor_proto, split_signature
from llmfw.plugins.backends.onnx.fused import (
    USE_GQA, AttentionForm, FusedAttentionPlan, fused_attention_plan, kv_cells,
)
from llmfw.plugins.backends.onnx.groups import attention_cells
from llmfw.plugins.backends.onnx.moe import ExpertWeights, is_expert_source, load_experts
from llmfw.plugins.backends.onnx.ort import OnnxKV, execution_providers, import_onnxruntime
from llmfw.plugins.backends.onnx.rows import one_row_product_differs
from llmfw.plugins.backends.onnx.translate import SplitTranslator
from llmfw.plugins.backends.onnx.weights import (
    F32, BlockWeight, DenseWeight, Weight, convert_weight, dequantize_block_weight, fuse_block_weights, share_rows,
)

log = logging.getLogger(__name__)

#: sessions kept per backend (one per split structure: decode, prefill, mixed placements...)
MAX_SESSIONS = 16
#: the session option naming the folder an external data ``location`` is relative to (a model read from bytes)
EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


@dataclass
class _Program:
    """One ONNX model built from a split structure, and its session."""

    session: Any
    input_names: list[str]            # split.input_ids order
    output_names: list[str]           # split.output_ids order
    kv_bindings: list[tuple[str, str, tuple[str, int], str]]  # (input, output, kv key, "k"|"v")
    node_count: int = 0               # ONNX nodes before ORT's own fusions (diagnostics)
    kv_rank: int = 3                  # 4: the caches are bound as [1, Hkv, n_cells, D] (GroupQueryAttention)
    #: (index of a mask in input_names, the graph input of the cells its attentions gather, the KV storages they
    #: read): see groups.py
    cell_inputs: tuple[tuple[int, str, tuple[tuple[str, int], ...]], ...] = ()


class OnnxOptions(CacheOptions):
    """``backend_options={"onnx": {...}}``; the CLI maps ``OnnxBackend.environment_options`` onto them."""

    #: ONNX Runtime's per-node trace, one JSON file per session, under this path prefix (docs/backends.md, onnx options)
    profile: str | None = None
    #: intra-op threads busy-wait between kernels (faster decode; False frees the cores between calls)
    spin: bool = True
    #: write each session's graph after ORT's own fusions to ``<dump>-<n>.onnx``
    dump: str | None = None
    #: GroupQueryAttention for batches whose KV cells are one causal run (fused.py); False: always op by op.
    #: Off by default: ORT's GQA kernel rounds a many-token batch differently from one-token steps (logits up to
    #: ~1 apart), so a speculative verify batch would no longer reproduce plain greedy decoding; the op-by-op
    #: form gives every row the same bits whatever the batch
    fused_attention: bool = False
    #: those batches get a session of their own (GQA only) instead of an If per layer in the one session:
    #: faster decode, but a second session, with its own prepacked weights, once other batches come
    gqa_session: bool = False
    #: append a row to each block product's input so that it never runs on MLAS's one-row kernel: ``auto`` where
    #: that kernel gives a row other bits than the many-row one on this CPU (rows.py; AVX2 without AVX-512),
    #: ``always``, or ``never`` (faster decode, but a token's logits may then depend on the batch it came in)
    row_padding: Literal["auto", "always", "never"] = "auto"


# ---------------------------------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------------------------------

class OnnxBackend(Backend):
    """ONNX Runtime execution of the graph IR (CPU execution provider; CUDA when asked and present)."""

    name = "onnx"
    supported_ops = OPS
    is_host = False
    requires = ("onnxruntime", "onnx")
    #: the default on a CPU: it decodes about twice as fast as numpy or torch there (docs/benchmarks.md)
    default_priority = {"cpu": 200}
    #: the experts of a mixture-of-experts model go to our own kernels where they are built: ONNX Runtime's
    #: dispatch has one node per expert (each called, used or not) and prepacks every expert at load
    #: (docs/benchmarks.md, MoE memory and speed); without them onnx keeps its own dispatch (moe.py)
    delegated_weights = {"mul_mat_id": "native", "add_id": "native"}

    options_schema = OnnxOptions
    environment_options = {"LLMFW_ONNX_PROFILE": "profile", "LLMFW_ONNX_SPIN": "spin", "LLMFW_ONNX_DUMP": "dump",
                           "LLMFW_ONNX_CACHE": "cache", "LLMFW_ONNX_CACHE_DIR": "cache_dir",
                           "LLMFW_ONNX_FUSED_ATTENTION": "fused_attention", "LLMFW_ONNX_GQA_SESSION": "gqa_session",
                           "LLMFW_ONNX_ROW_PADDING": "row_padding"}

    #: MatMulNBits accuracy level: 4 = int8 activations (llama.cpp's own quantized dot products)
    accuracy_level: int = 4

    def __init__(self, device: str | None = None, options: BackendOptions | None = None):
        super().__init__(device, options)
        self.onnx_options = self.options_as(OnnxOptions)
        self.providers = execution_providers(device)
        self._ort, _ = import_onnxruntime()
        self._ort_values: dict[str, Any] = {}
        self._derived: dict[tuple[str, str], np.ndarray] = {}
        self._programs: OrderedDict[tuple, _Program] = OrderedDict()
        self._load: CachedLoad[Weight] | None = None
        #: the cache file the loaded weights were mapped from (sessions point their initializers at it)
        self._blob: MappedBlob | None = None
        #: sessions built (tests read it to check that one session serves many ubatches)
        self.sessions_built = 0
        #: weights the last load converted from the model file rather than mapped from the cache
        self.weights_converted = 0
        #: initializers the last session built read from the cache file itself (the others were copied)
        self.initializers_from_file = 0
        #: runs of fused-attention models by branch: GroupQueryAttention / op by op (tests, diagnostics)
        self.gqa_runs = 0
        self.op_by_op_runs = 0
        self._pads_one_row_products: bool | None = None

    @property
    def pads_one_row_products(self) -> bool:
        """Whether block products get an extra input row (``row_padding``; ``auto`` probes this CPU once)."""
        if self._pads_one_row_products is None:
            mode = self.onnx_options.row_padding
            if mode == "auto":
                ort, onnx = import_onnxruntime()
                self._pads_one_row_products = one_row_product_differs(ort, onnx, self.accuracy_level, self.providers)
                log.info("onnx: this CPU's one-row block product %s the many-row one's bits%s",
                         "differs from" if self._pads_one_row_products else "keeps",
                         ": block products get a second row" if self._pads_one_row_products else "")
            else:
                self._pads_one_row_products = mode == "always"
        return self._pads_one_row_products

    @classmethod
    def check_available(cls, device: str | None = None) -> None:
        execution_providers(device)

    @classmethod
    def cache_dirs(cls, environ: Mapping[str, str]) -> list[Path]:
        """The converted-weight cache (``LLMFW_ONNX_CACHE_DIR`` moves it, as the ``cache_dir`` option does)."""
        return cache_dirs_from(environ, cache_dir_variable("onnx"), "onnx")

    # -- weights ------------------------------------------------------------------------------------------
    def begin_loading(self, model_file: Path) -> None:
        root = self.onnx_options.cache_root("onnx")
        self._load = CachedLoad(None if root is None else OnnxCache.for_file(root, model_file))

    def load_weight(self, source: WeightSource) -> Weight | ExpertWeights:
        if is_expert_source(source):  # E matrices of their own (see moe.py), each converted like a dense one
            return load_experts(source, self._convert, self.weights.__setitem__)
        return self._convert(source)

    def _convert(self, source: WeightSource) -> Weight:
        if self._load is None:  # a weight outside a file's load (tests build backends by hand)
            return convert_weight(source)
        return self._load.load(source, convert_weight)

    def end_loading(self) -> None:
        if self._load is not None:
            self.weights_converted = self._load.converted
            self.weights.update(self._load.finish(self.weights))
            self._blob = self._load.blob
        self._load = None

    def free_weights(self) -> None:
        super().free_weights()
        self._load = None
        self._blob = None
        self._ort_values.clear()
        self._derived.clear()
        self._programs.clear()

    def weight(self, name: str) -> Weight:
        try:
            return self.weights[name]
        except KeyError:
            raise ModelError(f"onnx backend holds no weight named {name!r}") from None

    def fusion_key(self, weight_name: str) -> Hashable | None:
        """What :func:`fuse_block_weights` needs alike to stack matrices into one MatMulNBits weight: the bit
        width, block size and ``n_in`` of a packed block weight (with or without offsets: it zero-fills the
        missing ones). Dense weights and ``get_rows``-only tables are never fused."""
        weight = self.weights.get(weight_name)
        if not isinstance(weight, BlockWeight) or weight.packed is None:
            return None
        return weight.bits, weight.block, weight.shape[1]

    def fuse_weights(self, name: str, parts: tuple[str, ...]) -> bool:
        """Block-quantized parts of one :meth:`fusion_key` stacked into one MatMulNBits weight (their arrays
        become rows of it: no extra memory); dense or mixed parts are not fused."""
        keys = {self.fusion_key(n) for n in parts}
        if None in keys or len(keys) != 1:
            return False
        blocks = [w for w in (self.weights[n] for n in parts) if isinstance(w, BlockWeight)]

        def fuse() -> Weight:
            return fuse_block_weights(blocks)

        fused = self.weights[name] = fuse() if self._load is None else self._load.fused(name, parts, fuse)
        share_rows(fused, blocks)
        return True

    def derived(self, name: str, kind: str, make: Callable[[], np.ndarray]) -> np.ndarray:
        """An array derived from the weights (a transposed copy, a rotary table...), made once per backend."""
        return self._derive(name, kind, make)

    def _derive(self, name: str, kind: str, make: Callable[[], np.ndarray]) -> np.ndarray:
        array = self._derived.get((name, kind))
        if array is None:
            array = self._derived[(name, kind)] = np.ascontiguousarray(make())
        return array

    def transposed(self, name: str) -> np.ndarray:
        return self._derive(name, "T", lambda: self.weight(name).array.T)

    def offsets_transposed(self, key: str, weight: BlockWeight) -> np.ndarray:
        if weight.offsets_t is not None:  # made at load (and mapped from the cache)
            return weight.offsets_t
        return self._derive(key, "offsets.T", lambda: weight.offsets.T)

    def dense_copy(self, name: str) -> np.ndarray:
        weight = self.weight(name)
        if isinstance(weight, DenseWeight):
            return weight.array
        return self._derive(name, "dense", lambda: dequantize_block_weight(weight))

    def ort_value(self, name: str, array: np.ndarray) -> Any:
        """One OrtValue per weight array, shared by every session (ORT reads the numpy memory directly)."""
        cached = self._ort_values.get(name)
        if cached is None or cached[0] is not array:
            cached = self._ort_values[name] = (array, self._ort.OrtValue.ortvalue_from_numpy(array))
        return cached[1]

    # -- KV storage ---------------------------------------------------------------------------------------
    def alloc_kv(self, shape: KVLayerShape) -> OnnxKV:
        storage = OnnxKV(k=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_k), dtype=F32),
                         v=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_v), dtype=F32))
        storage.k_value = self._ort.OrtValue.ortvalue_from_numpy(storage.k)
        storage.v_value = self._ort.OrtValue.ortvalue_from_numpy(storage.v)
        return storage

    # -- values -------------------------------------------------------------------------------------------
    def from_numpy(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    # -- compile ------------------------------------------------------------------------------------------
    def compile(self, split: Split, kv: Mapping[tuple[str, int], Any]) -> CompiledSplit:
        return _CompiledSplit(self, split, kv)

    def program(self, split: Split, inputs: Sequence[np.ndarray], kv: Mapping[tuple[str, int], Any],
                attention: AttentionForm = "op") -> _Program:
        """The session for a split structure, thread count (fixed when a session is built) and attention form
        (``attention``: op by op, GroupQueryAttention, or an If between them per call), built on first use and
        cached (LRU)."""
        # GroupQueryAttention's rotary tables span the caches' cells: a fused program fits one cache size only
        cells = tuple(sorted((key, kv_cells(storage)) for key, storage in kv.items())) if attention != "op" else ()
        key = (self.n_threads, attention, cells, split_signature(split, inputs))
        program = self._programs.get(key)
        if program is not None:
            self._programs.move_to_end(key)
            return program
        program = self._build_program(split, inputs, kv, attention)
        self._programs[key] = program
        while len(self._programs) > MAX_SESSIONS:
            self._programs.popitem(last=False)
        return program

    def _build_program(self, split: Split, inputs: Sequence[np.ndarray],
                       kv: Mapping[tuple[str, int], Any], attention: AttentionForm = "op") -> _Program:
        translator = SplitTranslator(self, split, inputs, kv, attention)
        model, output_names = translator.translate()
        externals = translator.e.externals
        session = self._new_session(model, externals, self._mapped_offsets(externals), len(split.nodes))
        self.sessions_built += 1
        log.debug("onnx: session %d for a split of %d nodes (%d ONNX nodes)", self.sessions_built,
                  len(split.nodes), len(model.graph.node))
        positions = {node_id: k for k, node_id in enumerate(split.input_ids)}
        cell_inputs = tuple((positions[mask_id], name, tuple(sorted(translator.cell_caches.get(mask_id, ()))))
                            for mask_id, name in translator.cell_inputs.items())
        return _Program(session, [f"in_{i}" for i in split.input_ids], output_names, translator.kv_bindings,
                        len(model.graph.node), translator.kv_rank, cell_inputs)

    def _mapped_offsets(self, externals: Mapping[str, np.ndarray]) -> dict[str, int]:
        """External initializer → its offset in the mapped cache file, for the arrays that lie in it."""
        blob = self._blob
        if blob is None:
            return {}
        offsets = {name: blob.offset_of(array) for name, array in externals.items()}
        return {name: offset for name, offset in offsets.items() if offset is not None}

    def _new_session(self, model: Any, externals: Mapping[str, np.ndarray], mapped: Mapping[str, int],
                     n_nodes: int) -> Any:
        """An InferenceSession whose ``mapped`` initializers ONNX Runtime reads from the cache file itself and
        whose others it gets as OrtValues. Without the file when the file at the cache path is not the one mapped
        (another process rewrote or removed the entry), before or while the session was built."""
        blob = self._blob
        from_file = blob is not None and bool(mapped) and blob.still_at_path()
        options = self._session_options()
        for proto in model.graph.initializer:
            if proto.name in externals:
                offset = mapped.get(proto.name) if from_file and blob is not None else None
                if offset is None:
                    proto.CopyFrom(external_tensor_proto(proto.name, externals[proto.name]))
                else:
                    _point_at_file(proto, blob.path.name, offset, int(externals[proto.name].nbytes))
        in_memory = [name for name in externals if not from_file or name not in mapped]
        if in_memory:
            options.add_external_initializers(in_memory, [self.ort_value(n, externals[n]) for n in in_memory])
        if from_file and blob is not None:
            options.add_session_config_entry(EXTERNAL_FOLDER_KEY, str(blob.path.parent))
        try:
            session = self._ort.InferenceSession(model.SerializeToString(), options, providers=self.providers)
        except Exception as exc:  # ORT raises its own exception types
            if from_file:  # the file may have gone meanwhile: the weights are in this process's memory too
                return self._new_session(model, externals, {}, n_nodes)
            raise ModelError(f"onnx backend: onnxruntime rejected the model of a {n_nodes}-node split: "
                             f"{exc}") from exc
        if from_file and blob is not None and not blob.still_at_path():
            log.info("onnx: %s was replaced while in use; this session gets the weights from memory", blob.path)
            return self._new_session(model, externals, {}, n_nodes)
        self.initializers_from_file = len(mapped) if from_file else 0
        return session

    def _session_options(self) -> Any:
        options = self._ort.SessionOptions()
        options.graph_optimization_level = self._ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = self._ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        if self.n_threads:
            options.intra_op_num_threads = int(self.n_threads)
        # prepacking the MatMulNBits weights is most of a session's build: spread it over the intra-op threads
        options.add_session_config_entry("session.prepack.enable_parallel", "1")
        opts = self.onnx_options
        if not opts.spin:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # unused-initializer notes are expected (e.g. weights of fused matmuls)
        if opts.profile:  # ORT's per-node timings, a JSON trace per session (docs/backends.md, onnx options)
            options.enable_profiling = True
            options.profile_file_prefix = opts.profile
        if opts.dump:  # the graph after ORT's fusions, to check what it made of a split
            options.optimized_model_filepath = f"{opts.dump}-{self.sessions_built}.onnx"
        return options


def _point_at_file(proto: Any, file_name: str, offset: int, length: int) -> None:
    """An external initializer read from ``length`` bytes at ``offset`` of ``file_name`` in the session's
    external-data folder."""
    del proto.external_data[:]
    for key, value in (("location", file_name), ("offset", str(offset)), ("length", str(length))):
        entry = proto.external_data.add()
        entry.key, entry.value = key, value


@dataclass
class _Bound:
    """An IOBinding for one set of input shapes: the caches bound once (input and output, the same memory) and,
    from the second run on, the split's outputs bound to preallocated arrays (their shapes follow from the input
    shapes), so a decode step binds only its small inputs."""

    binding: Any
    outputs: list[np.ndarray] | None = None


class _CompiledSplit:
    """The callable the scheduler runs: binds inputs and the KV buffers, runs the session."""

    #: bindings kept per compiled split (decode, prefill chunks, a few KV lengths)
    MAX_BINDINGS = 8

    def __init__(self, backend: OnnxBackend, split: Split, kv: Mapping[tuple[str, int], Any]):
        self.backend = backend
        self.split = split
        self.kv = kv
        self.program: _Program | None = None
        self._signature: tuple | None = None
        #: this split's programs by attention form, for self._signature (two with gqa_session)
        self._programs: dict[str, _Program] = {}
        self._bound: OrderedDict[tuple, _Bound] = OrderedDict()
        self._fused_plan: FusedAttentionPlan | None = (
            fused_attention_plan(split, {key: kv_cells(storage) for key, storage in kv.items()})
            if backend.onnx_options.fused_attention else None)
        self._told_fallback = False
        #: the caches as [1, Hkv, n_cells, D] OrtValues over the same memory (GroupQueryAttention's BNSH)
        self._kv_bnsh: dict[tuple[tuple[str, int], str], tuple[np.ndarray, Any]] = {}
        self._n_cells: dict[tuple[tuple[str, int], ...], int] = {}

    def _fused(self, inputs: Mapping[int, Any]) -> bool:
        """Whether this call's batch runs GroupQueryAttention (one causal run of cells, see fused.py): the
        model's ``use_gqa`` input."""
        if self._fused_plan is None:
            return False
        if self._fused_plan.fits(inputs):
            self.backend.gqa_runs += 1
            return True
        self.backend.op_by_op_runs += 1
        if not self._told_fallback:
            log.info("onnx: a batch whose KV cells are not one causal run (several sequences, reused cells, "
                     "positions other than cells): "
                     "its attention runs op by op")
            self._told_fallback = True
        return False

    def _attention_form(self, gqa: bool) -> AttentionForm:
        if self._fused_plan is None:
            return "op"
        if self.backend.onnx_options.gqa_session:
            return "gqa" if gqa else "op"
        return "switch"

    def _prepare(self, arrays: list[np.ndarray], form: AttentionForm) -> None:
        signature = (self.backend.n_threads, tuple((a.dtype.str, a.ndim) for a in arrays))
        if signature != self._signature:
            self._programs.clear()
            self._bound.clear()
            self._signature = signature
        program = self._programs.get(form)
        if program is None:
            program = self._programs[form] = self.backend.program(self.split, arrays, self.kv, form)
        self.program = program

    def _kv_value(self, key: tuple[str, int], which: str) -> Any:
        storage: OnnxKV = self.kv[key]
        array, value = (storage.k, storage.k_value) if which == "k" else (storage.v, storage.v_value)
        if self.program.kv_rank == 3:
            return value
        cached = self._kv_bnsh.get((key, which))
        if cached is None or cached[0] is not array:  # a view: GroupQueryAttention updates the cache's memory
            cached = self._kv_bnsh[(key, which)] = (array, self.backend._ort.OrtValue.ortvalue_from_numpy(
                array[np.newaxis]))
        return cached[1]

    def _cells_of(self, caches: tuple[tuple[str, int], ...]) -> int:
        """The gcd of these caches' cell counts in this context (a program serves every context of its split
        structure, whatever the caches' sizes)."""
        n_cells = self._n_cells.get(caches)
        if n_cells is None:
            n_cells = self._n_cells[caches] = math.gcd(*(kv_cells(self.kv[key]) for key in caches))
        return n_cells

    def _attention_cells(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The cells each mask's attentions gather (groups.py); the mask in ``arrays`` becomes the one over them."""
        cells = []
        for position, _, caches in self.program.cell_inputs:
            arrays[position], listed = attention_cells(arrays[position], self._cells_of(caches))
            cells.append(listed)
        return cells

    def _bound_for(self, arrays: list[np.ndarray]) -> _Bound:
        shapes = (self.program.kv_rank, tuple(a.shape for a in arrays))
        bound = self._bound.get(shapes)
        if bound is not None:
            self._bound.move_to_end(shapes)
            return bound
        binding = self.program.session.io_binding()
        for input_name, _, key, which in self.program.kv_bindings:
            binding.bind_ortvalue_input(input_name, self._kv_value(key, which))
        bound = self._bound[shapes] = _Bound(binding)
        self._bind_outputs(bound)
        while len(self._bound) > self.MAX_BINDINGS:
            self._bound.popitem(last=False)
        return bound

    def _bind_outputs(self, bound: _Bound) -> None:
        """Binding order is output order: the split's outputs first (ORT-allocated until their shapes are known,
        then the preallocated arrays), then the caches (bound to their own memory, which is what makes
        ScatterND update them in place)."""
        binding = bound.binding
        binding.clear_binding_outputs()
        for k, name in enumerate(self.program.output_names):
            if bound.outputs is None:
                binding.bind_output(name)
            else:
                out = bound.outputs[k]
                binding.bind_output(name, "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)
        for _, output_name, key, which in self.program.kv_bindings:
            binding.bind_ortvalue_output(output_name, self._kv_value(key, which))

    def __call__(self, inputs: Mapping[int, Any]) -> dict[int, np.ndarray]:
        arrays = [np.ascontiguousarray(inputs[i]) for i in self.split.input_ids]
        gqa = self._fused(inputs)
        form = self._attention_form(gqa)
        self._prepare(arrays, form)
        cells = self._attention_cells(arrays)
        bound = self._bound_for(arrays + cells)
        names = self.program.input_names + [name for _, name, _ in self.program.cell_inputs]
        for name, array in zip(names, arrays + cells):
            bound.binding.bind_cpu_input(name, array)  # zero-copy: ORT reads the array during the run
        if form == "switch":  # kept in `arrays` while the run reads it
            arrays.append(np.array(gqa))
            bound.binding.bind_cpu_input(USE_GQA, arrays[-1])
        self.program.session.run_with_iobinding(bound.binding)
        if bound.outputs is None:  # first run with these shapes: keep arrays of the outputs' shapes from now on
            ort_outputs = bound.binding.get_outputs()
            bound.outputs = [np.empty_like(ort_outputs[k].numpy()) for k in range(len(self.split.output_ids))]
            results = [ort_outputs[k].numpy() for k in range(len(self.split.output_ids))]
            self._bind_outputs(bound)
        else:
            results = bound.outputs
        # copies: the arrays behind the bound outputs are overwritten by the next run
        return {node_id: np.array(results[k]) for k, node_id in enumerate(self.split.output_ids)}
