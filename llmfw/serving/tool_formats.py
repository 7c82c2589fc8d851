"""Tool-call formats whose calls sit between the family's own markers, around a JSON arguments object:

* ``mistral`` — Mistral Small 3.2 / Devstral / Ministral: ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}``
  (``[CALL_ID]id`` before ``[ARGS]`` allowed);
* ``mistral_nemo`` — Mistral Nemo: ``[TOOL_CALLS][{"name": "get_weather", "arguments": {...}}, ...]``;
* ``deepseek_r1`` — DeepSeek V3 / R1 and its distills: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>
  get_weather`` + a fenced ``json`` block + ``<｜tool▁call▁end｜><｜tool▁calls▁end｜>``;
* ``deepseek_v31`` — DeepSeek V3.1: ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``;
* ``harmony`` — gpt-oss: ``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>``;
* ``qwen3_coder`` — Qwen3-Coder: ``<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n
  </function>\n</tool_call>`` (:class:`XmlCallStream`, :func:`xml_call_grammar`).

Each format is a :class:`MarkedFormat`: the marker that may begin a call, a regular expression for the call's
head (which names the function), the arguments as a JSON value (followed character by character, so they stream
as they arrive), and the text that closes the call. :class:`MarkedCallStream` has the interface of
:class:`llmfw.serving.tool_call_base.ToolCallStream` (``feed`` / ``finish`` / ``calls``, OpenAI ``delta`` objects out);
:func:`marked_call_grammar` forces a call in the family's own format.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .tool_call_base import ArgumentsScanner, ToolCall, ToolCallStream, merged_deltas

#: how far past a call's marker the head may still be arriving before the marker is taken as plain text
MAX_HEAD_CHARS = 256


@dataclass(frozen=True)
class MarkedFormat:
    name: str
    #: literal text that may begin a call (content before it is emitted, a partial marker held back)
    marker: str
    #: matched at the marker: group "name" is the function
    head: re.Pattern[str]
    #: skipped after the arguments (the rest of the call), a literal
    tail: str
    #: text that may follow the last call and is dropped (a section's closer)
    section_end: str = ""
    #: Lark pieces to force a call of ``name`` with ``args`` (a rule name): before and after the arguments
    forced_prefix: str = ""
    forced_suffix: str = ""
    #: another call may follow directly after ``next_call`` (Mistral Nemo's JSON array)
    next_call: str = ""


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

FORMATS: dict[str, MarkedFormat] = {f.name: f for f in (
    MarkedFormat("mistral", "[TOOL_CALLS]",
                 re.compile(r"\[TOOL_CALLS\]\s*(?P<name>[^\[\s]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]"), "",
                 forced_prefix='"[TOOL_CALLS]" {name} "[ARGS]"'),
    MarkedFormat("mistral_nemo", "[TOOL_CALLS]",
                 re.compile(r'(?:\[TOOL_CALLS\]\s*\[|\s*,)\s*\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,'
                            r'\s*"arguments"\s*:\s*'), "}", section_end="]", next_call=",",
                 forced_prefix='"[TOOL_CALLS][{\\"name\\": \\"" {bare} "\\", \\"arguments\\": "',
                 forced_suffix='", \\"id\\": \\"" /[a-zA-Z0-9]{9}/ "\\"}]"'),  # Nemo writes a 9-character id
    MarkedFormat("deepseek_r1", DS_CALL_BEGIN,
                 re.compile(re.escape(DS_CALL_BEGIN + "function" + DS_SEP) + r"(?P<name>[^\n]+)\n```json\n"),
                 "```" + DS_CALL_END, section_end=DS_CALLS_END,
                 forced_prefix=f'"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}" {{name}} "\\n```json\\n"',
                 forced_suffix=f'"\\n```{DS_CALL_END}{DS_CALLS_END}"'),
    MarkedFormat("deepseek_v31", DS_CALL_BEGIN,
                 re.compile(re.escape(DS_CALL_BEGIN) + r"(?P<name>[^<\n]+?)" + re.escape(DS_SEP)), DS_CALL_END,
                 section_end=DS_CALLS_END,
                 forced_prefix=f'"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}" {{name}} "{DS_SEP}"',
                 forced_suffix=f'"{DS_CALL_END}{DS_CALLS_END}"'),
    MarkedFormat("harmony", "to=functions.",
                 re.compile(r"to=functions\.(?P<name>[\w.\-]+)(?:(?!<\|message\|>)[^\n])*<\|message\|>"), "<|call|>",
                 forced_prefix='"<|channel|>commentary to=functions." {name} " <|constrain|>json<|message|>"',
                 forced_suffix='"<|call|>"'),
)}


def detect_marked_format(template: str) -> MarkedFormat | None:
    """The marked format a chat template teaches (None: none of these)."""
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"] if "[ARGS]" in template else FORMATS["mistral_nemo"]
    if "tool▁call▁begin" in template:
        return FORMATS["deepseek_r1"] if "```json" in template else FORMATS["deepseek_v31"]
    if "to=functions." in template or '"functions." + tool_call.name' in template:
        return FORMATS["harmony"]
    return None


class MarkedCallStream(ToolCallStream):
    """Incremental parser of a reply in a :class:`MarkedFormat`: ``ToolCallStream``'s interface and its
    arguments state (the JSON value followed character by character); its own states around them."""

    def __init__(self, fmt: MarkedFormat):  # not ToolCallStream's format enum
        self.marked = fmt
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._state = "text"
        self._scanner: ArgumentsScanner | None = None

    def finish(self) -> list[dict[str, Any]]:
        rest, self._buffer = self._buffer, ""
        deltas = [{"content": rest}] if rest and self._state in ("text", "head") else []
        self._state = "done"
        return merged_deltas(deltas)

    # -- states (the arguments state is ToolCallStream's; it moves on to "after_call") -------------------------
    def _step_text(self) -> list[dict[str, Any]]:
        at = self._buffer.find(self.marked.marker)
        if at >= 0:
            content, self._buffer = self._buffer[:at], self._buffer[at:]
            self._state = "head"
            return [{"content": content}] if content else []
        return self._text_before(self.marked.marker)

    def _step_head(self) -> list[dict[str, Any]]:
        head = self.marked.head.match(self._buffer)
        if head is None:
            if len(self._buffer) > MAX_HEAD_CHARS:  # never became a call: it was text
                marker = self.marked.marker
                content, self._buffer = self._buffer[:len(marker)], self._buffer[len(marker):]
                self._state = "text"
                return [{"content": content}]
            return []
        self._buffer = self._buffer[head.end():]
        return self._start_arguments(head.group("name").strip())

    def _step_after_call(self) -> list[dict[str, Any]]:
        if self.marked.tail:
            return self._skip_past(self.marked.tail, "between")
        self._state = "between"
        return []

    def _step_between(self) -> list[dict[str, Any]]:
        """After a call: the next call of an array, the section's closer (dropped), or text again."""
        text = self._buffer.lstrip()
        if not text:
            return []
        fmt = self.marked
        if fmt.next_call and text.startswith(fmt.next_call):
            self._buffer, self._state = text, "head"
            return []
        if fmt.section_end and fmt.section_end.startswith(text) and text != fmt.section_end:
            return []  # the closer may be arriving
        if fmt.section_end and text.startswith(fmt.section_end):
            text = text[len(fmt.section_end):]
        self._buffer, self._state = text, "text"
        return []


