"""JSON schemas as llama.cpp's json-schema-to-grammar reads them: an object schema that lists ``properties``
and says nothing about ``additionalProperties`` admits **no other keys** (JSON Schema itself would allow any).

This is also what OpenAI's ``strict: true`` promises, and what a user of ``response_format`` expects: asked for
``{"kind", "age"}``, a model must not add ``"name"``. An explicit ``additionalProperties`` (true or a schema),
``patternProperties`` or ``unevaluatedProperties`` keeps its meaning. Objects directly inside ``allOf`` are left
open, since closing each part of an intersection would refuse the keys the other parts add.
"""
from __future__ import annotations

from typing import Any

#: keywords whose value is a schema
_SCHEMA_KEYWORDS = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
                    "propertyNames", "unevaluatedItems", "unevaluatedProperties")
#: keywords whose value maps names to schemas
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: keywords whose value is a list of schemas
_SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "prefixItems", "items")
#: keywords that already say which other keys an object admits
_OPENING_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_schema(schema: Any, close: bool = True) -> Any:
    """A copy of ``schema`` in which every object schema with ``properties`` and no word on other keys gets
    ``additionalProperties: false`` (``close`` False: this level is left open, its children are not)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_KEYWORDS:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    for key in _SCHEMA_MAP_KEYWORDS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LIST_KEYWORDS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_schema(sub, close=False) for sub in out["allOf"]]
    if close and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPENING_KEYWORDS):
        out["additionalProperties"] = False
    return out


__all__ = ["closed_schema"]
