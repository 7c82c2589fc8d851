"""The one hook point for constrained decoding in the server: request fields → the grammar sampler.

``response_format``, ``grammar``, ``json_schema`` (:func:`llmfw.serving.response_format.constraint_from_request`) and,
on chat, ``tools`` / ``tool_choice`` (:mod:`llmfw.serving.tool_calls`) are read here and nowhere else.
:func:`request_constraint` checks and compiles the constraint once per request; :meth:`Constraint.samplers`
gives each choice its own grammar sampler (its own matcher), which the engine puts at the *front* of the
choice's chain (a grammar's token mask must come before the other samplers, as in llama.cpp).
Every bad field answers 400 with ``param`` naming it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import GrammarError, RequestError
from .response_format import constraint_from_request
from ..core.generation.sampling import Sampler, SamplerEnv, SamplerParams, build_sampler
from .tool_calls import ToolCallFormat, detect_tool_call_format, forced_function_names, tool_call_grammar
from .protocol import GenerationFields

log = logging.getLogger(__name__)

#: the output-format fields, in the order a conflict between them is reported
FORMAT_FIELDS = ("response_format", "json_schema", "grammar")


@dataclass
class Constraint:
    """What one request asks of its output: a compiled grammar (or none) and, for a chat with tools, the
    format its tool calls are parsed from (None: the output is all content)."""

    params: SamplerParams | None = None
    tool_format: ToolCallFormat | None = None
    #: what the client should know about how its request was read (sent back beside the reply, and logged)
    warnings: list[str] = field(default_factory=list)

    def samplers(self, model: Any, n_ctx: int) -> list[Sampler]:
        """A fresh grammar sampler for one choice (the compiled grammar is shared, the matcher is not)."""
        if self.params is None:
            return []
        return [build_sampler("grammar", self.params, SamplerEnv.from_model(model, None, n_ctx))]


def _asks_for_format(field: str, value: Any) -> bool:
    if value is None:
        return False
    if field == "response_format":
        return not (isinstance(value, dict) and value.get("type", "text") == "text")
    return True


def format_constraint(request: GenerationFields) -> dict[str, Any]:
    """``SamplerParams`` keywords for ``response_format`` / ``json_schema`` / ``grammar`` (``{}`` for none);
    a RequestError naming the bad (or second, conflicting) field."""
    given = [f for f in FORMAT_FIELDS if _asks_for_format(f, getattr(request, f))]
    if not given:
        return {}
    try:
        return constraint_from_request({f: getattr(request, f) for f in given})
    except GrammarError as exc:
        raise RequestError(str(exc), given[1] if len(given) > 1 else given[0]) from None


def tool_constraint(request: GenerationFields, model: Any, template: str | None) -> tuple[str | None,
                                                                                          ToolCallFormat | None]:
    """(the grammar forcing a call, the format to parse calls from) for a chat's ``tools`` / ``tool_choice``."""
    tools = request.tools
    forced = _check_tools(tools, request.tool_choice)  # also: a forced choice without tools is an error
    if not tools or request.tool_choice == "none":
        return None, None
    fmt = detect_tool_call_format(template)
    if fmt is None:
        if forced:
            raise RequestError("this model's chat template shows no tool-call format (Hermes/Qwen <tool_call>, "
                               "Llama-3.1 JSON, Mistral, DeepSeek, gpt-oss, Qwen3-Coder), so a tool call cannot be "
                               "forced; serve it with a tool-capable chat template (llmfw serve --chat-template FILE, "
                               "the pipeline's chat.template / chat.template_file)", "tool_choice")
        return None, None  # "auto" with a template that knows no tools: the reply is plain content (warned)
    try:
        grammar = tool_call_grammar(tools, request.tool_choice, fmt, vocab=model.vocab,
                                    parallel=bool(getattr(request, "parallel_tool_calls", False)))
    except GrammarError as exc:
        raise RequestError(f"tools: {exc}", "tools") from None
    return grammar, fmt


def _check_tools(tools: Any, tool_choice: Any) -> bool:
    """Validate ``tools`` and ``tool_choice``; True when the choice forces a call."""
    if tools is not None and not isinstance(tools, list):
        raise RequestError(f"tools must be a list of functions, got {type(tools).__name__}", "tools")
    try:
        return forced_function_names(tools, tool_choice) is not None
    except GrammarError as exc:
        raise RequestError(str(exc), "tool_choice" if "tool_choice" in str(exc) else "tools") from None


def tools_ignored_warning(request: GenerationFields, template: str | None, template_name: str) -> str | None:
    """The warning for tools offered (``tool_choice`` auto) to a template that shows no tool-call format: the
    model answers in prose and no call is parsed. It names the tools and the template."""
    if not request.tools or request.tool_choice not in (None, "auto") or detect_tool_call_format(template):
        return None
    names = ", ".join(str((t.get("function") or {}).get("name", "?")) for t in request.tools if isinstance(t, dict))
    return (f"tools ({names}) were offered with tool_choice auto, but {template_name} shows no tool-call format "
            "(Hermes/Qwen <tool_call>, Llama-3.1 JSON, ...): the model was not taught to call them and no call is "
            "parsed from its reply; serve it with a tool-capable template (llmfw serve --chat-template FILE)")


def request_constraint(request: GenerationFields, model: Any, template: str | None = None,
                       chat: bool = False, template_name: str = "the chat template") -> Constraint:
    """The request's constraint, checked and compiled once (RequestError naming the field when it is bad)."""
    fields = format_constraint(request)
    param = next((f for f in FORMAT_FIELDS if _asks_for_format(f, getattr(request, f))), "grammar")
    tool_format = None
    warnings = []
    if chat:
        grammar, tool_format = tool_constraint(request, model, template)
        warning = tools_ignored_warning(request, template, template_name)
        if warning:
            log.warning("%s", warning)
            warnings.append(warning)
        if grammar is not None:
            if fields:
                raise RequestError("a forced tool call (tool_choice required or a named function) cannot be "
                                   "combined with response_format, json_schema or grammar", "tool_choice")
            fields, param = {"grammar": grammar}, "tools"
    elif request.tools:
        raise RequestError("tools are only supported on /v1/chat/completions", "tools")
    if not fields:
        return Constraint(None, tool_format, warnings)
    try:
        return Constraint(SamplerParams(**fields), tool_format, warnings)
    except GrammarError as exc:
        raise RequestError(str(exc), param) from None
