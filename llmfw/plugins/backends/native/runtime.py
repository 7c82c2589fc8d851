"""The native Backend class: every op of a split in the C kernels (csrc/), weights repacked at load in their own
bits (repack.py). A split compiles once into a flat program (program.py) that one C call runs per compute, with the
GIL released: no Python per op per token. An op the kernels lack makes the backend decline the model with a
:class:`ModelError` naming it."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from dataclasses import replace
from typing import Any, ClassVar, Hashable, Mapping

import numpy as np

from llmfw.core.exec.backend import (Backend, BackendOptions, CompiledSplit, KVLayerShape, Split, WeightSource,
                                     release_freed_memory)
from llmfw.core.exec.weight_cache import CachedLoad, cache_dir_variable, cache_dirs_from
from llmfw.core.errors import BackendUnavailable, ModelError
from llmfw.core.format.quants import GGMLType
import llmfw.plugins.backends.native.kernels as kernels
# the compiler's names stay importable from here, where they were first defined (``X as X``: re-exported)
from llmfw.plugins.backends.native.compiled import CompiledProgram as CompiledProgram
from llmfw.plugins.backends.native.compiler import (NativeCompiler as NativeCompiler, NativeMatrix as NativeMatrix,
                                                   NativeOptions as NativeOptions, Value as Value,
                                                   broadcast_strides as broadcast_strides,
                                                   native_matrix as native_matrix)
from llmfw.plugins.backends.native.cache import NativeCache
from llmfw.plugins.backends.native.experts import (EXPERT_OPS, NativeExperts, native_experts, packed_expert_shape,
                                                  repack_experts)
from llmfw.plugins.backends.native.repack import ROWS, SUPPORTED_TYPES, PackedWeight, pairable, repack
from llmfw.plugins.backends.numpy.kernels import F32, NumpyKV
from llmfw.plugins.backends.numpy.runtime import SWIGLU
from llmfw.plugins.backends.numpy.weights import NumpyWeights

log = logging.getLogger(__name__)

#: the graph ops the programs run (and ``swiglu``, this backend's rewrite rule)
NATIVE_OPS = frozenset({"get_rows", "mul_mat", "add", "sub", "mul", "div", "scale", "rms_norm", "norm", "silu",
                        "relu", "gelu", "sigmoid", "softplus", "softcap", "clamp", "softmax", "reshape", "slice",
                        "rope", "attention", "k_shift", "ssm_conv", "conv_window", "ssm_scan", "gated_delta",
                        # the mixture-of-experts ops (csrc/moe.c)
                        "mul_mat_id", "add_id", "top_k", "take", "sum_rows", "id_mask", "swiglu_oai", "concat",
                        "mul_mat_heads"})
#: GGML types whose weights the kernels take (as matrices, or as the float arrays of norms and biases)
_KNOWN_TYPES = frozenset(int(t) for t in SUPPORTED_TYPES)


class NativeBackend(NumpyWeights):
    """Every op in llmfw's own C kernels (every GGUF block type in its own bits, integer dot products, batch
    invariant by construction), a split run as one compiled program; see the package docstring."""

    name = "native"
    options_schema = NativeOptions
    supported_ops = NATIVE_OPS
    rewrite_rules = (SWIGLU,)
    is_host = True
    fresh_outputs = True  # each run writes its outputs into new arrays (compiled.py)
    environment_options = {"LLMFW_NATIVE_ISA": "isa", "LLMFW_NATIVE_CACHE": "cache",
                           "LLMFW_NATIVE_CACHE_DIR": "cache_dir", "LLMFW_NATIVE_KV_TYPE": "kv_type"}
    #: the built extension: missing when the install could not compile it (``llmfw plugins`` says so)
    requires = (kernels.EXTENSION,)
    #: the CPU default when the extension is built (above onnx's 200, which stays the fallback default; below
    #: torch:cuda's 300 where a GPU is present)
    default_priority: ClassVar[Mapping[str, int]] = {"cpu": 250}

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
        return cache_dirs_from(environ, cache_dir_variable("native"), "native")

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
            packed_of: dict[int, PackedWeight] = {}
            for name, handle in self.weights.items():
                if isinstance(handle, (NativeMatrix, NativeExperts)):
                    names_of.setdefault(id(handle), []).append(name)
                    packed_of[id(handle)] = handle.packed
            stored = self._load.finish({names[0]: packed_of[key] for key, names in names_of.items()})
            for names in names_of.values():
                if names[0] in stored:
                    handle = self.weights[names[0]]
                    mapped = handle.with_packed(stored[names[0]]) if isinstance(handle, NativeExperts) else \
                        native_matrix(stored[names[0]])
                    for name in names:
                        self.weights[name] = mapped
        self._packed_by_source.clear()
        self._load = None

    def _pairs_groups(self, ggml_type: int) -> bool:
        """Whether a matrix of ``ggml_type`` is repacked with its row groups in pairs: where the AVX2 path runs, which
        then multiplies two groups at a time from one stream (the AVX-512 path, measured with groups apart, keeps
        them apart)."""
        return self.isa == "avx2" and pairable(ggml_type)

    def _repacked(self, source: WeightSource) -> PackedWeight:
        experts = len(source.ne) == 3
        paired = not experts and self._pairs_groups(source.ggml_type)

        def convert(s: WeightSource) -> PackedWeight:
            return repack_experts(s.raw, s.ggml_type, s.ne) if experts else repack(s.raw, s.ggml_type, s.ne, paired)

        if self._load is None:
            return convert(source)
        packed = self._load.load(source, convert)
        # a stored weight was checked against its own description; this checks that against the tensor (and its
        # layout against the one this path takes: an entry written where another ISA ran is rebuilt)
        expected = packed_expert_shape(source.ggml_type, source.ne) if experts else \
            (int(np.prod(source.ne[1:], dtype=np.int64)), int(source.ne[0]))
        if packed.shape == expected and packed.paired == paired:
            return packed
        self._load.converted += 1  # so that the entry is rewritten
        return convert(source)

    def load_weight(self, source: WeightSource) -> Any:
        experts = len(source.ne) == 3 and bool(source.usage & EXPERT_OPS)
        if not experts and (not source.usage & {"mul_mat", "get_rows"} or len(source.ne) != 2):
            return super().load_weight(source)
        qtype = GGMLType(source.ggml_type)
        if qtype not in SUPPORTED_TYPES:
            raise ModelError(f"native backend: no kernel for {qtype.name} weights ({source.name}); use another "
                             "backend for this model")
        if experts:
            return native_experts(self._repacked(source), int(source.ne[2]), int(source.ne[1]))
        shared = self._packed_by_source.get(source.source_name)
        if shared is None or shared.packed.shape != tuple(reversed(source.ne)):
            shared = self._packed_by_source[source.source_name] = native_matrix(self._repacked(source))
        return shared

    def fusion_key(self, weight_name: str) -> Hashable | None:
        handle = self.weights.get(weight_name)
        if not isinstance(handle, NativeMatrix):
            return None
        packed = handle.packed
        if packed.n_rows % (2 * ROWS if packed.paired else ROWS):
            return None  # row groups (pairs of them) of a part must be whole to be stacked
        return (packed.kind, packed.n_scales, packed.has_offsets, packed.half_params, packed.factored,
                packed.paired, packed.table.tobytes(), packed.n_cols)

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
        if fused.paired != packed[0].paired:  # stored for the other layout (its parts were repacked again)
            assert self._load is not None
            self._load.converted += 1
            fused = fuse()
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
            if isinstance(handle, (NativeMatrix, NativeExperts)):
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
        """K and V of one layer, f16 or float32 (the ``kv_type`` option); zeros, so a masked cell adds nothing."""
        dtype = np.float16 if self.native_options.kv_type == "f16" else F32
        return NumpyKV(k=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_k), dtype=dtype),
                       v=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_v), dtype=dtype))

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
