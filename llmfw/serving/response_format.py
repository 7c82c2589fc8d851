"""Request fields that constrain output, as an OpenAI-compatible server receives them, turned into the grammar
sampler's input (``SamplerParams(grammar=...)`` / ``SamplerParams(json_schema=...)``).

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object;
  llama-server also reads a ``schema`` next to it), ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}`` (the schema; with or without ``strict``, an object that lists ``properties`` and does not
  mention ``additionalProperties`` admits no other keys — llama.cpp's reading, :mod:`llmfw.core.generation.schema_closed`);
* llama-server's own fields: ``grammar`` (GBNF or Lark text) and ``json_schema`` (a schema object or its text).

:func:`constraint_from_request` checks the constraint by compiling it, so a bad schema or grammar raises
:class:`~llmfw.core.errors.GrammarError` before any generation — a server answers 400 with its message.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..core.errors import GrammarError
from ..core.generation.grammar import ANY_JSON_OBJECT, grammar_spec

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def constraint_from_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """``SamplerParams`` keyword arguments (``{}``, ``{"grammar": str}`` or ``{"json_schema": dict | str}``) for
    a request body's ``response_format`` / ``grammar`` / ``json_schema`` fields; GrammarError when a field is
    malformed, the constraint does not compile, or more than one constraint is given."""
    given: dict[str, Any] = {}
    schema = schema_from_response_format(body.get("response_format"))
    if schema is not None:
        given["response_format"] = {"json_schema": schema}
    if body.get("json_schema") is not None:
        value = body["json_schema"]
        if not isinstance(value, (dict, str, bool)):
            raise GrammarError(f"json_schema must be a JSON schema object, got {type(value).__name__}")
        given["json_schema"] = {"json_schema": value}
    if body.get("grammar") is not None:
        if not isinstance(body["grammar"], str):
            raise GrammarError(f"grammar must be a string (GBNF or Lark), got {type(body['grammar']).__name__}")
        if body["grammar"].strip():  # llama-server treats an empty grammar as none
            given["grammar"] = {"grammar": body["grammar"]}
    if len(given) > 1:
        raise GrammarError(f"give only one of response_format (json), json_schema and grammar; got "
                           f"{' and '.join(given)}")
    if not given:
        return {}
    constraint = next(iter(given.values()))
    spec = grammar_spec(**constraint)
    if spec is not None:
        spec.compile()  # raises GrammarError with the place of the problem
    return dict(constraint)


def schema_from_response_format(response_format: Any) -> dict[str, Any] | str | bool | None:
    """The JSON schema a ``response_format`` asks for (None for text / absent)."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GrammarError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type", "text")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise GrammarError(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return dict(ANY_JSON_OBJECT) if schema is None else schema
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise GrammarError('response_format of type "json_schema" needs a "json_schema" object '
                           '({"name": ..., "schema": {...}, "strict": true})')
    if "schema" not in spec:
        raise GrammarError('response_format.json_schema needs a "schema"')
    schema = spec["schema"]
    if not isinstance(schema, (Mapping, str, bool)):
        raise GrammarError(f"response_format.json_schema.schema must be a JSON schema object, got "
                           f"{type(schema).__name__}")
    return dict(schema) if isinstance(schema, Mapping) else schema


__all__ = ["RESPONSE_FORMAT_TYPES", "constraint_from_request", "schema_from_response_format"]
