"""The onnx backend's converted-weight cache (llmfw/core/exec/weight_cache.py): its MatMulNBits forms of a model
file, under ``<models_dir>/.onnx/``. Converting a file's quantized blocks into MatMulNBits form (dequantize,
re-code, pack) is most of the backend's load time; a cached load maps them instead.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from llmfw.core.exec.weight_cache import CachedLoad, CachedWeight, ConvertedCache, MappedBlob, source_key
from llmfw.plugins.backends.onnx.weights import BlockWeight, DenseWeight, Weight

__all__ = ["CACHE_FORMAT", "CachedLoad", "CachedWeight", "MappedBlob", "OnnxCache", "source_key"]

#: bumped whenever the converted forms change, so that entries written by older code are rebuilt
#: (3: block weights with offsets also store them transposed, ``offsets_t``)
CACHE_FORMAT = 3
_BLOCK_ARRAYS = ("packed", "scales", "offsets", "offsets_t", "codes")


class OnnxCache(ConvertedCache[Weight]):
    """A model file's entry of MatMulNBits forms (block weights) and float arrays (dense weights)."""

    label = "onnx"
    dtypes = frozenset({np.dtype(np.float32).str, np.dtype(np.int8).str, np.dtype(np.uint8).str})

    @classmethod
    def format(cls) -> int:
        return CACHE_FORMAT

    @staticmethod
    def arrays_of(weight: Weight) -> dict[str, np.ndarray]:
        if isinstance(weight, DenseWeight):
            return {"array": weight.array}
        return {name: getattr(weight, name) for name in _BLOCK_ARRAYS if getattr(weight, name) is not None}

    @staticmethod
    def meta_of(weight: Weight) -> dict[str, Any]:
        if isinstance(weight, DenseWeight):
            return {"kind": "dense"}
        return {"kind": "block", "shape": list(weight.shape), "bits": weight.bits, "exact": weight.exact,
                "source_type": weight.source_type, "block": weight.block}

    @staticmethod
    def weight_of(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Weight:
        if meta["kind"] == "dense":
            return DenseWeight(arrays["array"])
        shape = (int(meta["shape"][0]), int(meta["shape"][1]))
        return BlockWeight(shape, int(meta["bits"]), arrays["scales"], arrays.get("offsets"),
                           packed=arrays.get("packed"), codes=arrays.get("codes"), offsets_t=arrays.get("offsets_t"),
                           exact=bool(meta["exact"]), source_type=str(meta["source_type"]), block=int(meta["block"]))
