"""The torch backend class: device and threads, weight loading into the backend's forms, KV storage, compile."""
from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal, Mapping

import numpy as np

from pydantic import field_validator

from llmfw.core.exec.backend import (
    Backend,
    BackendOptions,
    CompiledSplit,
    KVLayerShape,
    NativeValue,
    Split,
    WeightSource,
    release_freed_memory,
)
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import MOE_OP_TABLE, OPS, RECURRENT_OPS
from llmfw.core.format.quants import dequantize_rows
from llmfw.plugins.backends.torch.compiler import SplitCompiler
from llmfw.plugins.backends.torch.environment import (
    PIP_EXTRA, SPIN_ENV, apply_spin_setting, check_device, import_torch, nvidia_driver_present,
)
from llmfw.plugins.backends.torch.kernels import KVStorage
from llmfw.plugins.backends.torch.weights import (
    DenseLinear,
    Fp16Linear,
    Int8Linear,
    MATMUL_FORM_ENV,
    Linear,
    TorchWeight,
    concat_linears,
    default_matmul_form,
    dequantize_source,
    dequantized_row_chunks,
    make_linear,
    slice_linear,
    quantize_rows_int8,
)

log = logging.getLogger(__name__)


class TorchOptions(BackendOptions):
    """``backend_options={"torch": {...}}`` (the CLI maps ``LLMFW_TORCH_MATMUL`` / ``LLMFW_TORCH_SPIN`` onto them)."""

    #: the matmul weight form instead of the device's default (fp16 on a CPU with fbgemm, else f32; bf16 on CUDA)
    matmul: Literal["fp16", "int8", "bf16", "f32"] | None = None
    #: False: torch's OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE, set before torch loads)
    spin: bool = True

    @field_validator("matmul", mode="before")
    @classmethod
    def _normalise_form(cls, value: object) -> object:
        return value.strip().lower() or None if isinstance(value, str) else value


