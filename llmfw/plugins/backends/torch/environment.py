"""Finding torch and the device: torch is imported here on first use only, with OpenMP's wait policy set first."""
from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

from llmfw.core.errors import BackendUnavailable

log = logging.getLogger(__name__)

PIP_EXTRA = "torch"
INSTALL_HINT = f"pip install 'llmfw[{PIP_EXTRA}]'"

#: what the CLI maps onto the ``spin`` option (``LLMFW_TORCH_SPIN=0``: torch's OpenMP threads sleep at once when
#: idle instead of spinning): a little slower on an idle machine, much faster beside busy processes
#: (docs/backends.md, torch).
SPIN_ENV = "LLMFW_TORCH_SPIN"


def apply_spin_setting(spin: bool) -> None:
    """``spin=False``: set OpenMP's wait policy to PASSIVE before torch loads its OpenMP runtime (which reads it
    once); an explicit ``OMP_WAIT_POLICY`` wins, and once torch is loaded it is too late (a warning says so)."""
    if spin or "OMP_WAIT_POLICY" in os.environ:
        return
    if "torch" in sys.modules:
        log.warning("torch option spin=False has no effect: torch was imported before llmfw's torch backend")
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


@functools.cache
def import_torch() -> Any:
    """torch, imported on first use; BackendUnavailable naming the extra when it is not installed."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise BackendUnavailable(f"the torch backend needs PyTorch, which is not installed ({exc}); "
                                 f"install it with: {INSTALL_HINT}") from exc
    return torch


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA kernel driver is loaded (what CUDA needs), read from /proc without importing torch."""
    return os.path.exists("/proc/driver/nvidia/version")


def check_device(device: str | None) -> str:
    """Normalise a device ("cpu", "cuda", "cuda:1"); BackendUnavailable when torch cannot use it."""
    torch = import_torch()
    device = device or "cpu"
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        raise BackendUnavailable(f"torch backend device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"torch backend device {device!r} requested but torch {torch.__version__} sees no "
                                 f"CUDA device (torch.cuda.is_available() is False)")
    return device
