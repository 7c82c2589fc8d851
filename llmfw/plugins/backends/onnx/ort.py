"""onnxruntime and onnx, imported lazily (listing backends never imports them), and the KV storage sessions bind."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from llmfw.core.errors import BackendUnavailable

INSTALL_HINT = "pip install onnxruntime onnx (core dependencies of llmfw)"


def import_onnxruntime() -> tuple[Any, Any]:
    """``(onnxruntime, onnx)``, imported on first use; BackendUnavailable naming the extra when missing."""
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailable(f"the onnx backend needs onnxruntime and onnx, which are not installed ({exc}); "
                                 f"install them with: {INSTALL_HINT}") from exc
    return onnxruntime, onnx


def execution_providers(device: str | None) -> list[str]:
    """The ONNX Runtime execution providers for a device spec: ``None``/``"cpu"`` or ``"cuda"``."""
    ort, _ = import_onnxruntime()
    if device in (None, "cpu"):
        return ["CPUExecutionProvider"]
    if device == "cuda" or device.startswith("cuda:"):
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise BackendUnavailable(f"onnx backend device {device!r} needs onnxruntime's CUDAExecutionProvider "
                                     f"(pip install onnxruntime-gpu); this onnxruntime {ort.__version__} has "
                                     f"{', '.join(available)}")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    raise BackendUnavailable(f"onnx backend: unknown device {device!r}; expected 'cpu' or 'cuda[:N]'")


@dataclass
class OnnxKV:
    """K and V of one layer, ``[n_head_kv, n_cells, head_dim]`` float32 (each head's cells contiguous, so a
    prefix of cells is a cheap slice), with OrtValues sharing their memory (bound as both input and output of
    the in-place ScatterND)."""

    k: np.ndarray
    v: np.ndarray
    k_value: Any = None
    v_value: Any = None
