"""Tool calls in each family's own format (issue "agent-ready serving", item 3): Mistral ``[TOOL_CALLS]`` (Small 3.2
and Nemo), DeepSeek R1 / V3.1 tool-call tokens, gpt-oss Harmony ``to=functions.NAME``, Qwen3-Coder's XML.

The scripted model outputs are what llama.cpp's copies of the real templates (tests/data/tool_templates/) write
for an assistant's call: the parser must read back, from pieces of any size, the call the template wrote, with
the arguments streamed as they arrive; the forcing grammar must accept that text; and a real server forces a
call in the Mistral format on SmolLM2, read back through the real `openai` client."""
from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llmfw
from llmfw.core.chat import render_chat_template
from llmfw.core.grammar import GrammarSpec, check_text_matches
from llmfw.core.tool_calls import ToolCallFormat, detect_tool_call_format, parse_tool_calls, tool_call_grammar, \
    tool_call_stream
from llmfw.serving import Engine
from llmfw.serving.app import create_app
from support.live_server import TIMEOUT, LiveServer

TEMPLATES = Path(__file__).parents[1] / "data" / "tool_templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}]
CALL = {"id": "abcDEF123", "type": "function",  # Mistral's templates want 9 alphanumerics
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CASES = {
    "Mistral-Small-3.2-24B-Instruct-2506": (ToolCallFormat.MISTRAL, "[TOOL_CALLS]"),
    "mistralai-Mistral-Nemo-Instruct-2407": (ToolCallFormat.MISTRAL_NEMO, "[TOOL_CALLS]"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (ToolCallFormat.DEEPSEEK_R1, "<｜tool▁calls▁begin｜>"),
    "deepseek-ai-DeepSeek-V3.1": (ToolCallFormat.DEEPSEEK_V31, "<｜tool▁calls▁begin｜>"),
    "openai-gpt-oss-120b": (ToolCallFormat.HARMONY, "<|channel|>"),
    "Qwen3-Coder": (ToolCallFormat.QWEN3_CODER, "<tool_call>"),
}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def written_call(name: str, start: str) -> str:
    """The text the template writes for the assistant's call (from its first marker on), as a model would."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    text = render_chat_template(template(name), messages, add_generation_prompt=False, tools=TOOLS,
                                bos_token="<s>", eos_token="</s>")
    last_user = text.rindex("Paris?")
    at = text.index(start, last_user) if start != "<|channel|>" else text.index("to=functions", last_user)
    if start == "<tool_call>":  # Qwen3-Coder's prompt explains the format first: the call is the last one
        at = text.rindex(start)
    return text[at:]


@pytest.mark.parametrize("name", CASES)
def test_format_is_recognised_from_the_real_template(name):
    assert detect_tool_call_format(template(name)) == CASES[name][0]


@pytest.mark.parametrize("name", CASES)
def test_the_templates_own_call_is_read_back(name):
    fmt, start = CASES[name]
    content, calls = parse_tool_calls(written_call(name, start), fmt)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert "get_weather" not in content and "Paris" not in content


def streamed_call(name: str, cuts: list[int]) -> list[dict]:
    """The deltas of the template's call after some text, fed to the stream in pieces of the given sizes (then the
    rest)."""
    fmt, start = CASES[name]
    text = "Let me check. " + written_call(name, start)
    stream, deltas, at = tool_call_stream(fmt), [], 0
    for size in cuts:
        deltas += stream.feed(text[at:at + size])
        at += size
    return deltas + stream.feed(text[at:]) + stream.finish()


def streamed_arguments(deltas: list[dict]) -> str:
    return "".join(c["function"].get("arguments", "") for delta in deltas for c in delta.get("tool_calls", []))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.lists(st.integers(1, 7), min_size=1, max_size=80))
def test_calls_stream_as_they_arrive_whatever_the_pieces(name, cuts):
    deltas = streamed_call(name, cuts)
    calls = [d for delta in deltas for d in delta.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(streamed_arguments(deltas)) == {"city": "Paris"}
    content = "".join(d.get("content", "") for d in deltas)
    assert content.startswith("Let me check.") and "get_weather" not in content


@pytest.mark.parametrize("name", CASES)
def test_one_cut_anywhere_leaves_the_arguments_as_they_are(name):
    # every place one piece can end, the end of a tag among them (Qwen3-Coder's "<parameter=city>" then "\nParis")
    fmt, start = CASES[name]
    for at in range(len("Let me check. " + written_call(name, start)) + 1):
        assert json.loads(streamed_arguments(streamed_call(name, [at]))) == {"city": "Paris"}, f"cut at {at}"


@pytest.fixture(scope="module")
def vocab(smollm2_path):
    return llmfw.load_model(str(smollm2_path), vocab_only=True).vocab


@pytest.mark.parametrize("name", ["Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Mistral-Nemo-Instruct-2407",
                                  "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-V3.1",
                                  "Qwen3-Coder"])
def test_forcing_grammar_accepts_the_templates_call(name, vocab):
    fmt, start = CASES[name]
    text = written_call(name, start)
    for end in ("</s>", "<｜end▁of▁sentence｜>", "<|im_end|>"):
        text = text.split(end)[0]
    text = re.sub(r"\[CALL_ID\][^\[]*", "", text)  # the id is the server's to give, not the model's to write
    grammar = tool_call_grammar(TOOLS, "required", fmt)
    assert check_text_matches(GrammarSpec.from_grammar(grammar), vocab, text.rstrip())
    assert not check_text_matches(GrammarSpec.from_grammar(grammar), vocab, text.replace("get_weather", "get_time"))


def test_harmony_forcing_grammar_accepts_a_call(vocab):
    grammar = tool_call_grammar(TOOLS, "required", ToolCallFormat.HARMONY)
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    assert check_text_matches(GrammarSpec.from_grammar(grammar), vocab, text)


def test_server_forces_and_streams_a_mistral_call(smollm2_path):
    model = llmfw.load_model(str(smollm2_path), backend="numpy")
    with Engine(model, parallel=1, n_ctx=2048, chat_template=template("Mistral-Small-3.2-24B-Instruct-2506")) as e:
        live = LiveServer(create_app(e))
        try:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
            kwargs = dict(model="smol", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                          tool_choice="required", max_tokens=40, temperature=0)
            whole = client.chat.completions.create(**kwargs).choices[0]
            [call] = whole.message.tool_calls
            assert whole.finish_reason == "tool_calls" and call.function.name == "get_weather"
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            pieces = [tc.function.arguments for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])
                      if tc.function and tc.function.arguments]
            assert len(pieces) > 1 and "".join(pieces) == call.function.arguments
        finally:
            live.stop()


def test_qwen3_coder_values_take_their_json_types():
    """Qwen3-Coder's template writes strings raw and other values as JSON; read back, each has its type."""
    text = ("<tool_call>\n<function=plan>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=zip>\n02139\n</parameter>\n</function>\n"
            "</tool_call>")
    _, [call] = parse_tool_calls(text, ToolCallFormat.QWEN3_CODER)
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3, "tags": ["a", "b"], "zip": "02139"}


