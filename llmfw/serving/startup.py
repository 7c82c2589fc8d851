"""Checks ``llmfw serve`` runs before it listens: a model that cannot be served is one clear error line and a
non-zero exit, never a server that answers 503 forever.

:func:`preflight_model` resolves the model (pulling a catalog model, as ``run`` does), reads its GGUF header and
looks its ``general.architecture`` up among the registered architectures; each failure is a project error that
``llmfw``'s entry point prints as ``llmfw: error: ...`` with exit code 1. Loading the weights still happens in
the background while ``/health`` answers 503.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import ConfigError, LLMFWError


def preflight_model(location: str | None, progress: Any = None) -> Path:
    """The model's local path once it is known to be a readable GGUF of a known architecture (``progress``:
    :func:`~llmfw.core.format.catalog.resolve_model`'s callback while a catalog model downloads)."""
    from ..core.arch.architecture import get_architecture
    from ..core.format.catalog import resolve_model
    from ..core.format.gguf import open_gguf

    path = Path(resolve_model(location, progress=progress))
    try:
        with open_gguf(path) as gguf:
            arch = gguf.metadata.get("general.architecture")
    except LLMFWError as exc:
        raise ConfigError(f"model {path}: not a usable GGUF file: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"model {path}: cannot read it: {exc.strerror or exc}") from None
    if not isinstance(arch, str) or not arch:
        raise ConfigError(f"model {path}: the GGUF has no general.architecture")
    try:
        get_architecture(arch)
    except LLMFWError as exc:
        raise ConfigError(f"model {path}: {exc}") from None
    return path
