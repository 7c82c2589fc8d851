"""Tool calling for an OpenAI-compatible server: the call format a chat template uses, a grammar that forces a
call (``tool_choice`` ``"required"`` or a named function), and parsing the model's output into OpenAI
``tool_calls`` — whole (:func:`parse_tool_calls`) or streamed as ``delta.tool_calls`` (:class:`ToolCallStream`).

Formats, recognised from the chat template (:func:`detect_tool_call_format`):

* ``hermes`` — Hermes 2/3, Qwen 2.5/3: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``,
  several calls one after another;
* ``llama3_json`` — Llama 3.1/3.2/3.3: the whole reply is ``{"name": "f", "parameters": {...}}`` (optionally
  after ``<|python_tag|>``).

The grammar is Lark (llguidance's dialect) with the call object embedded as a JSON schema (``%json``), so the
function name is one of the tools' names and the arguments validate against that tool's ``parameters``; give it
to ``SamplerParams(grammar=...)``. Whitespace inside the call is bounded like all JSON output.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from ..core.errors import GrammarError
from ..core.generation.grammar import JSON_WHITESPACE, schema_text
from .tool_call_base import (ARGUMENTS_KEY as ARGUMENTS_KEY, HERMES_CLOSE, HERMES_OPEN, PYTHON_TAG as PYTHON_TAG,
                             ToolCall as ToolCall, ToolCallFormat as ToolCallFormat, ToolCallStream as ToolCallStream,
                             new_tool_call_id as new_tool_call_id)
from .tool_formats import (FORMATS, MarkedCallStream, XmlCallStream, detect_marked_format, is_xml_call_template,
                           marked_call_grammar, xml_call_grammar)

MORE_HERMES_CALLS = ' ("\\n" tool_call)*'  # Lark: further calls, one per line


def detect_tool_call_format(template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template teaches its model (None when it knows no tools)."""
    if not template:
        return None
    if is_xml_call_template(template):
        return ToolCallFormat.QWEN3_CODER
    marked = detect_marked_format(template)
    if marked is not None:
        return ToolCallFormat(marked.name)
    if HERMES_OPEN in template:
        return ToolCallFormat.HERMES
    if '"parameters"' in template and ("function name" in template or PYTHON_TAG in template):
        return ToolCallFormat.LLAMA3_JSON
    return None


# ---------------------------------------------------------------------------------------------------------------
# the grammar of a forced call
# ---------------------------------------------------------------------------------------------------------------
def tool_functions(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """name -> parameters schema of each ``{"type": "function", "function": {...}}`` entry of ``tools``."""
    functions: dict[str, Mapping[str, Any]] = {}
    for index, tool in enumerate(tools or ()):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise GrammarError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise GrammarError(f"tools[{index}].function needs a non-empty \"name\"")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, Mapping):
            raise GrammarError(f"tools[{index}].function.parameters must be a JSON schema object")
        functions[function["name"]] = parameters
    return functions


def forced_function_names(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any) -> list[str] | None:
    """The functions a call must be one of (None: no call is forced — ``"none"``, ``"auto"`` or absent)."""
    functions = tool_functions(tools)
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        if not functions:
            raise GrammarError('tool_choice "required" needs at least one tool in "tools"')
        return list(functions)
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"),
                                                                           Mapping) else None
        if not isinstance(name, str):
            raise GrammarError('tool_choice must be "none", "auto", "required" or '
                               '{"type": "function", "function": {"name": ...}}')
        if name not in functions:
            raise GrammarError(f"tool_choice names function {name!r}, which is not in tools "
                               f"({', '.join(functions) or 'none given'})")
        return [name]
    raise GrammarError(f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}')


def call_schema(tools: Sequence[Mapping[str, Any]] | None, names: Sequence[str],
                fmt: ToolCallFormat) -> dict[str, Any]:
    """The JSON schema of one call object: ``{"name": <one of names>, <arguments key>: <its parameters>}``."""
    functions = tool_functions(tools)
    key = ARGUMENTS_KEY[fmt]
    options = [{"type": "object", "properties": {"name": {"const": name}, key: dict(functions[name])},
                "required": ["name", key], "additionalProperties": False} for name in names]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def tool_call_grammar(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, fmt: ToolCallFormat,
                      vocab: Any = None, parallel: bool = False) -> str | None:
    """A Lark grammar that forces a call of the chosen function(s), for ``SamplerParams(grammar=...)``; None
    when ``tool_choice`` forces nothing. GrammarError for bad ``tools`` / ``tool_choice`` / parameter schemas.
    One call, and generation ends after it; ``parallel`` (OpenAI's ``parallel_tool_calls``; llama-server's
    default is false) allows several calls in a row (hermes format).

    With ``vocab``, a tag the vocabulary holds as one special token (Qwen's ``<tool_call>``) is written as that
    token (``<[id]>``), so the model emits the token it was trained on rather than the tag spelled in pieces."""
    names = forced_function_names(tools, tool_choice)
    if names is None:
        return None
    if fmt == ToolCallFormat.QWEN3_CODER:
        return xml_call_grammar(tool_functions(tools), names, lambda schema: schema_text({**schema, "x-guidance": {
            "whitespace_pattern": JSON_WHITESPACE}}))
    if fmt.value in FORMATS:
        return marked_call_grammar(FORMATS[fmt.value], tool_functions(tools), names,
                                   lambda schema: schema_text({**schema, "x-guidance": {
                                       "whitespace_pattern": JSON_WHITESPACE}}))
    call = schema_text(call_schema(tools, names, fmt))  # checked for size and nesting
    if fmt == ToolCallFormat.HERMES:
        return ("%llguidance {}\n"
                f"start: tool_call{MORE_HERMES_CALLS if parallel else ''}\n"
                f'tool_call: {_tag(HERMES_OPEN, vocab)} "\\n" call "\\n" {_tag(HERMES_CLOSE, vocab)}\n'
                f"call: %json {call}\n")
    return f"%llguidance {{}}\nstart: call\ncall: %json {call}\n"


def _tag(text: str, vocab: Any) -> str:
    """A Lark item for a tag: its special token when ``vocab`` has one, else the literal text."""
    token = vocab.text_to_token(text) if vocab is not None else None
    if token is not None and (vocab.is_control(token) or vocab.is_user_defined(token)):
        return f"<[{token}]>"
    return json.dumps(text)


# ---------------------------------------------------------------------------------------------------------------
# parsing: whole and streamed
# ---------------------------------------------------------------------------------------------------------------
def tool_call_stream(fmt: ToolCallFormat) -> Any:
    """The incremental parser for ``fmt``: ``feed`` / ``finish`` giving OpenAI deltas, ``calls``."""
    if fmt == ToolCallFormat.QWEN3_CODER:
        return XmlCallStream()
    if fmt.value in FORMATS:
        return MarkedCallStream(FORMATS[fmt.value])
    return ToolCallStream(fmt)


def parse_tool_calls(text: str, fmt: ToolCallFormat | None) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a whole reply; with no format, all of it is content."""
    if fmt is None:
        return text, []
    stream = tool_call_stream(fmt)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d["content"] for d in deltas if "content" in d)
    return content.strip() if stream.calls else content, stream.calls


__all__ = ["ARGUMENTS_KEY", "ToolCall", "ToolCallFormat", "ToolCallStream", "call_schema", "detect_tool_call_format",
           "forced_function_names", "new_tool_call_id", "parse_tool_calls", "tool_call_grammar", "tool_call_stream",
           "tool_functions"]
