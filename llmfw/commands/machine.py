"""What machine a benchmark ran on, recorded in ``llmfw bench --json`` so a results file says where and when its
numbers were measured (the benchmark page states it)."""
from __future__ import annotations

import datetime
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

#: the libraries whose version changes a backend's speed
_LIBRARIES = ("llmfw", "numpy", "onnxruntime", "torch")
#: the CPU features that decide which kernels the libraries pick
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def _cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, list[str]]:
    """The CPU's model name and which of ``_CPU_FLAGS`` it has (empty where /proc/cpuinfo is not there)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), []
    fields = dict(line.split(":", 1) for line in text.splitlines()[:40] if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return fields.get("model name", platform.machine()), [flag for flag in _CPU_FLAGS if flag in flags]


def _gpus(driver: Path = Path("/proc/driver/nvidia/gpus")) -> list[str]:
    """The model of each NVIDIA GPU the driver lists (its ``information`` files: ``Model: NVIDIA H200``), without
    importing torch; empty without the driver."""
    models = []
    for info in sorted(driver.glob("*/information")) if driver.is_dir() else ():
        try:
            lines = info.read_text(errors="replace").splitlines()
        except OSError:
            continue
        models += [line.split(":", 1)[1].strip() for line in lines if line.startswith("Model:")][:1]
    return models


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def describe_machine() -> dict[str, Any]:
    """The machine, the library versions and the time of a run (UTC, ISO 8601)."""
    cpu, flags = _cpu_info()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu, "cpu_flags": flags, "cpu_count": os.cpu_count(), "gpus": _gpus(),
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
            "system": f"{platform.system()} {platform.release()} {platform.machine()}",
            "python": platform.python_version(),
            "versions": {name: _version(name) for name in _LIBRARIES}}