def test_a_mistral_tool_conversation_goes_on_with_the_ids_clients_send_back(smollm2_path):
    """Turn 1 forces a call; turn 2 sends it back with its result under the id the server gave (OpenAI) and
    under Anthropic's ``toolu_`` id: Mistral Nemo's real template, which raises on any id but 9 characters,
    renders (Small 3.2's, with the same rule, is rendered in tests/unit/test_mistral_tool_call_ids.py)."""
    import anthropic

    model = llmfw.load_model(str(smollm2_path), backend="numpy")
    with Engine(model, parallel=1, n_ctx=2048, chat_template=template("mistralai-Mistral-Nemo-Instruct-2407")) as engine:
        live = LiveServer(create_app(engine))
        try:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
            ask = {"role": "user", "content": "Weather in Paris?"}
            first = client.chat.completions.create(model="smol", messages=[ask], tools=TOOLS, tool_choice="required",
                                                   max_tokens=40, temperature=0).choices[0].message
            [call] = first.tool_calls
            assert not re.fullmatch(r"[A-Za-z0-9]{9}", call.id)  # the server's own id: Mistral's template refuses it
            history = [ask, first.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
            second = client.chat.completions.create(model="smol", messages=history, tools=TOOLS, max_tokens=3)
            assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")

            claude = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=TIMEOUT)
            reply = claude.messages.create(model="smol", max_tokens=3, tools=[{
                "name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}], messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9",
                                                   "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                                              "content": "sunny"}]}])
            assert reply.type == "message"
        finally:
            live.stop()
