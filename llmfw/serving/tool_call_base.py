"""What every tool-call format's parser shares: the formats, a parsed :class:`ToolCall`, the scanner that follows a
JSON arguments value as it streams, and :class:`ToolCallStream`, the incremental parser of the ``hermes`` and
``llama3_json`` formats that the other formats' parsers (:mod:`llmfw.serving.tool_formats`) build on.

:mod:`llmfw.serving.tool_calls` (format detection, grammars, :func:`~llmfw.serving.tool_calls.parse_tool_calls`)
re-exports these names; both it and :mod:`llmfw.serving.tool_formats` import this module, not each other.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable


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
#: the key holding the arguments in each format's call object
ARGUMENTS_KEY = {ToolCallFormat.HERMES: "arguments", ToolCallFormat.LLAMA3_JSON: "parameters"}


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


class ArgumentsScanner:
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
        self._scanner: ArgumentsScanner | None = None

    # -- public ------------------------------------------------------------------------------------------------
    def feed(self, piece: str) -> list[dict[str, Any]]:
        self._buffer += piece
        deltas: list[dict[str, Any]] = []
        while True:
            before = (self._state, len(self._buffer))
            deltas += getattr(self, f"_step_{self._state}")()
            if (self._state, len(self._buffer)) == before:
                return merged_deltas(deltas)

    def finish(self) -> list[dict[str, Any]]:
        """End of the reply: an unfinished call whose JSON is complete is kept; anything else is content."""
        deltas: list[dict[str, Any]] = []
        if self._state in ("text", "start") and self._buffer:
            deltas.append({"content": self._buffer})
        elif self._state == "call_head" and self._buffer.strip():
            deltas += self._whole_call_or_content(self._buffer)
        self._buffer = ""
        self._state = "done"
        return merged_deltas(deltas)

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
        return self._text_until(HERMES_OPEN, "call_head")

    def _text_until(self, tag: str, next_state: str) -> list[dict[str, Any]]:
        """Content up to ``tag`` (blanks alone before it are the call's layout, dropped), then ``next_state`` with
        the buffer past the tag; while the tag has not come, :meth:`_text_before` it."""
        at = self._buffer.find(tag)
        if at >= 0:
            content, self._buffer = self._buffer[:at], self._buffer[at + len(tag):]
            self._state = next_state
            return [{"content": content}] if content.strip() else []
        return self._text_before(tag)

    def _text_before(self, tag: str) -> list[dict[str, Any]]:
        """The buffer (which holds no ``tag``) as content, less a suffix that may be the start of ``tag``: that
        part is held back until the next piece tells."""
        keep = partial_suffix(self._buffer, tag)
        content = self._buffer[:len(self._buffer) - keep]
        self._buffer = self._buffer[len(content):]
        return [{"content": content}] if content else []

    def _step_call_head(self) -> list[dict[str, Any]]:
        head = _CALL_HEAD.match(self._buffer)
        if head:
            self._buffer = self._buffer[head.end():]
            return self._start_arguments(json.loads(f'"{head.group(1)}"'))
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
        return self._skip_past(HERMES_CLOSE, "text")

    def _step_done(self) -> list[dict[str, Any]]:
        return []

    # -- helpers -------------------------------------------------------------------------------------------------
    def _new_call(self, name: str, arguments: str = "") -> list[dict[str, Any]]:
        """A call joins :attr:`calls`: the delta that announces it (its id, name and the arguments known so far)."""
        call = ToolCall(name=name, arguments=arguments)
        self.calls.append(call)
        return [{"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}}]}]

    def _start_arguments(self, name: str) -> list[dict[str, Any]]:
        """A call of ``name`` whose JSON arguments follow in the buffer: on to the arguments state."""
        self._scanner = ArgumentsScanner()
        self._state = "arguments"
        return self._new_call(name)

    def _skip_past(self, tag: str, next_state: str) -> list[dict[str, Any]]:
        """Drop the buffer up to and including ``tag``, then ``next_state``; nothing while the tag has not come."""
        end = self._buffer.find(tag)
        if end >= 0:
            self._buffer = self._buffer[end + len(tag):]
            self._state = next_state
        return []

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
            return self._new_call(value["name"], json.dumps(value.get(key, value.get("arguments"))))
        prefix = HERMES_OPEN if self.fmt == ToolCallFormat.HERMES else ""
        return [{"content": prefix + body}]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def merged_deltas(deltas: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent content deltas joined (one piece of text in, at most one content delta out)."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if out and "content" in delta and "content" in out[-1]:
            out[-1] = {"content": out[-1]["content"] + delta["content"]}
        else:
            out.append(delta)
    return out