def marked_call_grammar(fmt: MarkedFormat, tools_params: Mapping[str, Mapping[str, Any]], names: Sequence[str],
                        schema_text: Any) -> str:
    """A Lark grammar forcing one call of one of ``names`` in ``fmt``'s own text (``tools_params``: name ->
    parameters schema; ``schema_text`` checks and writes a schema)."""
    rules, options = [], []
    for i, name in enumerate(names):
        rules.append(f"args_{i}: %json {schema_text(dict(tools_params[name]))}")
        prefix = fmt.forced_prefix.replace("{name}", json.dumps(name)).replace(
            "{bare}", json.dumps(json.dumps(name)[1:-1]))
        options.append(f"{prefix} args_{i} {fmt.forced_suffix}".strip())
    return "%llguidance {}\nstart: " + " | ".join(options) + "\n" + "\n".join(rules) + "\n"


__all__ = ["FORMATS", "MarkedCallStream", "MarkedFormat", "detect_marked_format", "marked_call_grammar"]


# ---------------------------------------------------------------------------------------------------------------
# Qwen3-Coder: XML-like calls whose parameter values are raw text
# ---------------------------------------------------------------------------------------------------------------
XML_CALL_OPEN, XML_CALL_CLOSE = "<tool_call>", "</tool_call>"
_XML_FUNCTION = re.compile(r"\s*<function=(?P<name>[^>\n]+)>\s*")
_XML_PARAMETER = re.compile(r"\s*<parameter=(?P<key>[^>\n]+)>")
XML_PARAMETER_CLOSE = "</parameter>"


