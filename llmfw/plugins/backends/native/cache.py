"""The native backend's converted-weight cache (llmfw/core/exec/weight_cache.py): its repacked weights of a model
file under ``<models_dir>/.native/``, mapped read-only by later loads instead of being repacked again. A stored
weight reaches the kernels only after :func:`repack.checked` has matched its bytes against its description."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from llmfw.core.errors import QuantError
from llmfw.core.exec.weight_cache import ConvertedCache
from llmfw.plugins.backends.native.repack import PackedWeight, checked

#: bumped whenever the repacked layout changes, so that entries written by older code are rebuilt
CACHE_FORMAT = 6


class NativeCache(ConvertedCache[PackedWeight]):
    """A model file's entry of repacked weights: each weight's bytes and its code table."""

    label = "native"
    dtypes = frozenset({np.dtype(np.uint8).str, np.dtype(np.int8).str})

    @classmethod
    def format(cls) -> int:
        return CACHE_FORMAT

    @staticmethod
    def arrays_of(weight: PackedWeight) -> dict[str, np.ndarray]:
        return {"data": weight.data, "table": weight.table}

    @staticmethod
    def meta_of(weight: PackedWeight) -> dict[str, Any]:
        return {"kind": weight.kind, "n_rows": weight.n_rows, "n_cols": weight.n_cols, "n_scales": weight.n_scales,
                "has_offsets": weight.has_offsets, "ggml_type": weight.ggml_type, "half_params": weight.half_params,
                "factored": weight.factored, "paired": weight.paired}

    @staticmethod
    def weight_of(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> PackedWeight:
        fields = {name: int(meta[name]) for name in ("kind", "n_rows", "n_cols", "n_scales", "ggml_type")}
        weight = PackedWeight(has_offsets=bool(meta["has_offsets"]), half_params=bool(meta["half_params"]),
                              factored=bool(meta["factored"]), paired=bool(meta["paired"]),
                              table=arrays["table"], data=arrays["data"], **fields)
        try:
            return checked(weight)
        except QuantError as exc:  # the entry is corrupt: the cache deletes and rebuilds it
            raise ValueError(str(exc)) from None
