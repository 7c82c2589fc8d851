"""The one hook point for constrained decoding in the server: request fields → extra samplers.

``response_format``, ``grammar``, ``json_schema`` and ``tools`` are turned into samplers here and nowhere else.
The engine puts the samplers returned by :func:`constraint_samplers` at the *front* of the request's chain
(a grammar's token mask must come before the other samplers, DESIGN.md "Structured output").

Until the grammar sampler exists every such field that asks for a constraint is refused with a 400 naming the
field — nothing is silently ignored. To wire the grammar sampler in, replace the body of
:func:`constraint_samplers` (e.g. ``build_sampler("grammar", SamplerParams(grammar=..., json_schema=...), env)``).
"""
from __future__ import annotations

from typing import Any

from ..core.errors import RequestError
from ..core.sampling import Sampler
from .protocol import GenerationFields


def _asks_for_constraint(field: str, value: Any) -> bool:
    if value is None:
        return False
    if field == "response_format":
        return not (isinstance(value, dict) and value.get("type", "text") == "text")
    if field == "tools":
        return bool(value)
    return True


def constraint_samplers(request: GenerationFields, model: Any) -> list[Sampler]:
    """Samplers that enforce the request's output constraints (none yet: constrained requests are refused)."""
    for field in ("response_format", "grammar", "json_schema", "tools"):
        if _asks_for_constraint(field, getattr(request, field)):
            raise RequestError(f"{field} is not supported by this server yet (constrained decoding is not "
                               "built); send the request without it", field)
    return []
