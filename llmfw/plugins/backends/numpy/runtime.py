"""The numpy Backend class: the reference float32 backend (see the package docstring)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from llmfw.core.exec.backend import CompiledSplit, KVLayerShape, Split
from llmfw.core.ir.graph import OPS
from llmfw.core.ir.passes import ANY, Pattern, RewriteRule
from llmfw.plugins.backends.numpy.blas import set_blas_threads
from llmfw.plugins.backends.numpy.compiler import SplitCompiler
from llmfw.plugins.backends.numpy.kernels import F32, NumpyKV
from llmfw.plugins.backends.numpy.weights import NumpyWeights

#: the rewrite rule this backend declares: the gated FFN's ``silu(gate) * up`` as one ``swiglu`` step
SWIGLU = RewriteRule("swiglu", Pattern("mul", (Pattern("silu", (ANY,)), ANY)), "swiglu")


class NumpyBackend(NumpyWeights):
    """Float32 numpy implementation of every op (see :mod:`llmfw.core.ir.graph`), plus ``swiglu`` (:data:`SWIGLU`)."""

    name = "numpy"
    supported_ops = OPS
    rewrite_rules = (SWIGLU,)
    is_host = True
    #: the default when no faster backend can run (always installed)
    default_priority = {"cpu": 100}

    @classmethod
    def check_available(cls, device: str | None = None) -> None:
        if device not in (None, "cpu"):
            from llmfw.core.errors import BackendUnavailable

            raise BackendUnavailable(f"the numpy backend runs on the CPU only, not on device {device!r}")

    def set_n_threads(self, n_threads: int | None) -> None:
        """BLAS's thread count is process-wide; None leaves it where the last count put it (OpenBLAS keeps no
        default to go back to)."""
        super().set_n_threads(n_threads)
        if n_threads:
            set_blas_threads(n_threads)

    # -- KV ----------------------------------------------------------------------------------------------
    def alloc_kv(self, shape: KVLayerShape) -> NumpyKV:
        return NumpyKV(
            k=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_k), dtype=F32),
            v=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_v), dtype=F32),
        )

    # -- values ------------------------------------------------------------------------------------------
    def from_numpy(self, array: np.ndarray) -> np.ndarray:
        return array

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    # -- compile -----------------------------------------------------------------------------------------
    def compile(self, split: Split, kv: Mapping[tuple[str, int], Any]) -> CompiledSplit:
        return SplitCompiler(self, split, kv).compile()
