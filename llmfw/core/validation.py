"""pydantic's validation errors as a person would write them: ``key.path: what was wrong (got VALUE)``.

Every settings model of the project (model, context, sampling, backend options, hyperparameters, YAML pipelines,
request bodies) reports its errors through :func:`validation_problems`, so each says the same thing the same way:
``n_ctx: must be >= 0 (got -1)``, ``n_ctxx: unknown key, did you mean 'n_ctx'?``.
"""
from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import ValidationError

_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
           "less_than": ("<", "lt")}
_FIXED = {"extra_forbidden": "unknown key", "missing": "is required", "int_parsing": "must be an integer",
          "int_type": "must be an integer", "int_from_float": "must be an integer", "float_parsing":
          "must be a number", "float_type": "must be a number", "bool_parsing": "must be true or false",
          "bool_type": "must be true or false", "string_type": "must be a string", "list_type": "must be a list",
          "dict_type": "must be a mapping (key: value)", "model_type": "must be a mapping (key: value)",
          "model_attributes_type": "must be a mapping (key: value)"}


def plain_wording(err: Mapping[str, Any]) -> str:
    """pydantic's error as a person would say it: "must be <= 1", "unknown key", "must be an integer"."""
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    if kind in _BOUNDS:
        symbol, key = _BOUNDS[kind]
        return f"must be {symbol} {ctx.get(key)}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    return _FIXED.get(kind) or str(err.get("msg", "invalid value")).removeprefix("Value error, ")


def _unknown_key(key: str, known: Collection[str], noun: str) -> str:
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean {match[0]!r}?" if match else f"known {noun}s: {', '.join(sorted(known)) or '(none)'}"
    return f"unknown {noun}, {hint}"


def validation_problems(exc: ValidationError, prefix: str = "", known_keys: Collection[str] | None = None,
                        key_noun: str = "key") -> list[tuple[str, str]]:
    """(``key.path``, ``what was wrong (got VALUE)``) for every error of ``exc``. An error raised by a nested
    validator that carries ``problems`` of its own (``SamplerParamsError``) is expanded under its path; with
    ``known_keys``, an unknown key (``key_noun``: what the messages call a key) names the closest known one."""
    problems = []
    for err in exc.errors():
        path = ".".join(str(part) for part in (prefix, *err.get("loc", ())) if part != "")
        nested = getattr((err.get("ctx") or {}).get("error"), "problems", None)
        if isinstance(nested, list):
            problems += [(".".join(p for p in (path, key) if p), msg) for key, msg in nested]
            continue
        msg = plain_wording(err)
        if err.get("type") == "extra_forbidden" and known_keys is not None and err.get("loc"):
            msg = _unknown_key(str(err["loc"][-1]), known_keys, key_noun)
        shown = ""
        if "input" in err and err.get("type") not in ("missing", "extra_forbidden") \
                and not isinstance(err["input"], dict):
            shown = f" (got {err['input']!r})"
        problems.append((path or "(top level)", f"{msg}{shown}"))
    return problems


def validation_error_message(exc: ValidationError, prefix: str = "", known_keys: Collection[str] | None = None,
                             key_noun: str = "key") -> str:
    """One clause per problem: ``key.path: what was wrong (got VALUE)``."""
    return "; ".join(f"{path}: {msg}" for path, msg in validation_problems(exc, prefix, known_keys, key_noun))
