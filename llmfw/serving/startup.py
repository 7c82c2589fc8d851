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
from .router import ServedModel


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


def serves_several(config: Any) -> bool:
    """Whether the configuration serves several models (a ``models:`` list or a models folder): requests are
    then routed by their ``model``, each model loaded on first use."""
    return config.models is not None or bool(config.server.models_dir)


def preflight_models(pipeline: Any, progress: Any = None) -> list[ServedModel]:
    """Every model of a configuration that serves several (:func:`serves_several`), each checked like
    :func:`preflight_model` (one clear error for the first bad one): the ``model`` when the configuration names
    one explicitly, the ``models:`` list, then every ``*.gguf`` of ``server.models_dir`` (by file name)."""
    config = pipeline.config
    if config.models is not None and "model" in config.model_fields_set:
        raise ConfigError("give `model` or a `models:` list, not both")
    served: list[ServedModel] = []
    if "model" in config.model_fields_set:
        served.append(_served(pipeline, config.model, "model", None, [], progress))
    for i, entry in enumerate(config.models or []):
        served.append(_served(pipeline, entry.model, f"models.{i}.model", entry.name, entry.aliases, progress))
    if config.server.models_dir:
        served += [_served(pipeline, str(path), "server.models_dir", None, [], progress)
                   for path in models_in_folder(pipeline.relative_path(config.server.models_dir))]
    if not served:
        raise ConfigError("the `models:` list is empty: name at least one model")
    return served


def models_in_folder(folder: Path) -> list[Path]:
    """The ``*.gguf`` files of a models folder, by name; a folder that is missing or holds none is an error."""
    if not folder.is_dir():
        raise ConfigError(f"models folder {folder}: no such folder")
    files = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if not files:
        raise ConfigError(f"models folder {folder}: it holds no .gguf file")
    return files


def _served(pipeline: Any, value: str, key: str, name: str | None, aliases: list[str], progress: Any) -> ServedModel:
    location = pipeline.locate_model(value, key)
    path = preflight_model(location, progress)
    default_name = Path(location).stem if Path(location).exists() else value  # a catalog model: its name
    return ServedModel(name or default_name, path, tuple(aliases))
