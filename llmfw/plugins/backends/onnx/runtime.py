"""The onnx backend: sessions (one per split structure, cached), OrtValues shared by every session, IOBinding.

Weights reach sessions as external initializers (``SessionOptions.add_external_initializers``), so a model is
never serialized with its weights and all sessions share one copy of the packed bytes.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from llmfw.core.backend import Backend, CompiledSplit, KVLayerShape, Split, WeightSource
from llmfw.core.errors import ModelError
from llmfw.core.graph import OPS
from llmfw.plugins.backends.onnx.emit import split_signature
from llmfw.plugins.backends.onnx.ort import OnnxKV, execution_providers, import_onnxruntime
from llmfw.plugins.backends.onnx.translate import SplitTranslator
from llmfw.plugins.backends.onnx.weights import (
    F32, BlockWeight, DenseWeight, Weight, convert_weight, dequantize_block_weight, fuse_block_weights, share_rows,
)

log = logging.getLogger(__name__)

#: sessions kept per backend (one per split structure: decode, prefill, mixed placements...)
MAX_SESSIONS = 16


@dataclass
class _Program:
    """One ONNX model built from a split structure, and its session."""

    session: Any
    input_names: list[str]            # split.input_ids order
    output_names: list[str]           # split.output_ids order
    kv_bindings: list[tuple[str, str, tuple[str, int], str]]  # (input, output, kv key, "k"|"v")
    node_count: int = 0               # ONNX nodes before ORT's own fusions (diagnostics)


# ---------------------------------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------------------------------

class OnnxBackend(Backend):
    """ONNX Runtime execution of the graph IR (CPU execution provider; CUDA when asked and present)."""

    name = "onnx"
    supported_ops = OPS
    is_host = False
    requires = ("onnxruntime", "onnx")
    #: the default on a CPU: it decodes about twice as fast as numpy or torch there (README, Benchmarks)
    default_priority = {"cpu": 200}

    #: MatMulNBits accuracy level: 4 = int8 activations (llama.cpp's own quantized dot products)
    accuracy_level: int = 4

    def __init__(self, device: str | None = None, n_threads: int | None = None):
        super().__init__(device, n_threads)
        self.providers = execution_providers(device)
        self._ort, _ = import_onnxruntime()
        self._ort_values: dict[str, Any] = {}
        self._fused: dict[tuple[str, ...], BlockWeight] = {}
        self._derived: dict[tuple[str, str], np.ndarray] = {}
        self._programs: OrderedDict[tuple, _Program] = OrderedDict()
        #: sessions built (tests read it to check that one session serves many ubatches)
        self.sessions_built = 0
        #: bumped when built sessions become stale (thread count changed); compiled splits then rebuild
        self.generation = 0

    @classmethod
    def check_available(cls, device: str | None = None) -> None:
        execution_providers(device)

    def set_n_threads(self, n_threads: int | None) -> None:
        """Sessions fix their thread count when built: a change drops them (rebuilt on the next run)."""
        if n_threads != self.n_threads:
            super().set_n_threads(n_threads)
            self._programs.clear()
            self.generation += 1

    # -- weights ------------------------------------------------------------------------------------------
    def load_weight(self, source: WeightSource) -> Weight:
        return convert_weight(source)

    def free_weights(self) -> None:
        super().free_weights()
        self._ort_values.clear()
        self._fused.clear()
        self._derived.clear()
        self._programs.clear()

    def weight(self, name: str) -> Weight:
        try:
            return self.weights[name]
        except KeyError:
            raise ModelError(f"onnx backend holds no weight named {name!r}") from None

    def fused_weight(self, names: tuple[str, ...]) -> BlockWeight:
        fused = self._fused.get(names)
        if fused is None:
            parts = [self.weight(n) for n in names]
            fused = self._fused[names] = fuse_block_weights(parts)
            share_rows(fused, parts)
        return fused

    def _derive(self, name: str, kind: str, make: Callable[[], np.ndarray]) -> np.ndarray:
        array = self._derived.get((name, kind))
        if array is None:
            array = self._derived[(name, kind)] = np.ascontiguousarray(make())
        return array

    def transposed(self, name: str) -> np.ndarray:
        return self._derive(name, "T", lambda: self.weight(name).array.T)

    def offsets_transposed(self, key: str, weight: BlockWeight) -> np.ndarray:
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

    def program(self, split: Split, inputs: Sequence[np.ndarray], kv: Mapping[tuple[str, int], Any]) -> _Program:
        """The session for a split structure, built on first use and cached (LRU)."""
        key = split_signature(split, inputs)
        program = self._programs.get(key)
        if program is not None:
            self._programs.move_to_end(key)
            return program
        program = self._build_program(split, inputs, kv)
        self._programs[key] = program
        while len(self._programs) > MAX_SESSIONS:
            self._programs.popitem(last=False)
        return program

    def _build_program(self, split: Split, inputs: Sequence[np.ndarray],
                       kv: Mapping[tuple[str, int], Any]) -> _Program:
        translator = SplitTranslator(self, split, inputs, kv)
        model, output_names = translator.translate()
        externals = translator.e.externals
        options = self._session_options()
        if externals:
            options.add_external_initializers(list(externals),
                                              [self.ort_value(n, a) for n, a in externals.items()])
        try:
            session = self._ort.InferenceSession(model.SerializeToString(), options, providers=self.providers)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise ModelError(f"onnx backend: onnxruntime rejected the model of a {len(split.nodes)}-node split: "
                             f"{exc}") from exc
        self.sessions_built += 1
        log.debug("onnx: session %d for a split of %d nodes (%d ONNX nodes)", self.sessions_built,
                  len(split.nodes), len(model.graph.node))
        return _Program(session, [f"in_{i}" for i in split.input_ids], output_names, translator.kv_bindings,
                        len(model.graph.node))

    def _session_options(self) -> Any:
        options = self._ort.SessionOptions()
        options.graph_optimization_level = self._ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = self._ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        if self.n_threads:
            options.intra_op_num_threads = int(self.n_threads)
        if os.environ.get("LLMFW_ONNX_SPIN") == "0":
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # unused-initializer notes are expected (e.g. weights of fused matmuls)
        profile_prefix = os.environ.get("LLMFW_ONNX_PROFILE")
        if profile_prefix:  # ORT's per-node timings, a JSON trace per session (see the README section)
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        optimized_path = os.environ.get("LLMFW_ONNX_DUMP")
        if optimized_path:  # the graph after ORT's fusions, to check what it made of a split
            options.optimized_model_filepath = f"{optimized_path}-{self.sessions_built}.onnx"
        return options


class _CompiledSplit:
    """The callable the scheduler runs: binds inputs and the KV buffers, runs the session."""

    def __init__(self, backend: OnnxBackend, split: Split, kv: Mapping[tuple[str, int], Any]):
        self.backend = backend
        self.split = split
        self.kv = kv
        self.program: _Program | None = None
        self.binding: Any = None
        self._signature: tuple | None = None

    def _prepare(self, arrays: list[np.ndarray]) -> None:
        signature = (self.backend.generation, tuple((a.dtype.str, a.ndim) for a in arrays))
        if self.program is not None and signature == self._signature:
            return
        self.program = self.backend.program(self.split, arrays, self.kv)
        self._signature = signature
        self.binding = self.program.session.io_binding()
        for input_name, _, key, which in self.program.kv_bindings:
            self.binding.bind_ortvalue_input(input_name, self._kv_value(key, which))

    def _kv_value(self, key: tuple[str, int], which: str) -> Any:
        storage: OnnxKV = self.kv[key]
        return storage.k_value if which == "k" else storage.v_value

    def _bind_outputs(self) -> None:
        """Bind the outputs afresh each run: a kept output buffer would pin its shape (the token count).
        Binding order is output order: the split's outputs first, then the caches (bound to their own memory,
        which is what makes ScatterND update them in place)."""
        binding = self.binding
        binding.clear_binding_outputs()
        for name in self.program.output_names:
            binding.bind_output(name)
        for _, output_name, key, which in self.program.kv_bindings:
            binding.bind_ortvalue_output(output_name, self._kv_value(key, which))

    def __call__(self, inputs: Mapping[int, Any]) -> dict[int, np.ndarray]:
        arrays = [np.ascontiguousarray(inputs[i]) for i in self.split.input_ids]
        self._prepare(arrays)
        program, binding = self.program, self.binding
        for name, array in zip(program.input_names, arrays):
            binding.bind_cpu_input(name, array)  # zero-copy: ORT reads the array during the run
        self._bind_outputs()
        program.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        # copies: the OrtValues behind these views belong to the binding, which the next run rebinds
        return {node_id: np.array(outputs[k].numpy()) for k, node_id in enumerate(self.split.output_ids)}
