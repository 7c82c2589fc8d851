"""Mistral's chat templates raise unless every earlier tool-call id is 9 characters (issue "agent-ready serving"):
the ids clients send back (OpenAI's ``call_...``, Anthropic's ``toolu_...``, none) are rendered as 9 alphanumerics,
a call and its result alike, through llama.cpp's copies of the real templates (tests/data/tool_templates/)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmfw.core.chat import render_chat_template
from llmfw.core.errors import ChatTemplateError
from llmfw.serving.tool_call_ids import mistral_id, needs_mistral_ids, with_mistral_tool_call_ids

TEMPLATES = Path(__file__).parents[1] / "data" / "tool_templates"
MISTRAL = ["Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Mistral-Nemo-Instruct-2407"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def call(call_id, city):
    out = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
    return out if call_id is None else {**out, "id": call_id}


def conversation():
    """Three tool turns: OpenAI's ids (two parallel calls, answered out of order), Anthropic's, then none."""
    return [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("call_9f8e7d6c5b4a39281706", "Paris"),
                                                            call("call_0a1b2c3d4e5f60718293", "Oslo")]},
        {"role": "tool", "tool_call_id": "call_0a1b2c3d4e5f60718293", "content": "snow"},
        {"role": "tool", "tool_call_id": "call_9f8e7d6c5b4a39281706", "content": "sunny"},
        {"role": "assistant", "content": "Sunny in Paris, snow in Oslo."},
        {"role": "user", "content": "And Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call("toolu_01A09q90qw90lq917835lq9", "Rome")]},
        {"role": "tool", "tool_call_id": "toolu_01A09q90qw90lq917835lq9", "content": "rain"},
        {"role": "assistant", "content": "Rain in Rome."},
        {"role": "user", "content": "And Lima?"},
        {"role": "assistant", "content": "", "tool_calls": [call(None, "Lima")]},
        {"role": "tool", "content": "fog"},
    ]


def render(name, messages):
    return render_chat_template((TEMPLATES / f"{name}.jinja").read_text(), messages, add_generation_prompt=True,
                                tools=TOOLS, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("name", MISTRAL)
def test_the_real_template_refuses_clients_ids_as_they_come(name):
    with pytest.raises(ChatTemplateError, match="length 9"):
        render(name, conversation())


@pytest.mark.parametrize("name", MISTRAL)
def test_a_multi_turn_tool_conversation_renders_with_9_character_ids(name):
    text = render(name, with_mistral_tool_call_ids(conversation()))
    if "[CALL_ID]" in text:  # Small 3.2: [CALL_ID]id ... [TOOL_RESULTS]id[TOOL_CONTENT]
        calls = re.findall(r"\[CALL_ID\](\w+)\[ARGS\]\{\"city\": \"(\w+)\"\}", text)
        results = re.findall(r"\[TOOL_RESULTS\](\w+)\[TOOL_CONTENT\](\w+)", text)
    else:  # Nemo: ..., "id": "id"} ... [TOOL_RESULTS]{"content": ..., "call_id": "id"}
        calls = re.findall(r'"arguments": \{"city": "(\w+)"\}, "id": "(\w+)"', text)
        calls = [(i, city) for city, i in calls]
        results = [(i, c) for c, i in re.findall(r'"content": (\w+), "call_id": "(\w+)"', text)]
    assert [city for _, city in calls] == ["Paris", "Oslo", "Rome", "Lima"]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i, _ in calls + results)
    city_of = {i: city for i, city in calls}
    assert len(city_of) == 4  # distinct ids
    answered = {city_of[i]: weather for i, weather in results}
    assert answered == {"Paris": "sunny", "Oslo": "snow", "Rome": "rain", "Lima": "fog"}


def test_ids_are_stable_and_valid_ones_are_kept():
    first, again = with_mistral_tool_call_ids(conversation()), with_mistral_tool_call_ids(conversation())
    assert first == again  # the same prompt on every turn (the prompt cache keeps the prefix)
    assert mistral_id("abcDEF123") == "abcDEF123"
    assert mistral_id("call_x") != mistral_id("call_y")
    assert conversation()[1]["tool_calls"][0]["id"] == "call_9f8e7d6c5b4a39281706"  # the input is not changed


def test_colliding_ids_get_distinct_replacements():
    # "abcDEF123" is kept as it is; an id whose derived form would be the same must get another
    taken = mistral_id("call_a")
    messages = [{"role": "assistant", "content": "", "tool_calls": [call(taken, "A"), call("call_a", "B")]}]
    ids = [c["id"] for c in with_mistral_tool_call_ids(messages)[0]["tool_calls"]]
    assert ids[0] == taken and ids[1] != taken and re.fullmatch(r"[A-Za-z0-9]{9}", ids[1])


def test_only_mistral_templates_are_rewritten():
    for name in MISTRAL:
        assert needs_mistral_ids((TEMPLATES / f"{name}.jinja").read_text())
    assert not needs_mistral_ids((TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
