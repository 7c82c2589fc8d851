"""The native Backend class: matmuls, RMS norm and attention in the C kernels (csrc/), weights repacked at load in
their own bits (repack.py). The elementwise ops, rope and row lookups still run the numpy backend's kernels (this
backend extends the numpy split compiler, one Python step per op): the flat C program of every op is not built
yet."""
from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Any, Hashable, Literal, Mapping

import numpy as np

from llmfw.core.exec.backend import Backend, BackendOptions, CompiledSplit, Split, WeightSource, release_freed_memory
from llmfw.core.exec.weight_cache import CachedLoad, CacheOptions, cache_dirs_from
from llmfw.core.errors import BackendUnavailable, ModelError
from llmfw.core.ir.graph import Node
from llmfw.core.format.quants import GGMLType
import llmfw.plugins.backends.native.kernels as kernels
from llmfw.plugins.backends.native.cache import NativeCache
from llmfw.plugins.backends.native.repack import ROWS, SUPPORTED_TYPES, PackedWeight, repack
from llmfw.plugins.backends.numpy.blas import set_blas_threads
from llmfw.plugins.backends.numpy.compiler import SplitCompiler, Step
from llmfw.plugins.backends.numpy.kernels import NumpyKV
from llmfw.plugins.backends.numpy.runtime import NumpyBackend
from llmfw.plugins.backends.numpy.weights import QuantizedTable, get_rows


class NativeOptions(CacheOptions):
    """``backend_options: {native: {...}}``."""

    #: the kernels' instruction set: auto = the widest this CPU runs; a named one is an error where it cannot run
    isa: Literal["auto", "scalar", "avx2", "avx512"] = "auto"


@dataclass
class NativeMatrix:
    """A matmul weight in the kernels' layout (+ its quantized rows when the graph also looks rows up in it)."""

    packed: PackedWeight
    c_struct: kernels.NatWeight = field(repr=False)
    lookup: QuantizedTable | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape

    @property
    def ndim(self) -> int:
        return 2


def native_matrix(packed: PackedWeight, lookup: QuantizedTable | None = None) -> NativeMatrix:
    return NativeMatrix(packed, kernels.c_weight(packed), lookup)


class NativeCompiler(SplitCompiler):
    """The numpy split compiler with ``mul_mat`` (and row lookups in a repacked weight) on the native kernels."""

    backend: "NativeBackend"

    def _op_mul_mat(self, node: Node, ins: list[int], out: int) -> Step:
        weight = self.backend.weight(node.inputs[0].attrs["name"]) if node.inputs[0].op == "weight" else None
        if not isinstance(weight, NativeMatrix):
            return super()._op_mul_mat(node, ins, out)
        env, x_slot, backend = self.env, ins[1], self.backend

        def step() -> None:
            env[out] = kernels.mul_mat(weight.packed, env[x_slot], backend.pool, backend.isa, weight.c_struct)

        return step

    def _op_rms_norm(self, node: Node, ins: list[int], out: int) -> Step:
        eps, backend = float(node.attrs["eps"]), self.backend
        return self._norm_step(lambda x, w: kernels.rms_norm(x, eps, w, backend.pool), ins, out)

    def _attend(self, q: np.ndarray, storage: NumpyKV, mask: np.ndarray, scale: float, softcap: float,
                limits: list[tuple[int, int, int]]) -> np.ndarray:
        return kernels.attention(q, storage.k, storage.v, mask, scale, softcap, self.backend.pool)

    def _op_get_rows(self, node: Node, ins: list[int], out: int) -> Step:
        env, table_slot, ids_slot = self.env, ins[0], ins[1]

        def step() -> None:
            table = env[table_slot]
            if isinstance(table, NativeMatrix):
                if table.lookup is None:
                    raise ModelError("native backend: a repacked matmul weight was used as a lookup table")
                table = table.lookup
            env[out] = get_rows(table, env[ids_slot])

        return step


