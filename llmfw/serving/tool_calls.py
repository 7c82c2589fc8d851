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
import re
import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping, Sequence

from ..core.errors import GrammarError
from ..core.generation.grammar import JSON_WHITESPACE, schema_text


class ToolCallFormat(str, Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    # formats with the family's own markers around a JSON arguments object (llmfw.serving.tool_formats)
    MISTRAL = "mistral"
    MISTRAL_NEMO = "mistral_nemo"
    DEEPSEEK_R1 = "deepseek_r1"
    DEEPSEEK_V31 = "deepseek_v31"
    HARMONY = "harmony"
    QWEN3_CODER = "qwen3_coder"  # <function=NAME><parameter=KEY>value</parameter> (llmfw.serving.tool_formats)


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MORE_HERMES_CALLS = ' ("\\n" tool_call)*'  # Lark: further calls, one per line
#: the key holding the arguments in each format's call object
ARGUMENTS_KEY = {ToolCallFormat.HERMES: "arguments", ToolCallFormat.LLAMA3_JSON: "parameters"}


def detect_tool_call_format(template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template teaches its model (None when it knows no tools)."""
    if not template:
        return None
    from .tool_formats import detect_marked_format, is_xml_call_template

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
        from .tool_formats import xml_call_grammar

        return xml_call_grammar(tool_functions(tools), names, lambda schema: schema_text({**schema, "x-guidance": {
            "whitespace_pattern": JSON_WHITESPACE}}))
    if fmt.value in _marked_formats():
        from .tool_formats import FORMATS, marked_call_grammar

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
def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text of the arguments object, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')


class _ArgumentsScanner:
    """Follows a JSON value character by character to tell where it ends (strings, escapes, nesting)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.ended = False

    def feed(self, text: str) -> int:
        """How many characters of ``text`` belong to the value (all of them unless it ends inside)."""
        for i, ch in enumerate(text):
            if self.ended:
                return i
            self.started = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    self.ended = self.depth == 0
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.ended = self.depth == 0
            elif self.depth == 0 and ch in ",}":  # a bare number / literal ended
                self.ended = True
                return i
        return len(text)


class ToolCallStream:
    """Incremental parser of a model's reply in a tool-call format.

    :meth:`feed` takes each generated text piece and returns the OpenAI ``delta`` objects it completes:
    ``{"content": "..."}`` for text outside calls, ``{"tool_calls": [{"index", "id", "type", "function":
    {"name", "arguments": ""}}]}`` when a call's name is known, then ``{"tool_calls": [{"index", "function":
    {"arguments": "<fragment>"}}]}`` as its arguments arrive. :meth:`finish` flushes what is held back.
    ``calls`` holds the complete :class:`ToolCall` list so far.
    """

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._state = "text" if fmt == ToolCallFormat.HERMES else "start"
        self._scanner: _ArgumentsScanner | None = None

    # -- public ------------------------------------------------------------------------------------------------
    def feed(self, piece: str) -> list[dict[str, Any]]:
        self._buffer += piece
        deltas: list[dict[str, Any]] = []
        while True:
            before = (self._state, len(self._buffer))
            deltas += getattr(self, f"_step_{self._state}")()
            if (self._state, len(self._buffer)) == before:
                return _merged(deltas)

    def finish(self) -> list[dict[str, Any]]:
        """End of the reply: an unfinished call whose JSON is complete is kept; anything else is content."""
        deltas: list[dict[str, Any]] = []
        if self._state in ("text", "start") and self._buffer:
            deltas.append({"content": self._buffer})
        elif self._state == "call_head" and self._buffer.strip():
            deltas += self._whole_call_or_content(self._buffer)
        self._buffer = ""
        self._state = "done"
        return _merged(deltas)

    @property
    def content_so_far(self) -> str:
        return self._buffer if self._state in ("text", "start") else ""

    # -- states --------------------------------------------------------------------------------------------------
    def _step_start(self) -> list[dict[str, Any]]:
        """llama3_json: the reply is a call when it starts with ``{`` (after blanks / <|python_tag|>)."""
        text = self._buffer.lstrip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):].lstrip()
        if not text or PYTHON_TAG.startswith(text):
            return []  # not decided yet
        self._buffer = text
        self._state = "call_head" if text.startswith("{") else "plain"
        return []

    def _step_plain(self) -> list[dict[str, Any]]:
        text, self._buffer = self._buffer, ""
        return [{"content": text}] if text else []

    def _step_text(self) -> list[dict[str, Any]]:
        """hermes: content up to ``<tool_call>``; a possible start of the tag is held back."""
        at = self._buffer.find(HERMES_OPEN)
        if at >= 0:
            content, self._buffer = self._buffer[:at], self._buffer[at + len(HERMES_OPEN):]
            self._state = "call_head"
            return [{"content": content}] if content.strip() else []
        keep = _partial_suffix(self._buffer, HERMES_OPEN)
        content = self._buffer[:len(self._buffer) - keep]
        self._buffer = self._buffer[len(content):]
        return [{"content": content}] if content else []

    def _step_call_head(self) -> list[dict[str, Any]]:
        head = _CALL_HEAD.match(self._buffer)
        if head:
            call = ToolCall(name=json.loads(f'"{head.group(1)}"'), arguments="")
            self.calls.append(call)
            self._buffer = self._buffer[head.end():]
            self._scanner = _ArgumentsScanner()
            self._state = "arguments"
            return [{"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": ""}}]}]
        closed = self._closing_at()
        if closed is not None:  # a call whose keys came in another order: parse it whole
            body, self._buffer = self._buffer[:closed], self._buffer[closed:]
            self._state = "after_call"
            return self._whole_call_or_content(body)
        return []

    def _step_arguments(self) -> list[dict[str, Any]]:
        assert self._scanner is not None
        if not self._scanner.started:
            self._buffer = self._buffer.lstrip()
        taken = self._scanner.feed(self._buffer)
        fragment, self._buffer = self._buffer[:taken], self._buffer[taken:]
        call = self.calls[-1]
        call.arguments += fragment
        if self._scanner.ended:
            self._state = "after_call"
        return [{"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": fragment}}]}] \
            if fragment else []

    def _step_after_call(self) -> list[dict[str, Any]]:
        """Skip the rest of the call: the object's ``}``, and for hermes the closing tag; then text again."""
        if self.fmt == ToolCallFormat.LLAMA3_JSON:
            end = self._buffer.find("}")
            if end < 0:
                return []
            self._buffer = self._buffer[end + 1:].lstrip(" \t\n;")
            self._state = "start"
            return []
        end = self._buffer.find(HERMES_CLOSE)
        if end < 0:
            return []
        self._buffer = self._buffer[end + len(HERMES_CLOSE):]
        self._state = "text"
        return []

    def _step_done(self) -> list[dict[str, Any]]:
        return []

    # -- helpers -------------------------------------------------------------------------------------------------
    def _closing_at(self) -> int | None:
        """Where a call object that did not start with "name" ends (None while it is incomplete)."""
        text = self._buffer.lstrip()
        try:
            _, end = json.JSONDecoder().raw_decode(text)
        except ValueError:
            close = self._buffer.find(HERMES_CLOSE) if self.fmt == ToolCallFormat.HERMES else -1
            return close if close >= 0 else None
        return end + (len(self._buffer) - len(text))

    def _whole_call_or_content(self, body: str) -> list[dict[str, Any]]:
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        key = ARGUMENTS_KEY[self.fmt]
        if isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(
                value.get(key, value.get("arguments")), dict):
            call = ToolCall(name=value["name"], arguments=json.dumps(value.get(key, value.get("arguments"))))
            self.calls.append(call)
            return [{"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": call.arguments}}]}]
        prefix = HERMES_OPEN if self.fmt == ToolCallFormat.HERMES else ""
        return [{"content": prefix + body}]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _merged(deltas: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent content deltas joined (one piece of text in, at most one content delta out)."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if out and "content" in delta and "content" in out[-1]:
            out[-1] = {"content": out[-1]["content"] + delta["content"]}
        else:
            out.append(delta)
    return out


def _marked_formats() -> set[str]:
    from .tool_formats import FORMATS

    return set(FORMATS)


def tool_call_stream(fmt: ToolCallFormat) -> Any:
    """The incremental parser for ``fmt``: ``feed`` / ``finish`` giving OpenAI deltas, ``calls``."""
    if fmt == ToolCallFormat.QWEN3_CODER:
        from .tool_formats import XmlCallStream

        return XmlCallStream()
    if fmt.value in _marked_formats():
        from .tool_formats import FORMATS, MarkedCallStream

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
