"""llmfw — run GGUF language models the way llama.cpp does, in Python, built from plugins.

The public API (pinned: docs/design.md, "Public API") is imported lazily so that ``import llmfw`` and ``llmfw --help`` stay
fast and never import torch or onnxruntime.
"""
from __future__ import annotations

import importlib
from typing import Any

from .core.errors import *  # noqa: F403 - the exception hierarchy is part of the public API
from .core.errors import LLMFWError

__version__ = "0.1.0"

_LAZY = {
    "load_model": "llmfw.core.runtime.model:load_model",
    "ModelParams": "llmfw.core.runtime.model:ModelParams",
    "Model": "llmfw.core.runtime.model:Model",
    "Context": "llmfw.core.runtime.context:Context",
    "ContextParams": "llmfw.core.runtime.context:ContextParams",
    "Batch": "llmfw.core.runtime.batch:Batch",
    "generate": "llmfw.core.generation.generate:generate",
    "perplexity": "llmfw.core.generation.perplexity:perplexity",
    "SamplerChain": "llmfw.core.generation.sampling:SamplerChain",
    "SamplerParams": "llmfw.core.generation.sampling:SamplerParams",
    "load_pipeline": "llmfw.app.pipeline:load_pipeline",
    "hookimpl": "llmfw.core.plugins:hookimpl",
    "get_plugin_manager": "llmfw.core.plugins:get_plugin_manager",
}


def __getattr__(name: str) -> Any:
    ref = _LAZY.get(name)
    if ref is None:
        raise AttributeError(f"module 'llmfw' has no attribute {name!r}")
    module_name, _, attr = ref.partition(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["LLMFWError", "__version__", *_LAZY]
