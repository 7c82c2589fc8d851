"""Refusing a load that cannot fit, before anything is allocated.

A mixture-of-experts file is mostly expert tensors, and a file whose experts do not fit in memory would otherwise
run the machine into swap or the OOM killer halfway through a load. Before the first weight is converted, each
weight's backend says how many bytes it will keep for it (:meth:`Backend.resident_bytes`: at least the tensor's
bytes in the file); the sum is compared with the memory available — ``ModelParams.memory_available``, else the
``LLMFW_MEMORY_AVAILABLE`` environment variable, else the kernel's ``MemAvailable`` (``/proc/meminfo``) — and a
load that needs more is an :class:`~llmfw.core.errors.InsufficientMemory` naming both numbers.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError, InsufficientMemory

if TYPE_CHECKING:
    from .loader import ModelFileLoader, WeightLoad

log = logging.getLogger(__name__)

#: replaces MemAvailable (bytes, or with a K/M/G/T suffix); a negative value turns the check off
MEMORY_ENV = "LLMFW_MEMORY_AVAILABLE"
_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"12G"`` → 12 GiB in bytes; ``"512"`` → 512; ConfigError when it is not a size."""
    value = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = _SUFFIXES.get(value[-1:], 1)
    number = value[:-1] if value[-1:] in _SUFFIXES else value
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ConfigError(f"{MEMORY_ENV}={text!r} is not a size (bytes, or a number with K/M/G/T)") from None


def available_memory(override: int | None = None) -> int | None:
    """Bytes a load may use: ``override``, else ``$LLMFW_MEMORY_AVAILABLE``, else MemAvailable; None when
    unknown (not Linux) or the check is off (a negative value)."""
    if override is None and os.environ.get(MEMORY_ENV):
        override = parse_size(os.environ[MEMORY_ENV])
    if override is not None:
        return None if override < 0 else override
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def bytes_needed(loads: "list[WeightLoad]", loader: "ModelFileLoader") -> int:
    """What the backends will keep for ``loads`` (each backend's :meth:`resident_bytes` of its weights)."""
    total = 0
    for load in loads:
        if load.generated is not None:
            total += int(load.generated.nbytes)
            continue
        record = loader.tensor_record(load.file_tensor)
        total += load.backend.resident_bytes(record.ggml_type, record.ne, frozenset({load.usage}), record.nbytes)
    return total


def check_memory(loads: "list[WeightLoad]", loader: "ModelFileLoader", override: int | None = None) -> None:
    """InsufficientMemory when the weights need more than the memory available (nothing is allocated yet)."""
    available = available_memory(override)
    if available is None:
        return
    needed = bytes_needed(loads, loader)
    if needed > available:
        raise InsufficientMemory(
            f"{loader.path}: the weights need {needed / 2**30:.2f} GiB of memory on "
            f"{', '.join(sorted({load.backend.name for load in loads}))}, and {available / 2**30:.2f} GiB is "
            f"available; free memory, use a smaller quantization, or set {MEMORY_ENV} (bytes, a K/M/G suffix, "
            f"-1 to skip this check) if the estimate is wrong")
    log.debug("weights need %.2f GiB of the %.2f GiB available", needed / 2**30, available / 2**30)
