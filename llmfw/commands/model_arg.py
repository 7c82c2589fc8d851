"""``-m MODEL``, the same way in every command: a catalog name or a GGUF path.

Commands that took the model as their first argument (``llmfw inspect MODEL``, ``llmfw tokenize MODEL TEXT``,
``llmfw bench MODEL``) keep that form where it cannot be mistaken for anything else; where it can (``llmfw embed
TEXT...``), a first text that names a model is refused with the ``-m`` spelling instead of being embedded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import click

from ..core.format import catalog

MODEL_HELP = f"Catalog name or GGUF path (default: {catalog.DEFAULT_MODEL})."


def model_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``-m/--model MODEL`` (the value lands in the command's ``model`` parameter)."""
    return click.option("-m", "--model", "model", default=None, metavar="MODEL", help=MODEL_HELP)(func)


def model_from(positional: str | None, option: str | None) -> str | None:
    """The model a command was given, as ``-m MODEL`` or as the older positional MODEL (not both)."""
    if positional is not None and option is not None:
        raise click.UsageError(f"the model is given twice ({positional!r} and -m {option!r}): give it once, with -m")
    return option if option is not None else positional


def names_a_model(text: str) -> bool:
    """Whether ``text`` is a catalog name or an existing GGUF file (an argument a user meant as the model)."""
    if catalog.lookup(text) is not None:
        return True
    path = Path(text).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()
