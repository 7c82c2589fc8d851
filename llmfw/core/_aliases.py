"""Old module paths (``llmfw.core.graph``, ``llmfw.core.sampling``, ...) kept importable for one release.

The core's modules moved into layered subpackages (``llmfw.core.ir.graph``, ``llmfw.core.generation.sampling``,
...). Code outside the package (tests, plugins, user scripts) may still import the old names, private ones
included; a meta-path finder answers those names with the module object already imported under the new one, so
``llmfw.core.graph is llmfw.core.ir.graph`` and monkeypatching either name patches both. No file stays at an old
path: git's rename detection then carries edits made to the old files over to the new ones.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Final

#: old module name -> new module name (remove in the release after next)
MOVED_MODULES: Final[Mapping[str, str]] = types.MappingProxyType({
    "llmfw.core.gguf": "llmfw.core.format.gguf",
    "llmfw.core.quants": "llmfw.core.format.quants",
    "llmfw.core.vocab": "llmfw.core.tokenizer.vocab",
    "llmfw.core.vocab_loader": "llmfw.core.tokenizer.vocab_loader",
    "llmfw.core.chat": "llmfw.core.tokenizer.chat",
    "llmfw.core.graph": "llmfw.core.ir.graph",
    "llmfw.core.passes": "llmfw.core.ir.passes",
    "llmfw.core.rope": "llmfw.core.ir.rope",
    "llmfw.core.hparams": "llmfw.core.ir.hparams",
    "llmfw.core.arch.hparams": "llmfw.core.ir.hparams",  # moved again: the graph IR reads the model's shape
    "llmfw.core.architecture": "llmfw.core.arch.architecture",
    "llmfw.core.backend": "llmfw.core.exec.backend",
    "llmfw.core.scheduler": "llmfw.core.exec.scheduler",
    "llmfw.core.loader": "llmfw.core.runtime.loader",
    "llmfw.core.model": "llmfw.core.runtime.model",
    "llmfw.core.batch": "llmfw.core.runtime.batch",
    "llmfw.core.memory": "llmfw.core.runtime.memory",
    "llmfw.core.context": "llmfw.core.runtime.context",
    "llmfw.core.state": "llmfw.core.runtime.state",
    "llmfw.core.sampling": "llmfw.core.generation.sampling",
    "llmfw.core.grammar": "llmfw.core.generation.grammar",
    "llmfw.core.generate": "llmfw.core.generation.generate",
    "llmfw.core.speculative": "llmfw.core.generation.speculative",
    "llmfw.core.embedding": "llmfw.core.runtime.embedding",
    "llmfw.core.generation.embedding": "llmfw.core.runtime.embedding",  # moved down: Model.embed calls it
    "llmfw.core.perplexity": "llmfw.core.generation.perplexity",
    "llmfw.core.pipeline": "llmfw.app.pipeline",
    "llmfw.core.catalog": "llmfw.core.format.catalog",
    "llmfw.app.catalog": "llmfw.core.format.catalog",  # moved down: loading a model resolves catalog names
    "llmfw.core.tool_calls": "llmfw.serving.tool_calls",
    "llmfw.core.response_format": "llmfw.serving.response_format",
})


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module imported under its new name (the very same object)."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.new_name)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the new module is already executed. The import system has just set its ``__spec__``
        to the old name's; it gets its own back, or a relative import inside it would see a ``__spec__.parent``
        other than its ``__package__`` (an ImportWarning, an error where warnings are errors)."""
        module.__spec__ = self.own_spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED_MODULES` and nothing else."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new_name = MOVED_MODULES.get(fullname)
        if new_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new_name))


def install() -> None:
    """Appends the finder to ``sys.meta_path`` once (after the path finders, which find no file at an old path)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
