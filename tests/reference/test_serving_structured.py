"""Structured output and tool calling through `llmfw serve`: a real uvicorn server on 127.0.0.1, the real
`openai` client and httpx, SmolLM2 on the numpy backend (greedy tokens independent of batch neighbours).

SmolLM2's own template is ChatML without tools, so the server renders chats with the Qwen 2.5 template
(tests/data/tool_templates/), which teaches the Hermes ``<tool_call>`` format — the server's chat-template
override, as a pipeline's ``chat.template_file`` gives it. Constraints keep every generation short.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from llmfw.core.chat import apply_chat_template
from llmfw.serving import Engine
from llmfw.serving.app import create_app
from support.live_server import TIMEOUT, LiveServer, post

TEMPLATE = (Path(__file__).parents[1] / "data" / "tool_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
OK_PROMPT = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}]
PET = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog", "fish"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "name": {"type": "string", "pattern": "^[A-Za-z]{1,6}$"}},
    "required": ["kind", "age", "name"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model(shared_models):
    return shared_models.get("smollm2", "numpy")


@pytest.fixture(scope="module")
def server(model):
    with Engine(model, parallel=4, n_ctx=4096, alias="smol", chat_template=TEMPLATE) as engine:
        live = LiveServer(create_app(engine, thread_tokens=32))
        yield live
        live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def parameters(tool: dict) -> dict:
    return tool["function"]["parameters"]


# -- response_format, json_schema, grammar -----------------------------------------------------------------------
def test_json_object_output_parses_and_stops_with_the_grammar(client):
    reply = client.chat.completions.create(model="smol", messages=OK_PROMPT, temperature=0, max_tokens=24,
                                           response_format={"type": "json_object"})
    choice = reply.choices[0]
    assert isinstance(json.loads(choice.message.content), dict)
    assert choice.finish_reason == "stop" and reply.usage.completion_tokens < 24


def test_json_schema_outputs_validate_for_several_seeds_at_temperature_1(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    reply = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Describe a pet as JSON."}], temperature=1.0,
        seed=7, n=4, max_tokens=48, response_format=fmt)
    outputs = [c.message.content for c in reply.choices]
    for choice, text in zip(reply.choices, outputs):
        assert choice.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PET)
    assert len(set(outputs)) > 1  # each choice samples with its own seed under its own grammar


def test_llama_server_grammar_and_json_schema_fields_on_completions(client):
    grammar = 'root ::= ("yes" | "no") ", because " [a-z]{1,8} "."'
    answer = client.completions.create(model="smol", prompt="Is the sky blue? Answer:", temperature=1.0, seed=3,
                                       max_tokens=24, extra_body={"grammar": grammar})
    assert re.fullmatch(r"(yes|no), because [a-z]{1,8}\.", answer.choices[0].text)
    assert answer.choices[0].finish_reason == "stop"
    pet = client.completions.create(model="smol", prompt="A pet in JSON:", temperature=0, max_tokens=48,
                                    extra_body={"json_schema": PET})
    jsonschema.validate(json.loads(pet.choices[0].text), PET)


def test_streaming_equals_non_streaming_for_a_constrained_greedy_request(client):
    kw = dict(model="smol", messages=[{"role": "user", "content": "Describe a pet as JSON."}], temperature=0,
              max_tokens=48, extra_body={"json_schema": PET})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), PET)


@pytest.mark.parametrize("path, body, param", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("completions", {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
     "json_schema"),
    ("completions", {"grammar": 'root ::= "a" ('}, "grammar"),
    ("completions", {"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar"),
    ("completions", {"tools": [WEATHER]}, "tools"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ("chat", {"tools": "get_weather"}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_constraints_answer_400_naming_the_field(server, path, body, param):
    prompt = {"messages": ASK_WEATHER} if path == "chat" else {"prompt": "x"}
    url = server.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    response = post(url, json={**prompt, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_bad_schema_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="json_schema|schema"):
        client.chat.completions.create(model="smol", messages=OK_PROMPT, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "minProperties": "x"}}})


# -- tool calling ------------------------------------------------------------------------------------------------
def assert_valid_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, parameters(tool))
    return arguments


def test_tool_choice_required_gives_parsed_tool_calls(client):
    reply = client.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=48)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_call(choice.message.tool_calls[0], WEATHER)


def test_a_named_tool_choice_forces_that_function_even_at_temperature_1(client):
    # (one choice: the tools' long system prompt is the slow part, and the history test below reuses its cache)
    reply = client.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=TOOLS, temperature=1.0,
                                           seed=11, max_tokens=48,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert_valid_call(call, TIME)


def test_streamed_tool_calls_assemble_to_the_same_call(client):
    kw = dict(model="smol", messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=48,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    deltas = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    head = calls[0]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather"  # the name comes first, the arguments after it in fragments
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:]) and len(calls) > 2
    arguments = "".join(c.function.arguments or "" for c in calls)
    assert arguments == whole.function.arguments
    assert_valid_call(head.model_copy(update={"function": head.function.model_copy(
        update={"arguments": arguments})}), WEATHER)
    assert deltas[-1].finish_reason == "tool_calls"


def test_earlier_calls_and_tool_results_render_through_the_template(client, model):
    arguments = {"city": "Paris", "unit": "celsius"}
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    for choice in ("none", "auto"):
        reply = client.chat.completions.create(model="smol", messages=history, tools=TOOLS, tool_choice=choice,
                                               temperature=0, max_tokens=8)
        message = reply.choices[0].message
        if choice == "none":  # no constraint, no parsing: whatever came out is content
            assert message.tool_calls is None and isinstance(message.content, str)
        assert (reply.choices[0].finish_reason == "tool_calls") == bool(message.tool_calls)
    # the template saw the call's arguments as an object (Qwen writes them with tojson) and the tool's answer
    expected = [history[0], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": arguments}}]}, history[2]]
    text = apply_chat_template(model, expected, template=TEMPLATE, tools=TOOLS)
    assert '"arguments": {"city": "Paris"' in text and "<tool_response>" in text
    n_prompt = len(model.vocab.tokenize(text, add_special=True, parse_special=True))
    assert reply.usage.prompt_tokens == n_prompt


def test_a_pipelines_chat_template_file_reaches_the_served_engine(tmp_path, smollm2_path):
    from llmfw.core.pipeline import load_pipeline
    from llmfw.serving.app import pipeline_app

    (tmp_path / "qwen.jinja").write_text(TEMPLATE)
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {smollm2_path}\nbackend: numpy\ncontext: {{n_ctx: 256}}\n"
                      "chat: {template_file: qwen.jinja}\nserver: {parallel: 1}\n")
    engines: list[Engine] = []
    pipeline_app(load_pipeline(config), eager=True, on_ready=engines.append)
    with engines[0] as engine:  # (the tests above serve this template and parse its <tool_call> format)
        assert engine.chat_template == TEMPLATE


def test_a_call_cut_short_by_max_tokens_finishes_with_length(client):
    reply = client.chat.completions.create(model="smol", messages=ASK_WEATHER, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=26)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls[0].function.name == "get_weather"  # the part that came is still parsed