def is_xml_call_template(template: str) -> bool:
    """Qwen3-Coder's template: ``<function=NAME>`` with ``<parameter=KEY>`` lines inside ``<tool_call>``."""
    return "<function=" in template and "<parameter=" in template


def xml_value_json(text: str) -> str:
    """A parameter's raw text (all between ``<parameter=KEY>`` and ``</parameter>``) as JSON: the newline the
    template writes after the tag and the one before the close are not the value's (stripped here, once the whole
    value is in, so a stream cut right after the tag gives the same value). The template writes objects, arrays,
    numbers and booleans as JSON and strings as they are, so text that parses as a non-string JSON value is that
    value, anything else a string."""
    value = text[1:] if text.startswith("\n") else text
    value = value[:-1] if value.endswith("\n") else value
    try:
        parsed = json.loads(value)
    except ValueError:
        return json.dumps(value, ensure_ascii=False)
    return value.strip() if not isinstance(parsed, str) else json.dumps(value, ensure_ascii=False)


class XmlCallStream(ToolCallStream):
    """Qwen3-Coder's calls, turned into OpenAI deltas: the call starts at ``<function=NAME>``; each parameter's
    ``"KEY": VALUE`` piece of the arguments object is sent when its ``</parameter>`` arrives (the value's JSON
    type is known only then); ``}`` at ``</function>``."""

    def __init__(self) -> None:  # no format enum: one format
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._state = "text"
        self._scanner = None
        self._n_params = 0
        self._key = ""  # the parameter whose value is arriving

    def finish(self) -> list[dict[str, Any]]:
        rest, self._buffer = self._buffer, ""
        deltas = [{"content": rest}] if rest and self._state == "text" else []
        if self._state in ("params", "value") and self.calls:  # cut short inside a call: close its object
            deltas.append(self._arguments("}"))
        self._state = "done"
        return merged_deltas(deltas)

    def _arguments(self, fragment: str) -> dict[str, Any]:
        self.calls[-1].arguments += fragment
        return {"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": fragment}}]}

    def _step_text(self) -> list[dict[str, Any]]:
        return self._text_until(XML_CALL_OPEN, "function")

    def _step_function(self) -> list[dict[str, Any]]:
        head = _XML_FUNCTION.match(self._buffer)
        if head is None:
            return []
        self._buffer, self._state, self._n_params = self._buffer[head.end():], "params", 0
        return self._new_call(head.group("name").strip())

    def _step_params(self) -> list[dict[str, Any]]:
        parameter = _XML_PARAMETER.match(self._buffer)
        if parameter is not None:
            self._key = parameter.group("key").strip()
            self._buffer, self._state = self._buffer[parameter.end():], "value"
            return []
        text = self._buffer.lstrip()
        if text.startswith("</function>"):
            end = text.find(XML_CALL_CLOSE)
            if end < 0:
                return []
            self._buffer, self._state = text[end + len(XML_CALL_CLOSE):], "text"
            return [self._arguments("{}" if self._n_params == 0 else "}")]
        return []

    def _step_value(self) -> list[dict[str, Any]]:
        end = self._buffer.find(XML_PARAMETER_CLOSE)
        if end < 0:
            return []
        value, self._buffer = self._buffer[:end], self._buffer[end + len(XML_PARAMETER_CLOSE):]
        opener = "{" if self._n_params == 0 else ", "
        self._n_params += 1
        self._state = "params"
        return [self._arguments(f"{opener}{json.dumps(self._key)}: {xml_value_json(value)}")]


def xml_call_grammar(tools_params: Mapping[str, Mapping[str, Any]], names: Sequence[str], schema_text: Any) -> str:
    """A Lark grammar forcing one Qwen3-Coder call of one of ``names``: its required parameters in order, each a
    raw line of text (strings) or JSON (other types)."""
    rules, options = ["text_value: /[^<\\n]{1,200}/"], []
    for i, name in enumerate(names):
        params = tools_params[name]
        properties = params.get("properties") or {}
        items = []
        for j, key in enumerate(params.get("required") or []):
            sub = properties.get(key, {})
            value = "text_value" if sub.get("type", "string") == "string" else f"v_{i}_{j}"
            if value != "text_value":
                rules.append(f"v_{i}_{j}: %json {schema_text(dict(sub))}")
            items.append(f'"<parameter={key}>\\n" {value} "\\n</parameter>\\n"')
        options.append(f'"<tool_call>\\n<function={name}>\\n" {" ".join(items)} "</function>\\n</tool_call>"')
    return "%llguidance {}\nstart: " + " | ".join(options) + "\n" + "\n".join(rules) + "\n"
