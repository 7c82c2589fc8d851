"""The core, in layers: each imports only from its own layer or lower ones.

``errors`` and ``plugins`` (the base every layer may use) < ``format`` (GGUF, quant types) < ``tokenizer``, ``ir``
(graph IR and passes) < ``arch`` (architectures, hparams) < ``exec`` (backends, scheduler) < ``runtime`` (loader,
model, batch, memory, context, state) < ``generation`` (sampling, grammar, generate, ...); above the core come
``llmfw.app`` and ``llmfw.serving``, then ``llmfw.commands`` and ``llmfw.cli``.

The old flat module names (``graph`` for ``ir.graph``, ...) stay importable for one release: see :mod:`._aliases`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._aliases import MOVED_MODULES, install

install()

if not TYPE_CHECKING:  # hidden from mypy: the package's own code must name the new modules
    def __getattr__(name: str) -> object:
        """An old module name as an attribute (``core.graph``), before anything imported that name."""
        if f"{__name__}.{name}" in MOVED_MODULES:
            import importlib

            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
