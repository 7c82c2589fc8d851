"""Tool-calling helpers: the call format from real chat templates, the grammar that forces a call (and a real
model sampling under it), and parsing replies into OpenAI ``tool_calls`` — whole and streamed piece by piece."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

import llmfw
from llmfw.core.errors import GrammarError
from llmfw.core.generate import GenerationStats, generate
from llmfw.core.grammar import GrammarSpec, check_text_matches
from llmfw.core.sampling import SamplerChain, SamplerParams
from llmfw.core.tool_calls import (ToolCallFormat, ToolCallStream, detect_tool_call_format, parse_tool_calls,
                                   tool_call_grammar)

TEMPLATES = Path(__file__).parents[1] / "data" / "tool_templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("name, fmt", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", ToolCallFormat.HERMES),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", ToolCallFormat.HERMES),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", ToolCallFormat.LLAMA3_JSON),
    ("google-gemma-2-2b-it.jinja", None),
])
def test_format_is_recognised_from_the_template(name, fmt):
    assert detect_tool_call_format((TEMPLATES / name).read_text(encoding="utf-8")) == fmt


def test_no_template_no_format():
    assert detect_tool_call_format(None) is None and detect_tool_call_format("") is None


# -- grammars -------------------------------------------------------------------------------------------------
def test_auto_and_none_force_nothing():
    assert tool_call_grammar([WEATHER], "auto", ToolCallFormat.HERMES) is None
    assert tool_call_grammar([WEATHER], "none", ToolCallFormat.HERMES) is None
    assert tool_call_grammar([WEATHER], None, ToolCallFormat.HERMES) is None


def test_required_grammar_accepts_calls_of_the_tools_only(smollm2_vocab):
    grammar = tool_call_grammar([WEATHER, TIME], "required", ToolCallFormat.HERMES)
    spec = GrammarSpec.from_grammar(grammar)
    assert spec.kind == "lark"
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    second = '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert check_text_matches(spec, smollm2_vocab, good)
    assert not check_text_matches(spec, smollm2_vocab, good + second)  # one call unless parallel
    parallel = GrammarSpec.from_grammar(tool_call_grammar([WEATHER, TIME], "required", ToolCallFormat.HERMES,
                                                          parallel=True))
    assert check_text_matches(parallel, smollm2_vocab, good + second)
    assert not check_text_matches(spec, smollm2_vocab, good.replace("get_weather", "get_wind"))
    assert not check_text_matches(spec, smollm2_vocab, good.replace('"unit": "c"', '"unit": "k"'))
    assert not check_text_matches(spec, smollm2_vocab, "Sure! " + good)


def test_named_function_grammar_in_llama3_format(smollm2_vocab):
    grammar = tool_call_grammar([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                                ToolCallFormat.LLAMA3_JSON)
    spec = GrammarSpec.from_grammar(grammar)
    assert check_text_matches(spec, smollm2_vocab, '{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert not check_text_matches(spec, smollm2_vocab,
                                  '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}')


@pytest.mark.parametrize("tools, choice, words", [
    ([], "required", "at least one tool"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([{"type": "function", "function": {"parameters": {}}}], "required", "name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "required",
     "Invalid type"),
])
def test_bad_tools_or_choice_raise_grammar_error(tools, choice, words):
    with pytest.raises(GrammarError, match=words):
        grammar = tool_call_grammar(tools, choice, ToolCallFormat.HERMES)
        SamplerParams(grammar=grammar)


# -- parsing ----------------------------------------------------------------------------------------------------
HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "a \\"b\\" }"}}\n</tool_call>')


def test_parse_hermes_calls():
    content, calls = parse_tool_calls(HERMES_REPLY, ToolCallFormat.HERMES)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "c"}
    assert json.loads(calls[1].arguments) == {"zone": 'a "b" }'}
    openai = calls[0].to_openai()
    assert openai["type"] == "function" and openai["id"].startswith("call_") and openai["id"] != calls[1].id
    assert openai["function"] == {"name": "get_weather", "arguments": calls[0].arguments}


def test_parse_llama3_json_call_and_plain_text():
    content, calls = parse_tool_calls('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
                                      ToolCallFormat.LLAMA3_JSON)
    assert content == "" and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": "UTC"}
    content, calls = parse_tool_calls("It is sunny.", ToolCallFormat.LLAMA3_JSON)
    assert content == "It is sunny." and calls == []


def test_parse_keys_in_another_order_and_broken_calls():
    content, calls = parse_tool_calls('<tool_call>{"arguments": {"zone": "X"}, "name": "get_time"}</tool_call>',
                                      ToolCallFormat.HERMES)
    assert calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": "X"}
    content, calls = parse_tool_calls("<tool_call>not json</tool_call> ok", ToolCallFormat.HERMES)
    assert calls == [] and "not json" in content
    assert parse_tool_calls("no format", None) == ("no format", [])


def _stream(text: str, fmt: ToolCallFormat, size: int):
    stream = ToolCallStream(fmt)
    deltas = []
    for i in range(0, len(text), size):
        deltas += stream.feed(text[i:i + size])
    return deltas + stream.finish(), stream


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_deltas_rebuild_the_calls(size):
    deltas, stream = _stream(HERMES_REPLY, ToolCallFormat.HERMES, size)
    content = "".join(d.get("content", "") for d in deltas)
    assert content.strip() == "Let me check." and "<tool" not in content
    rebuilt: dict[int, dict] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            entry = rebuilt.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
            if "id" in call:  # the first delta of a call names it, like OpenAI's stream
                assert call["type"] == "function" and call["function"]["name"]
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"].get("arguments", "")
    assert [rebuilt[i]["name"] for i in sorted(rebuilt)] == ["get_weather", "get_time"]
    assert [json.loads(rebuilt[i]["arguments"]) for i in sorted(rebuilt)] == [
        {"city": "Oslo", "unit": "c"}, {"zone": 'a "b" }'}]
    assert [c.id for c in stream.calls] == [rebuilt[i]["id"] for i in sorted(rebuilt)]
    if size == 1:  # arguments arrive in several fragments, not in one piece at the end
        assert sum(1 for d in deltas for c in d.get("tool_calls", []) if "id" not in c) > 5


def test_stream_holds_back_only_a_possible_tag():
    stream = ToolCallStream(ToolCallFormat.HERMES)
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]
    assert stream.feed("box>") == [{"content": "<toolbox>"}]


# -- a real model under the grammar -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_vocab(shared_models):
    return shared_models.get("smollm2", vocab_only=True).vocab


def test_forced_call_from_a_real_model_parses_and_validates(smollm2_path):
    tools = [WEATHER, TIME]
    with llmfw.load_model(smollm2_path) as model:
        grammar = tool_call_grammar(tools, "required", ToolCallFormat.HERMES, vocab=model.vocab)
        ctx = model.new_context(n_ctx=512)
        prompt = model.apply_chat_template([{"role": "user", "content": "What's the weather in Paris?"}])
        stats = GenerationStats()
        chain = SamplerChain.from_params(SamplerParams(grammar=grammar, temp=1.0, seed=11), model=model)
        text = "".join(generate(ctx, prompt, chain, max_tokens=64, stats=stats))
    assert stats.stop_reason == "eog", text
    content, calls = parse_tool_calls(text, ToolCallFormat.HERMES)
    assert content == "" and len(calls) >= 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_tools_reach_the_template_as_transformers_passes_them():
    from llmfw.core.chat import render_chat_template

    template = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    prompt = render_chat_template(template, [{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER])
    assert "get_weather" in prompt and "<tool_call>" in prompt
