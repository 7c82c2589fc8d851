"""Strict JSON schemas (issue "agent-ready serving", item 4): an object that lists ``properties`` and says
nothing about ``additionalProperties`` admits no other keys (llama.cpp's reading, OpenAI's ``strict: true``).
Checked on the schema rewrite, on the compiled grammar with SmolLM2's vocabulary, and through a real server with
the README's own ``pet`` example sampled eight times."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import llmfw
from llmfw.core.grammar import GrammarSpec, check_text_matches
from llmfw.core.generation.schema_closed import closed_schema
from llmfw.serving import Engine
from llmfw.serving.app import create_app
from support.live_server import TIMEOUT, LiveServer

#: the README's example, as a new user writes it: no additionalProperties
README_PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer"}},
              "required": ["kind", "age"]}


def test_objects_with_properties_are_closed_everywhere_in_the_schema():
    schema = {"type": "object", "properties": {
        "owner": {"type": "object", "properties": {"n": {"type": "string"}}},
        "tags": {"type": "array", "items": {"properties": {"t": {"type": "string"}}}},
        "either": {"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]},
        "open": {"type": "object", "properties": {"x": {}}, "additionalProperties": True},
        "free": {"type": "object"}},
        "$defs": {"d": {"properties": {"z": {}}}},
        "allOf": [{"properties": {"p": {}}}]}
    out = closed_schema(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["owner"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True  # said explicitly: kept
    assert "additionalProperties" not in props["free"]  # no properties listed: any object, as json_object asks
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0]  # an intersection's parts stay open
    assert "additionalProperties" not in schema  # the caller's schema is not modified
    # a property *named* like a keyword is a name, not a schema keyword
    named = closed_schema({"properties": {"properties": {"type": "string"}}})
    assert named["properties"]["properties"] == {"type": "string"}


@pytest.fixture(scope="module")
def vocab(smollm2_path):
    return llmfw.load_model(str(smollm2_path), vocab_only=True).vocab


@pytest.mark.parametrize("text, closed_ok, open_ok", [
    ('{"kind": "cat", "age": 3}', True, True),
    ('{"kind": "cat", "age": 3, "name": "Tom"}', False, True),
])
def test_compiled_schema_refuses_keys_not_listed(vocab, text, closed_ok, open_ok):
    assert check_text_matches(GrammarSpec.from_json_schema(README_PET), vocab, text) is closed_ok
    opened = {**README_PET, "additionalProperties": True}
    assert check_text_matches(GrammarSpec.from_json_schema(opened), vocab, text) is open_ok


@pytest.fixture(scope="module")
def client(smollm2_path):
    model = llmfw.load_model(str(smollm2_path), backend="numpy")
    with Engine(model, parallel=4, n_ctx=2048, alias="smol") as engine:
        live = LiveServer(create_app(engine))
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        live.stop()


@pytest.mark.parametrize("strict", [True, None])
def test_readme_pet_example_returns_only_the_listed_keys(client, strict):
    spec = {"name": "pet", "schema": README_PET, **({"strict": strict} if strict is not None else {})}
    reply = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "A pet as JSON"}], temperature=1.0, seed=11, n=4,
        max_tokens=40, response_format={"type": "json_schema", "json_schema": spec})
    exact = {**README_PET, "additionalProperties": False}
    finished = [c for c in reply.choices if c.finish_reason == "stop"]
    assert len(finished) >= 3  # a long integer may run past max_tokens; the rest must be complete
    for choice in finished:
        jsonschema.validate(json.loads(choice.message.content), exact)
