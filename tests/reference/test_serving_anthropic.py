"""Anthropic's Messages API on `llmfw serve` (issue "agent-ready serving", item 1): a real uvicorn server on
127.0.0.1 driven by the real `anthropic` client and httpx, SmolLM2 on the numpy backend. Tool calls are made
with llama.cpp's copy of the Qwen 2.5 template (Hermes ``<tool_call>``), thinking with the DeepSeek-R1 template
and a grammar that makes the model write its thinking (llama-server's ``grammar`` extension)."""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest

from llmfw.core.chat import apply_chat_template
from support.live_server import TIMEOUT, post, serve_engine

TEMPLATES = Path(__file__).parents[1] / "data" / "tool_templates"
QWEN25 = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
R1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
KEY = "anthropic-test-key"
HI = [{"role": "user", "content": "Say hello."}]
#: Anthropic's 2026 SDK dropped the sampling arguments; the API (and this server) still read them
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def model(shared_models):
    return shared_models.get("smollm2", "numpy")


def serve(model, template, api_key=None):
    yield from serve_engine(model, api_key, parallel=2, n_ctx=2048, alias="smol", chat_template=template)


@pytest.fixture(scope="module")
def plain(model):
    """SmolLM2's own template, an API key."""
    yield from serve(model, None, KEY)


@pytest.fixture(scope="module")
def tools_server(model):
    yield from serve(model, QWEN25)


@pytest.fixture(scope="module")
def thinking_server(model):
    yield from serve(model, R1)


def client_for(live, key=KEY):
    return anthropic.Anthropic(base_url=live.url, api_key=key, max_retries=0, timeout=TIMEOUT)


# -- messages ---------------------------------------------------------------------------------------------------------
def test_message_shape_usage_and_count_tokens(plain, model):
    client = client_for(plain)
    reply = client.messages.create(model="smol", max_tokens=8, system="You are terse.", messages=HI, extra_body=GREEDY,
                                   metadata={"user_id": "u1"})
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "smol"
    assert reply.id.startswith("msg_") and reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    rendered = apply_chat_template(model, [{"role": "system", "content": "You are terse."}, *HI])
    n_prompt = len(model.vocab.tokenize(rendered, add_special=True, parse_special=True))
    assert reply.usage.input_tokens == n_prompt and 0 < reply.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model="smol", system="You are terse.", messages=HI)
    assert counted.input_tokens == n_prompt


