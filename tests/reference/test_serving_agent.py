"""Rough edges of `llmfw serve` a new user meets (issue "agent-ready serving", item 6): a model that cannot be
served exits with one line, ``max_tokens`` past a slot's room is capped (``length``), tools offered to a template
that knows none are warned about, ``--chat-template FILE``. Real servers on 127.0.0.1, the real `openai` client
and httpx."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from llmfw.core.gguf import GGUFWriter
from support.live_server import TIMEOUT, free_port, get, post, serve_engine

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "tests" / "data" / "tool_templates"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def model(shared_models):
    return shared_models.get("smollm2", "numpy")


@pytest.fixture(scope="module")
def tiny_slot_server(model):
    """One small slot (the context is rounded up to 256 tokens): a reply reaches the slot's end quickly."""
    yield from serve_engine(model, parallel=1, n_ctx=64, alias="smol")


def serve_command(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "llmfw.cli", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def assert_one_error_line(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("llmfw: error:")]
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word in errors[0], errors[0]


def gguf_file(path: Path, **metadata) -> Path:
    writer = GGUFWriter(path)
    for key, value in metadata.items():
        writer.add(key.replace("__", "."), value)
    writer.write()
    return path


# -- a model that cannot be served: one line, exit 1, never a 503 server ----------------------------------------------
def test_serve_missing_model_exits_with_one_line():
    assert_one_error_line(serve_command("-m", "nosuchmodel"), "nosuchmodel")


def test_serve_unknown_architecture_exits_with_one_line(tmp_path):
    path = gguf_file(tmp_path / "odd.gguf", general__architecture="nosucharch")
    assert_one_error_line(serve_command("-m", str(path)), "nosucharch")


def test_serve_file_that_is_not_gguf_exits_with_one_line(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_bytes(b"these are my notes, not a model" * 10)
    assert_one_error_line(serve_command("-m", str(path)), str(path))


def test_serve_model_that_fails_to_load_exits_instead_of_answering_503(tmp_path):
    """The header names a known architecture, but the file has none of its hyperparameters or tensors: the
    check before listening passes, loading fails in the background, and the server exits."""
    path = gguf_file(tmp_path / "empty-llama.gguf", general__architecture="llama")
    assert_one_error_line(serve_command("-m", str(path), "--backend", "numpy"), "failed to load")


def test_serve_missing_chat_template_file_exits_with_one_line(smollm2_path, tmp_path):
    missing = tmp_path / "nope.jinja"
    assert_one_error_line(serve_command("-m", str(smollm2_path), "--chat-template", str(missing)), str(missing))


def test_serve_bad_chat_template_kwargs_exits_with_one_line(smollm2_path):
    assert_one_error_line(serve_command("-m", str(smollm2_path), "--chat-template-kwargs", "[1, 2]"),
                          "--chat-template-kwargs")


# -- max_tokens beyond a slot's room: capped, finish_reason "length" ------------------------------------------------
def test_max_tokens_beyond_the_slot_is_capped_with_length(tiny_slot_server, model):
    """The prompts leave a few tokens of room; max_tokens asks for far more: the reply fills the slot and
    finishes with "length" (llama-server's rule), where it used to be refused with 400."""
    client = openai.OpenAI(base_url=tiny_slot_server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    slot = get(tiny_slot_server.url + "/v1/models").json()["data"][0]["meta"]["n_ctx_slot"]
    eos = {str(model.vocab.eos_id): -100}
    prompt = "word " * (slot - 10)
    reply = client.completions.create(model="smol", prompt=prompt, max_tokens=100_000, temperature=0,
                                      logit_bias=eos)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens > 0
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == slot
    question = [{"role": "user", "content": "word " * (slot - 40)}]  # the template adds ~30 tokens
    chat = client.chat.completions.create(model="smol", messages=question, max_tokens=100_000, temperature=0,
                                          logit_bias=eos)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens > 0
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == slot


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "word " * 300, "max_tokens": 5}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 5},
     "messages"),
])
def test_prompt_that_does_not_fit_the_slot_is_400(tiny_slot_server, path, body, param):
    response = post(tiny_slot_server.url + path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "does not fit" in error["message"]


# -- tools offered to a template without tools: a warning in the log and the response -------------------------------
def test_tool_choice_auto_with_a_template_without_tools_warns(tiny_slot_server, caplog):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": WEATHER, "max_tokens": 3,
            "temperature": 0}
    with caplog.at_level(logging.WARNING, logger="llmfw.serving.constraints"):
        reply = post(tiny_slot_server.url + "/v1/chat/completions", json=body).json()
    [warning] = reply["warnings"]
    assert "get_weather" in warning and "tokenizer.chat_template" in warning and "--chat-template" in warning
    assert any("get_weather" in r.getMessage() for r in caplog.records)
    client = openai.OpenAI(base_url=tiny_slot_server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    first = next(iter(client.chat.completions.create(model="smol", stream=True, **{
        k: v for k, v in body.items() if k != "model"})))
    assert "get_weather" in first.model_extra["warnings"][0]
    plain = post(tiny_slot_server.url + "/v1/chat/completions", json={**body, "tools": None}).json()
    assert "warnings" not in plain


# -- serve --chat-template FILE ---------------------------------------------------------------------------------------
def test_serve_chat_template_file_gives_the_model_tools(smollm2_path):
    """SmolLM2's own template knows no tools; with Qwen 2.5's template a forced call comes back parsed."""
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    template = TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
    proc = subprocess.Popen([sys.executable, "-m", "llmfw.cli", "serve", "-m", str(smollm2_path), "--backend",
                             "numpy", "-c", "1024", "-np", "1", "--port", str(port), "--chat-template",
                             str(template)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "llmfw serve exited before serving"
        url = f"http://127.0.0.1:{port}"
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": WEATHER,
                "tool_choice": "required", "max_tokens": 40, "temperature": 0}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json()
        [call] = reply["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert set(json.loads(call["function"]["arguments"])) == {"city"}
        assert "warnings" not in reply
        assert get(url + "/health").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