class NativeBackend(NumpyBackend):
    """Matmuls in llmfw's own C kernels (every GGUF block type in its own bits, integer dot products, batch
    invariant by construction); see the package docstring."""

    name = "native"
    options_schema = NativeOptions
    environment_options = {"LLMFW_NATIVE_ISA": "isa", "LLMFW_NATIVE_CACHE": "cache",
                           "LLMFW_NATIVE_CACHE_DIR": "cache_dir"}
    #: the built extension: missing when the install could not compile it (``llmfw plugins`` says so)
    requires = (kernels.EXTENSION,)
    #: not a default yet (``--backend native`` opts in): it becomes the CPU default (priority 250, above onnx's 200;
    #: torch:cuda's 300 stays first with a GPU) once it runs every op in C and meets the speed targets
    default_priority: Mapping[str, int] = {}

    def __init__(self, device: str | None = None, options: BackendOptions | None = None):
        super().__init__(device, options)
        self.native_options = self.options_as(NativeOptions)
        self.isa = kernels.resolve_isa(self.native_options.isa)
        self._pool: kernels.ThreadPool | None = None
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
        """The pool's thread count. numpy's BLAS (the attention products this backend still leaves to numpy) runs
        one thread: its threads spinning next to the pool's would take turns on the same cores."""
        Backend.set_n_threads(self, n_threads)
        set_blas_threads(1)
        if self._pool is not None and self._pool.n_threads != (n_threads or os.cpu_count() or 1):
            self._pool.close()
            self._pool = None

    # -- weights ------------------------------------------------------------------------------------------
    def begin_loading(self, model_file: Path) -> None:
        root = self.native_options.cache_root("native")
        self._load = CachedLoad(None if root is None else NativeCache.for_file(root, model_file))

    def end_loading(self) -> None:
        """Store the repacked weights when any was repacked, and keep the copies mapped back from the entry."""
        if self._load is not None:
            self.weights_converted = self._load.converted
            matrices = {n: h for n, h in self.weights.items() if isinstance(h, NativeMatrix)}
            for name, packed in self._load.finish({n: h.packed for n, h in matrices.items()}).items():
                self.weights[name] = native_matrix(packed, matrices[name].lookup)
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
        if "mul_mat" not in source.usage or len(source.ne) != 2:
            return super().load_weight(source)
        qtype = GGMLType(source.ggml_type)
        if qtype not in SUPPORTED_TYPES:
            raise ModelError(f"native backend: no kernel for {qtype.name} weights ({source.name}); use another "
                             "backend for this model")
        lookup = None
        if "get_rows" in source.usage:
            lookup = QuantizedTable(source.kept_raw(), int(qtype), source.ne)
        return native_matrix(self._repacked(source), lookup)

    def fusion_key(self, weight_name: str) -> Hashable | None:
        handle = self.weights.get(weight_name)
        if not isinstance(handle, NativeMatrix):
            return ("dense",)
        packed = handle.packed
        if packed.n_rows % ROWS or handle.lookup is not None:
            return None  # row groups of a part must be whole to be stacked
        return (packed.kind, packed.n_scales, packed.has_offsets, packed.table.tobytes(), packed.n_cols)

    def fuse_weights(self, name: str, parts: tuple[str, ...]) -> bool:
        members = [self.weights.get(n) for n in parts]
        if not all(isinstance(m, NativeMatrix) for m in members):
            return super().fuse_weights(name, parts)
        packed = [m.packed for m in members if isinstance(m, NativeMatrix)]
        if len({self.fusion_key(n) for n in parts}) != 1 or self.fusion_key(parts[0]) is None:
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
        release_freed_memory()
        return True

    def weight_nbytes(self) -> int:
        """The numpy arrays (norm weights, lookup tables) plus each buffer of repacked matrices once (a fused
        matrix and its parts' views share one)."""
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
        self._load = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- compile ------------------------------------------------------------------------------------------
    def compile(self, split: Split, kv: Mapping[tuple[str, int], Any]) -> CompiledSplit:
        return NativeCompiler(self, split, kv).compile()