def test_stream_events_match_the_whole_reply(plain):
    client = client_for(plain)
    kwargs = dict(model="smol", max_tokens=10, messages=HI, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    text_deltas = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert len(text_deltas) > 1  # as tokens arrive
    assert "".join(text_deltas) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_report_which_one_stopped(plain):
    client = client_for(plain)
    free = client.messages.create(model="smol", max_tokens=12, messages=HI, extra_body=GREEDY).content[0].text
    word = free.split()[1]
    stopped = client.messages.create(model="smol", max_tokens=12, messages=HI, extra_body=GREEDY,
                                     stop_sequences=["zzzz", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


# -- tools -------------------------------------------------------------------------------------------------------------
def test_forced_tool_use_whole_streamed_and_answered(tools_server):
    client = client_for(tools_server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model="smol", max_tokens=80, messages=ask, tools=[WEATHER],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  extra_body=GREEDY)
    reply = client.messages.create(**kwargs)
    [use] = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and use.name == "get_weather" and set(use.input) == {"city"}
    assert use.id.startswith("toolu_")
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = [e.delta.partial_json for e in events
               if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(partial) > 1 and json.loads("".join(partial)) == use.input  # arguments as they arrive
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]
    answered = client.messages.create(model="smol", max_tokens=6, extra_body=GREEDY, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                  "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]}])
    assert answered.content and answered.usage.input_tokens > reply.usage.input_tokens


def test_named_tool_choice(tools_server):
    reply = client_for(tools_server).messages.create(
        model="smol", max_tokens=80, extra_body=GREEDY, messages=[{"role": "user", "content": "Hi"}],
        tools=[WEATHER, {"name": "noop", "input_schema": {"type": "object", "properties": {}}}],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert [b.name for b in reply.content if b.type == "tool_use"] == ["get_weather"]


# -- thinking ----------------------------------------------------------------------------------------------------------
def test_thinking_blocks_whole_and_streamed(thinking_server):
    client = client_for(thinking_server)
    kwargs = dict(model="smol", max_tokens=60, messages=HI,
                  thinking={"type": "enabled", "budget_tokens": 1024},
                  extra_body={**GREEDY, "grammar": 'root ::= [a-z ]{1,24} "</think>" [A-Za-z ]{1,12}'})
    reply = client.messages.create(**kwargs)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking and "</think>" not in reply.content[1].text
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
    thoughts = [e.delta.thinking for e in events if e.type == "content_block_delta"
                and e.delta.type == "thinking_delta"]
    assert "".join(thoughts).strip() == reply.content[0].thinking
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]


def test_count_tokens_includes_system_tools_and_thinking(thinking_server):
    client = client_for(thinking_server)
    base = client.messages.count_tokens(model="smol", messages=HI).input_tokens
    assert client.messages.count_tokens(model="smol", messages=HI, system="Be brief.").input_tokens > base
    on = client.messages.count_tokens(model="smol", messages=HI, thinking={"type": "enabled", "budget_tokens": 64})
    off = client.messages.count_tokens(model="smol", messages=HI, thinking={"type": "disabled"})
    assert on.input_tokens != off.input_tokens  # R1's template closes the thinking in the prompt when off
    reply = client.messages.create(model="smol", max_tokens=1, messages=HI, thinking={"type": "disabled"})
    assert reply.usage.input_tokens == off.input_tokens


# -- errors and auth ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"messages": HI}),  # no max_tokens
    ("/v1/messages", {"max_tokens": 5, "messages": []}),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
    ("/v1/messages", {"max_tokens": 5, "messages": HI, "temperature": 3}),
    ("/v1/messages", {"max_tokens": 5, "messages": HI, "tools": [WEATHER], "tool_choice": {"type": "tool"}}),
    ("/v1/messages", {"max_tokens": 5, "messages": HI, "tool_choice": {"type": "any"}}),
    ("/v1/messages", {"max_tokens": 5, "messages": HI, "grammar": "root ::= ("}),
    ("/v1/messages/count_tokens", {"messages": "hello"}),
    ("/v1/messages/count_tokens", [1, 2]),
])
def test_bad_requests_answer_in_anthropics_error_shape(plain, path, body):
    response = post(plain.url + path, json=body, headers={"x-api-key": KEY})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"]


def test_bad_json_and_sdk_errors(plain):
    bad = httpx.post(plain.url + "/v1/messages", content=b"{nope", headers={"x-api-key": KEY}, timeout=TIMEOUT)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client_for(plain).messages.create(model="smol", max_tokens=0, messages=HI)
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_x_api_key_and_bearer(plain):
    assert client_for(plain).messages.count_tokens(model="smol", messages=HI).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client_for(plain, key="wrong").messages.count_tokens(model="smol", messages=HI)
    assert caught.value.body["error"]["type"] == "authentication_error"
    bearer = post(plain.url + "/v1/messages/count_tokens", json={"messages": HI},
                  headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200
    openai_side = post(plain.url + "/v1/models".replace("/v1/models", "/v1/completions"),
                       json={"prompt": "x", "max_tokens": 1}, headers={"x-api-key": KEY})
    assert openai_side.status_code == 200  # x-api-key works on every protected path


def test_tools_offered_to_a_template_without_tools_are_warned_about(plain):
    """SmolLM2's own template shows no tools: the message says so (and names the tool and the template)."""
    reply = client_for(plain).messages.create(model="smol", max_tokens=2, messages=HI, tools=[WEATHER],
                                              extra_body=GREEDY)
    [warning] = reply.model_extra["warnings"]
    assert "get_weather" in warning and "tokenizer.chat_template" in warning
