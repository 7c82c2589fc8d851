"""``GET /openapi.json`` describes every endpoint (issue "agent-ready serving", item 7), and two fuzzes never get a
5xx and always get an error in the endpoint's own API shape: schemathesis from the published spec (a few hundred
cases of benchmarks/fuzz_serve.py, which runs thousands), and a hypothesis fuzz of every POST endpoint with
bodies built around a good one — right keys with wrong values, wrong keys, wrong types, bodies that are not JSON.
A real server on 127.0.0.1 (SmolLM2, numpy backend), httpx; generation is kept to a few tokens per request."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmfw
from llmfw.serving.app import ROUTES
from support.live_server import TIMEOUT, get, serve_engine

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import fuzz_serve  # noqa: E402

#: schemathesis cases of the test (the benchmark runs thousands)
SCHEMATHESIS_CASES = 200

GOOD = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/embeddings": {"input": "Hi"},
    "/v1/messages": {"max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "Hi"}]},
    "/tokenize": {"content": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
}
#: generation endpoints: max_tokens is always small, so a fuzz case costs a few decode steps at most
GENERATING = {"/v1/completions", "/v1/chat/completions", "/v1/messages"}


@pytest.fixture(scope="module")
def server(smollm2_path):
    model = llmfw.load_model(str(smollm2_path), backend="numpy")
    yield from serve_engine(model, parallel=2, n_ctx=512, alias="smol")


@pytest.fixture(scope="module")
def spec(server):
    return get(server.url + "/openapi.json").json()


def test_openapi_lists_every_route_and_its_bodies(spec):
    assert spec["openapi"].startswith("3.1")
    for path, _, methods in ROUTES:
        for method in methods:
            assert method.lower() in spec["paths"][path], (path, method)
    for path, body in GOOD.items():
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        jsonschema.validate(body, {**schema, "components": spec["components"]})
    messages = spec["components"]["schemas"]["MessagesRequest"]
    assert "max_tokens" in messages["required"] and "thinking" in messages["properties"]
    # the fields checked by their own code are published with their shapes, not as "anything"
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for field in ("response_format", "tools", "tool_choice", "grammar"):
        assert chat[field].get("anyOf"), field
    # each error status points at its API's error shape
    anthropic_error = spec["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]
    openai_error = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]["content"]["application/json"]
    assert anthropic_error["schema"]["$ref"].endswith("/AnthropicError")
    assert openai_error["schema"]["$ref"].endswith("/OpenAIError")


@pytest.mark.parametrize("path, shape", [("/v1/messages", "AnthropicError"),
                                         ("/v1/messages/count_tokens", "AnthropicError"),
                                         ("/v1/chat/completions", "OpenAIError"), ("/tokenize", "OpenAIError")])
def test_a_wrong_method_answers_405_in_the_apis_shape(server, spec, path, shape):
    response = get(server.url + path)
    assert response.status_code == 405
    jsonschema.validate(response.json(), spec["components"]["schemas"][shape])
    assert fuzz_serve.error_shape_problem(path, response.content) is None


@pytest.mark.slow
def test_schemathesis_from_the_published_spec_finds_no_5xx(server, spec):
    tally = fuzz_serve.fuzz(server.url, spec, SCHEMATHESIS_CASES, seed=1)
    assert tally.cases >= SCHEMATHESIS_CASES
    statuses = {status for _, status in tally.counts}
    assert 200 in statuses and 400 in statuses  # valid bodies ran, broken ones were refused
    assert not tally.failures, tally.failures[:3]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


@st.composite
def fuzz_case(draw, spec):
    path = draw(st.sampled_from(sorted(GOOD)))
    schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = schema["$ref"].rsplit("/", 1)[-1]
    keys = sorted(spec["components"]["schemas"][name]["properties"])
    body = dict(GOOD[path]) if draw(st.booleans()) else {}
    for key in draw(st.lists(st.sampled_from(keys), max_size=4)):
        body[key] = draw(JSON_VALUES)
    body.update(draw(st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=2)))
    if path in GENERATING:
        body["max_tokens"] = draw(st.integers(-1, 2))
        body.pop("max_completion_tokens", None)
        body.pop("n", None)
    raw = draw(st.booleans()) and draw(st.booleans())  # now and then a body that is not a JSON object
    not_json = [b"", b"[]", b"{", b'"x"', b"\xff\xfe", b'{"temperature": Infinity}', b'{"max_tokens": NaN}']
    return path, (draw(st.sampled_from(not_json)) if raw else body)


def test_fuzzed_bodies_never_get_a_5xx(server, spec):
    failures = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(fuzz_case(spec))
    def check(case):
        path, body = case
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = httpx.post(server.url + path, timeout=TIMEOUT, **kwargs)
        if response.status_code >= 500:
            failures.append((path, body, response.text))
            return
        if response.status_code >= 400:
            error = response.json()
            if path.startswith("/v1/messages"):
                assert error["type"] == "error" and error["error"]["type"] and error["error"]["message"], error
            else:
                assert error["error"]["message"], error

    check()
    assert not failures, failures[:3]