class TorchBackend(Backend):
    """PyTorch on ``cpu`` (default) or ``cuda[:N]``; see the module docstring."""

    name: ClassVar[str] = "torch"
    pip_extra: ClassVar[str | None] = PIP_EXTRA
    #: the mixture-of-experts ops are not implemented here: an MoE model's expert layers cannot be placed on torch
    #: (the scheduler names the op), numpy and onnx run them; no recurrent-layer kernels yet: those ops run on
    #: the host backend (numpy)
    supported_ops: ClassVar[frozenset[str]] = frozenset(OPS - {"input"} - MOE_OP_TABLE.keys() - RECURRENT_OPS)
    is_host: ClassVar[bool] = False
    requires: ClassVar[tuple[str, ...]] = ("torch",)
    #: the default only on a CUDA GPU: on a CPU, importing torch alone costs seconds and onnx decodes faster
    default_priority: ClassVar[Mapping[str, int]] = {"cuda": 300}
    options_schema = TorchOptions
    environment_options: ClassVar[Mapping[str, str]] = {MATMUL_FORM_ENV: "matmul", SPIN_ENV: "spin"}

    def __init__(self, device: str | None = None, options: BackendOptions | None = None):
        super().__init__(device=None, options=options)
        torch_options = self.options_as(TorchOptions)
        apply_spin_setting(torch_options.spin)  # before torch loads (create_backend did so already)
        torch = import_torch()
        self.device = check_device(device)
        self.torch_device = torch.device(self.device)
        self.matmul_form = default_matmul_form(self.device, torch_options.matmul)
        if self.matmul_form == "int8":
            torch.backends.quantized.engine = "fbgemm"
        self.use_threads(None)
        self._loading = True
        log.info("torch backend on %s: matmul weights as %s, %d threads", self.device, self.matmul_form,
                 torch.get_num_threads())

    @property
    def spec(self) -> str:
        return self.name if self.device == "cpu" else f"{self.name}:{self.device}"

    def set_n_threads(self, n_threads: int | None) -> None:
        """torch's intra-op thread count is process-wide: set it explicitly (None keeps torch's default)."""
        super().set_n_threads(n_threads)
        if n_threads:
            import_torch().set_num_threads(int(n_threads))

    @classmethod
    def check_available(cls, device: str | None = None) -> None:
        check_device(device)

    @classmethod
    def devices(cls) -> list[str]:
        """The CPU when torch imports, and each CUDA device torch sees (asked only with an NVIDIA driver loaded)."""
        if cls.default_unavailable_reason("cpu") is not None:
            return []
        if not nvidia_driver_present():
            return ["cpu"]
        return ["cpu", *(f"cuda:{i}" for i in range(import_torch().cuda.device_count()))]

    @classmethod
    def prepare_process(cls, options: BackendOptions) -> None:
        if isinstance(options, TorchOptions):
            apply_spin_setting(options.spin)

    @classmethod
    def default_unavailable_reason(cls, device: str) -> str | None:
        """No NVIDIA driver: no CUDA GPU, decided without importing torch (seconds) just to hear so."""
        if device.startswith("cuda") and not nvidia_driver_present():
            return "no CUDA GPU (no NVIDIA driver loaded)"
        return super().default_unavailable_reason(device)

    # -- weights ----------------------------------------------------------------------------------------
    def load_weight(self, source: WeightSource) -> TorchWeight:
        if "mul_mat_id" in source.usage:
            raise ModelError(f"the torch backend does not run mixture-of-experts layers ({source.name}); use "
                             "--backend onnx or numpy for this model")
        torch = import_torch()
        shape = source.numpy_shape
        weight = TorchWeight(source.name, shape, ggml_type=int(source.ggml_type), ne=tuple(source.ne))
        usage = set(source.usage)
        matrix = len(shape) == 2
        if "get_rows" in usage:
            # exact lookups from the original blocks: compact, and no error added to embeddings
            weight.raw = source.kept_raw()
        if matrix and ("mul_mat" in usage or not usage):
            weight.linear = self._convert_linear(source)
        if not matrix or (usage - {"mul_mat", "get_rows"}):
            values = dequantize_source(source)
            weight.tensor = torch.from_numpy(values).to(self.torch_device)
        if weight.linear is None and weight.tensor is None and weight.raw is None:
            weight.tensor = torch.from_numpy(dequantize_source(source)).to(self.torch_device)
        self.weights[source.name] = weight
        return weight

    def _convert_linear(self, source: WeightSource) -> Linear:
        """Per-row conversion in chunks: a 49152x576 head never exists as one float32 array."""
        torch = import_torch()
        n_out, n_in = source.numpy_shape
        if self.matmul_form == "int8":
            q = torch.empty((n_out, n_in), dtype=torch.int8)
            scale = torch.empty(n_out, dtype=torch.float32)
            for start, rows in dequantized_row_chunks(source, 4096):
                q_rows, s_rows = quantize_rows_int8(rows)
                q[start:start + len(rows)] = torch.from_numpy(q_rows)
                scale[start:start + len(rows)] = torch.from_numpy(s_rows)
            linear = Int8Linear(q, scale)
            del q
            release_freed_memory()
            return linear
        if self.matmul_form == "fp16":
            w16 = torch.empty((n_out, n_in), dtype=torch.float16)
            for start, rows in dequantized_row_chunks(source, 4096):
                w16[start:start + len(rows)] = torch.from_numpy(rows)
            # prepack takes float32; one matrix at a time keeps the float32 copy transient
            fp16_linear = Fp16Linear(w16.float())
            del w16
            release_freed_memory()  # glibc keeps freed temporaries otherwise: RSS after load would count them
            return fp16_linear
        dtype = torch.bfloat16 if self.matmul_form == "bf16" else torch.float32
        w = torch.empty((n_out, n_in), dtype=dtype, device=self.torch_device)
        for start, rows in dequantized_row_chunks(source, 4096):
            w[start:start + len(rows)] = torch.from_numpy(rows).to(self.torch_device, dtype)
        return DenseLinear(w)


    def linear(self, name: str) -> Linear:
        """The linear form of weight ``name``, rebuilt from the fused weight it was folded into if need be."""
        weight = self.weights[name]
        if weight.linear is None and weight.fused_into is not None:
            fused_name, row = weight.fused_into
            weight.linear = slice_linear(self.linear(fused_name), row, weight.shape[0])
            log.info("torch backend: weight %s unfused again from %s", name, fused_name)
        if weight.linear is None:
            log.warning("torch backend: weight %s was not marked for mul_mat; converting its dense form", name)
            weight.linear = make_linear(self.dense_tensor(name).cpu().numpy(), self.matmul_form, self.device or "cpu")
        return weight.linear

    def fuse_weights(self, name: str, parts: tuple[str, ...]) -> bool:
        """One linear for the matrices ``parts`` stacked by output rows, kept as weight ``name``; the parts'
        own linears are released (:meth:`linear` slices one back out if a graph needs a part alone)."""
        weights = [self.weights.get(p) for p in parts]
        members = [w for w in weights if w is not None and len(w.shape) == 2 and w.fused_into is None]
        if len(members) != len(parts) or len({w.shape[1] for w in members}) != 1:
            return False
        fused = concat_linears([self.linear(w.name) for w in members], self.matmul_form, self.device or "cpu")
        self.weights[name] = TorchWeight(name, (sum(w.shape[0] for w in members), members[0].shape[1]),
                                         linear=fused)
        row = 0
        for member in members:
            member.fused_into = (name, row)
            member.linear = None
            row += member.shape[0]
        release_freed_memory()
        log.debug("torch backend: fused %s into one %s matmul", name, fused.form)
        return True

    def dense_tensor(self, name: str) -> Any:
        """Weight ``name`` as a float32 tensor (derived from its linear or raw form once, if needed)."""
        weight = self.weights[name]
        if weight.tensor is None:
            torch = import_torch()
            if weight.raw is not None:
                rows = dequantize_rows(weight.raw, weight.ggml_type, weight.ne,
                                       np.arange(int(np.prod(weight.shape[:-1]))))
                weight.tensor = torch.from_numpy(rows.reshape(weight.shape)).to(self.torch_device)
            else:
                log.warning("torch backend: weight %s used elementwise; dequantizing its matmul form", name)
                weight.tensor = self.linear(name).dense().to(self.torch_device)
        return weight.tensor

    def weight_nbytes(self) -> int:
        """Bytes of weight data this backend keeps (fused weights included)."""
        return sum(w.nbytes for w in self.weights.values())

    # -- KV storage -------------------------------------------------------------------------------------
    def alloc_kv(self, shape: KVLayerShape) -> KVStorage:
        torch = import_torch()
        k = torch.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_k), dtype=torch.float32,
                        device=self.torch_device)
        v = torch.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_v), dtype=torch.float32,
                        device=self.torch_device)
        return KVStorage(k, v)

    def read_kv_cells(self, kv: KVStorage, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        torch = import_torch()
        index = torch.from_numpy(np.array(cells, dtype=np.int64)).to(self.torch_device)
        return (kv.k.index_select(1, index).cpu().numpy(), kv.v.index_select(1, index).cpu().numpy())

    def write_kv_cells(self, kv: KVStorage, cells: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        torch = import_torch()
        index = torch.from_numpy(np.array(cells, dtype=np.int64)).to(self.torch_device)
        kv.k.index_copy_(1, index, torch.from_numpy(np.array(k)).to(self.torch_device))
        kv.v.index_copy_(1, index, torch.from_numpy(np.array(v)).to(self.torch_device))

    # -- compute ----------------------------------------------------------------------------------------
    def compile(self, split: Split, kv: Mapping[tuple[str, int], Any]) -> CompiledSplit:
        torch = import_torch()
        if self._loading:  # the first compile follows the last weight: hand conversion temporaries back
            self._loading = False
            release_freed_memory()
        compiler = SplitCompiler(self, split, kv)
        run = compiler.compile()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("torch split steps:\n%s", "\n".join(compiler.plan))
        inference_mode = torch.inference_mode

        def run_split(inputs: Mapping[int, NativeValue]) -> dict[int, NativeValue]:
            with inference_mode():
                return run(inputs)

        run_split.plan = compiler.plan  # type: ignore[attr-defined]
        return run_split

    def from_numpy(self, array: np.ndarray) -> NativeValue:
        torch = import_torch()
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if self.torch_device.type == "cpu" else tensor.to(self.torch_device, non_blocking=True)

    def to_numpy(self, value: NativeValue) -> np.ndarray:
        array: np.ndarray = value.detach().to("cpu").numpy()
        return array

    def synchronize(self) -> None:
        if self.torch_device.type == "cuda":
            import_torch().cuda.synchronize(self.torch_device)
