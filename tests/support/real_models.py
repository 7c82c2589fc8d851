"""The real models, loaded once per test session for each way the tests load them, closed at its end.

Loading SmolLM2 or Gemma-3 costs seconds (dequantized weights, ONNX Runtime sessions, ggml graphs); before this
cache, seven modules loaded SmolLM2 on numpy each. A test that changes a model, closes it or loads it with
options of its own (placement, backend options, overrides, a progress callback) keeps loading its own."""
from __future__ import annotations

from typing import Callable

import llmfw
from llmfw.core.exec.backend import default_backend_spec


class SharedModels:
    """``get(name, backend, vocab_only)``: one model per (file, backend spec, vocab_only), made on first use.
    ``backend=None`` is the default backend and shares its model with that backend's name."""

    def __init__(self, path_of: Callable[[str], object]) -> None:
        self._path_of = path_of
        self._models: dict[tuple[str, str | None, bool], llmfw.Model] = {}

    def get(self, name: str, backend: str | None = None, *, vocab_only: bool = False) -> llmfw.Model:
        if vocab_only:
            backend = None  # no weights: no backend
        elif backend is None:
            backend = default_backend_spec()
        key = (name, backend, vocab_only)
        if key not in self._models:
            self._models[key] = llmfw.load_model(self._path_of(name), backend=backend, vocab_only=vocab_only)
        return self._models[key]

    def close(self) -> None:
        for model in self._models.values():
            model.close()
        self._models.clear()
