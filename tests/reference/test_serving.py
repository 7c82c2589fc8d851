"""`llmfw serve`: a real uvicorn server on 127.0.0.1 driven by the real `openai` client and httpx.

The servers start once for this module. They run the numpy backend: its float32 kernels give a request the
same greedy tokens whatever else shares the batch (see docs/serving.md, "Continuous batching", for the onnx backend's int8
activations, which do not). Generations are short so the module stays fast.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

import llmfw
from llmfw.core.chat import apply_chat_template
from llmfw.serving import Engine
from llmfw.serving.app import MAX_BODY_BYTES, create_app
from support.live_server import TIMEOUT, LiveServer, free_port, get, post

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-secret"
HI = [{"role": "user", "content": "Say hello."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model(shared_models):
    return shared_models.get("smollm2", "numpy")


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, parallel=4, n_ctx=2048, alias="smol") as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    live = LiveServer(create_app(engine, thread_tokens=64))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def small_server(model):
    """One slot, one waiting place, an API key."""
    with Engine(model, parallel=1, n_ctx=512, max_queue=1) as e:
        live = LiveServer(create_app(e, api_key=API_KEY))
        yield live
        live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def greedy(**kw):
    return {"temperature": 0, **kw}


def running(url: str, headers: dict | None = None) -> float:
    text = get(url + "/metrics", headers=headers).text
    return float(re.search(r"^llmfw_requests_running (\S+)", text, re.M).group(1))


# -- endpoints ------------------------------------------------------------------------------------------------------
def test_health_models_and_replica_header(server):
    health = get(server.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    models = get(server.url + "/v1/models")
    assert models.json()["object"] == "list" and models.json()["data"][0]["id"] == "smol"
    missing = get(server.url + "/nope")
    replicas = {r.headers.get("x-llmfw-replica") for r in (health, models, missing)}
    assert len(replicas) == 1 and None not in replicas


def test_health_answers_503_while_loading(model):
    release = threading.Event()

    def slow_engine():
        release.wait(30)
        return Engine(model, parallel=1, n_ctx=256)

    live = LiveServer(create_app(slow_engine))
    try:
        assert get(live.url + "/health").status_code == 503
        loading = post(live.url + "/v1/completions", json={"prompt": "x"})
        assert loading.status_code == 503 and loading.json()["error"]["code"] == "loading"
        release.set()
        for _ in range(200):
            if get(live.url + "/health").status_code == 200:
                break
            time.sleep(0.05)
        assert get(live.url + "/health").json() == {"status": "ok"}
    finally:
        release.set()
        live.stop()
        engine = live.server.config.app.state.engine
        if engine is not None:
            engine.close()


def test_chat_completion_shape_and_exact_usage(client, model):
    response = client.chat.completions.create(model="anything", messages=HI, max_tokens=6, **greedy())
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == "smol"
    assert choice.message.role == "assistant" and choice.message.content
    rendered = apply_chat_template(model, HI)
    n_prompt = len(model.vocab.tokenize(rendered, add_special=True, parse_special=True))
    assert response.usage.prompt_tokens == n_prompt
    if choice.finish_reason == "length":
        assert response.usage.completion_tokens == 6
    assert response.usage.total_tokens == n_prompt + response.usage.completion_tokens


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(model="smol", messages=HI, max_tokens=8, **greedy())
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_completion_prompt_forms_echo_and_streaming(client, model):
    full = client.completions.create(model="smol", prompt=PROMPT, max_tokens=5, **greedy())
    assert full.object == "text_completion" and full.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=5, stream=True, **greedy()) if c.choices)
    assert streamed == full.choices[0].text
    ids = model.vocab.tokenize(PROMPT, add_special=True, parse_special=True)
    by_ids = client.completions.create(model="smol", prompt=ids, max_tokens=5, **greedy())
    assert by_ids.choices[0].text == full.choices[0].text
    echoed = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, echo=True, **greedy())
    assert echoed.choices[0].text.startswith(PROMPT)
    two = client.completions.create(model="smol", prompt=[PROMPT, "One, two,"], max_tokens=3, **greedy())
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == full.choices[0].text[:len(
        two.choices[0].text)]


def test_logprobs(client):
    chat = client.chat.completions.create(model="smol", messages=HI, max_tokens=5, logprobs=True, top_logprobs=3,
                                          **greedy())
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens - (chat.choices[0].finish_reason == "stop")
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    text = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, logprobs=2, **greedy())
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == 4
    assert all(len(alternatives) == 2 for alternatives in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_stop_strings(client):
    free = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, **greedy()).choices[0].text
    stop = free.strip()[2:4]
    assert stop and stop in free
    stopped = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, stop=[stop], **greedy())
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free[:free.index(stop)]


def test_seed_n_and_logit_bias(client, server):
    kwargs = dict(model="smol", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=1234)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert first.choices[0].text == again.choices[0].text
    many = client.completions.create(n=3, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == first.choices[0].text  # choice i uses seed + i
    assert 3 <= many.usage.completion_tokens <= 18
    top = client.completions.create(model="smol", prompt=PROMPT, max_tokens=1, logprobs=1, **greedy())
    banned = top.choices[0].logprobs.tokens[0]
    token_id = post(server.url + "/tokenize", json={"content": banned}).json()["tokens"]
    assert len(token_id) == 1
    biased = client.completions.create(model="smol", prompt=PROMPT, max_tokens=1, logprobs=1,
                                       logit_bias={str(token_id[0]): -100}, **greedy())
    assert biased.choices[0].logprobs.tokens[0] != banned


def test_tokenize_detokenize_embeddings_metrics(server, model):
    tokens = post(server.url + "/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert tokens == model.vocab.tokenize("Hello world", add_special=False, parse_special=True)
    assert post(server.url + "/detokenize", json={"tokens": tokens}).json() == {"content": "Hello world"}
    text = get(server.url + "/metrics").text
    for name in ("llmfw_requests_running", "llmfw_requests_waiting", "llmfw_prompt_tokens_total",
                 "llmfw_generated_tokens_total", "llmfw_time_to_first_token_seconds_bucket"):
        assert re.search(rf"^{name}", text, re.M), name


def test_python_api_matches_the_server(client, engine):
    via_http = client.chat.completions.create(model="smol", messages=HI, max_tokens=6, **greedy())
    direct = engine.chat_completion(messages=HI, max_tokens=6, temperature=0)
    assert direct["choices"][0]["message"]["content"] == via_http.choices[0].message.content
    chunks = list(engine.completion(prompt=PROMPT, max_tokens=3, temperature=0, stream=True))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# -- batching -------------------------------------------------------------------------------------------------------
def test_greedy_output_does_not_depend_on_the_batch(client):
    prompts = [f"{i} plus {i} is" for i in range(8)]

    def ask(prompt):
        return client.completions.create(model="smol", prompt=prompt, max_tokens=6, **greedy()).choices[0].text

    solo = [ask(p) for p in prompts]
    together: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(prompts[i]))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[i] for i in range(8)] == solo


def test_sixteen_concurrent_streams_complete(client, server):
    results: dict[int, tuple[str, str | None]] = {}

    def stream(i):
        text, finish = "", None
        for chunk in client.completions.create(model="smol", prompt=f"{i} +", max_tokens=3, stream=True, **greedy()):
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        results[i] = (text, finish)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 16 and all(finish in ("stop", "length") for _, finish in results.values())
    assert running(server.url) == 0


def test_client_disconnect_frees_the_slot(server):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert running(server.url) == 1
    for _ in range(400):
        if running(server.url) == 0:
            break
        time.sleep(0.05)
    assert running(server.url) == 0


def test_closing_the_engine_frees_every_slot(model):
    """A request still generating when the engine stops ends with an error, and its slot is free again (the
    reset once sat inside the loop over pending engine calls, so with none pending the slot stayed taken)."""
    engine = Engine(model, parallel=2, n_ctx=256)
    stream = engine.completion(prompt=PROMPT, max_tokens=100, stream=True, temperature=0)
    next(stream)  # the request holds a slot now
    assert _gauge(engine, "llmfw_requests_running") == 1
    engine.close()
    assert _gauge(engine, "llmfw_requests_running") == 0
    with pytest.raises(llmfw.LLMFWError):
        list(stream)


def _gauge(engine: Engine, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)", engine.metrics.exposition().decode(), re.M).group(1))


def test_full_queue_answers_503_with_retry_after(small_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Once upon a time", "max_tokens": 300, "stream": True}
    with httpx.Client(timeout=TIMEOUT, headers=headers) as queue_client:
        with queue_client.stream("POST", small_server.url + "/v1/completions", json=body) as first:
            next(line for line in first.iter_lines() if line.startswith("data: "))  # running in the only slot
            with queue_client.stream("POST", small_server.url + "/v1/completions", json=body) as second:
                assert second.status_code == 200  # waiting in the only queue place
                third = queue_client.post(small_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert third.status_code == 503 and third.headers["retry-after"]
                assert third.json()["error"]["code"] == "queue_full"


# -- auth and bad input ---------------------------------------------------------------------------------------------
def test_api_key(small_server):
    url = small_server.url
    assert get(url + "/health").status_code == 200  # no key needed
    for path in ("/v1/models", "/metrics"):
        assert get(url + path).status_code == 401
        assert get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    denied = post(url + "/tokenize", json={"content": "x"})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert denied.headers["x-llmfw-replica"]
    good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].id
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [99999999]}, "prompt"),
    ({"prompt": PROMPT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_completion_requests_answer_400(server, body, param):
    response = post(server.url + "/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_bad_chat_requests_and_the_context_limit(client):
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="smol", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "word " * 600}],
                                       max_tokens=1)


def test_hostile_bodies_leave_the_server_answering(server):
    url = server.url + "/v1/chat/completions"
    cases = [
        (os.urandom(4096), 400),
        (b"[" * 100_000 + b"]" * 100_000, 400),
        (json.dumps({"prompt": "x" * (5 * 1024 * 1024)}).encode(), 413),
        (b"x" * (MAX_BODY_BYTES + 1), 413),
        (b"[1, 2]", 400),
    ]
    for raw, status in cases:
        response = post(url, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == status, raw[:40]
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert post(server.url + "/v1/completions", json={"prompt": "x" * 200_000, "max_tokens": 1}).status_code == 400
    assert get(server.url + "/health").json() == {"status": "ok"}
    assert post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200


# -- the command ----------------------------------------------------------------------------------------------------
def test_serve_command_yaml_and_sigterm(tmp_path, smollm2_path):
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {smollm2_path}\nbackend: numpy\ncontext: {{n_ctx: 512}}\n"
                      f"server: {{port: {port}, parallel: 2, alias: yaml-alias}}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "llmfw.cli", "serve", "--config", str(config)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "llmfw serve exited before serving"
        assert f"http://127.0.0.1:{port}" in line
        url = f"http://127.0.0.1:{port}"
        assert get(url + "/v1/models").json()["data"][0]["id"] == "yaml-alias"
        with httpx.stream("POST", url + "/v1/completions", timeout=TIMEOUT,
                          json={"prompt": "Once upon a time", "max_tokens": 200, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert any('"error"' in line for line in rest)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_embeddings_endpoint(server, client, model):
    import base64

    import numpy as np

    texts = ["The capital of France is Paris.", "Bonjour", "A completely different sentence about rockets."]
    response = client.embeddings.create(model="anything", input=texts)
    assert [d.index for d in response.data] == [0, 1, 2] and response.model
    vectors = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert vectors.shape == (3, model.hparams.n_embd)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-4)  # normalized like llama-server
    expected = model.embed(texts, pooling="mean")  # the GGUF says no pooling: the endpoint pools by mean
    assert np.all(np.sum(vectors * expected, axis=1) > 0.9999)
    assert response.usage.prompt_tokens == sum(len(model.vocab.tokenize(t)) for t in texts)
    one = client.embeddings.create(model="x", input=texts[1], encoding_format="base64")  # the client keeps it
    decoded = np.frombuffer(base64.b64decode(one.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(decoded, vectors[1], rtol=1e-4, atol=1e-5)
    by_ids = post(server.url + "/v1/embeddings", json={"input": model.vocab.tokenize(texts[0]), "pooling": "last"})
    assert by_ids.status_code == 200 and len(by_ids.json()["data"][0]["embedding"]) == model.hparams.n_embd


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": "x", "pooling": "bogus"}, "pooling"),
    ({"input": "x", "dimensions": 8}, "dimensions"), ({"input": [[1, 2], "mixed", 3]}, "input"),
    ({"input": ["x"] * 3000}, "input"), ({"input": "word " * 200_000}, "input"),
])
def test_embeddings_bad_input_is_400(server, body, param):
    response = post(server.url + "/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    assert get(server.url + "/health").status_code == 200
