"""Tool-call ids of earlier turns, as Mistral's chat templates take them.

Mistral's templates (Mistral Nemo, Mistral Small 3.x: the family that writes ``[TOOL_CALLS]``) render each earlier
call's id and each tool result's ``tool_call_id`` and raise unless it is exactly 9 characters (Mistral's own
tokenizer library wants ``[a-zA-Z0-9]{9}``). Clients send back whatever ids they were given: OpenAI's
``call_...``, Anthropic's ``toolu_...``, ours, or none at all. llama-server hands them to the template as they
are (so such a conversation fails there); llmfw renders every id that is not already 9 alphanumeric characters
as 9 alphanumeric characters derived from it, the same for a call and the result that answers it, and the same
on every request (so a conversation's prompt prefix stays the same from turn to turn and the prompt cache
keeps working). A result without a ``tool_call_id`` answers the next unanswered call of the assistant turn
before it, in order; a call without an id gets one from its position in the conversation.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any

MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def needs_mistral_ids(template: str) -> bool:
    """Whether ``template`` is one of Mistral's (its tool calls written after ``[TOOL_CALLS]``)."""
    return "[TOOL_CALLS]" in template


def mistral_id(original: str, salt: int = 0) -> str:
    """9 alphanumeric characters for an id: itself when it already is such, else derived from its text."""
    if salt == 0 and MISTRAL_ID.fullmatch(original):
        return original
    number = int.from_bytes(hashlib.sha256(f"{salt}:{original}".encode()).digest()[:8], "big")
    chars = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHABET))
        chars.append(_ALPHABET[digit])
    return "".join(chars)


class _IdMap:
    """Original id -> Mistral id, one to one within a conversation."""

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}
        self._taken: set[str] = set()

    def __call__(self, original: str) -> str:
        if original not in self._ids:
            salt = 0
            while (candidate := mistral_id(original, salt)) in self._taken:
                salt += 1  # two ids mapped to one: derive another for the newcomer
            self._ids[original] = candidate
            self._taken.add(candidate)
        return self._ids[original]


def with_mistral_tool_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` (the template's shape: ``tool_calls`` entries with ``id``, ``tool`` messages with
    ``tool_call_id``) with every id as 9 alphanumeric characters; the input is not changed."""
    ids = _IdMap()
    pending: list[str] = []  # ids of the last assistant turn's calls not yet answered, in order
    out = []
    for position, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for index, call in enumerate(message["tool_calls"]):
                given = call.get("id")
                original = given if isinstance(given, str) and given else f"\0call {position}.{index}"
                calls.append({**call, "id": ids(original)})
            message["tool_calls"] = calls
            pending = [call["id"] for call in calls]
        elif message.get("role") == "tool":
            given = message.get("tool_call_id")
            if isinstance(given, str) and given:
                message["tool_call_id"] = ids(given)
            else:
                message["tool_call_id"] = pending[0] if pending else ids(f"\0result {position}")
            if message["tool_call_id"] in pending:
                pending.remove(message["tool_call_id"])
        out.append(message)
    return out
