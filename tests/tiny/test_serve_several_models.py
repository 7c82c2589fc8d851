"""Several models behind one `llmfw serve` (llama-server's router mode): ``-m A -m B``, ``--models-dir``, a YAML
``models:`` list with aliases. Real servers on 127.0.0.1 driven by the real `openai` and `anthropic` clients and
httpx, over tiny random-weight models with different weights (so a reply shows which model answered); the
router's LRU and its one-load-for-many-requests rule also in-process, over real engines, where a test can hold a
request open as long as it likes."""
from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

import llmfw
from llmfw.core.errors import EngineBusy
from llmfw.serving import Engine
from llmfw.serving.app import create_app
from llmfw.serving.router import ModelRouter, ServedModel
from support.cli import llmfw_in_process
from support.live_server import TIMEOUT, LiveServer, ServeCommand, get, post
from support.models import write_tiny_llama

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """a.gguf and b.gguf (different weights), and more/c.gguf (a copy of b) for --models-dir."""
    folder = tmp_path_factory.mktemp("several")
    write_tiny_llama(folder / "a.gguf", seed=31)
    write_tiny_llama(folder / "b.gguf", seed=32)
    (folder / "more").mkdir()
    shutil.copy(folder / "b.gguf", folder / "more" / "c.gguf")
    return folder


@pytest.fixture(scope="module")
def server(files):
    """Two models, at most one loaded at once."""
    serve = ServeCommand("-m", str(files / "a.gguf"), "-m", str(files / "b.gguf"), "--models-max", "1",
                         "--backend", "numpy", "-np", "2", "-c", "256", "--no-webui")
    yield serve
    assert serve.stop() == 0, serve.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in get(url + "/v1/models").json()["data"]}


def first_logprobs(client, model: str) -> list[float]:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=5)
    assert reply.model == model
    return sorted(reply.choices[0].logprobs.top_logprobs[0].values())


# -- the command with two models --------------------------------------------------------------------------------------
def test_health_and_every_model_listed_unloaded_before_any_request(server):
    assert "serving 2 models" in server.wait_for_log("serving")
    assert get(server.url + "/health").json() == {"status": "ok"}
    data = get(server.url + "/v1/models").json()["data"]
    assert [(m["id"], m["object"], m["status"]["value"]) for m in data] == [("a", "model", "unloaded"),
                                                                           ("b", "model", "unloaded")]


def test_requests_are_routed_by_model_and_the_lru_model_unloaded(server, client):
    a = first_logprobs(client, "a")
    assert states(server.url) == {"a": "loaded", "b": "unloaded"}
    loaded = next(m for m in get(server.url + "/v1/models").json()["data"] if m["id"] == "a")
    assert loaded["meta"]["parallel"] == 2 and loaded["meta"]["n_ctx_slot"] == 128
    b = first_logprobs(client, "b")
    assert states(server.url) == {"a": "unloaded", "b": "loaded"}  # --models-max 1: a made room
    assert a != b  # different weights: the request reached the model it named
    assert first_logprobs(client, "a") == a  # loaded again, the same model
    server.wait_for_log("unloaded model a")
    assert server.wait_for_log("loading model b: 50%")  # progress in the log


def test_streams_and_abandoned_streams_release_their_model(server, client):
    """With one model loaded at most, a stream that held its model past its end (or past the client going
    away) would leave every request for the other model waiting forever."""
    chunks = list(client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[0].model == "a"
    assert first_logprobs(client, "b")
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 100, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: "))
    assert first_logprobs(client, "b")  # the abandoned stream let a go
    assert states(server.url)["b"] == "loaded"


def test_unknown_model_is_404_in_each_api_shape(server, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'nope'" in error["message"] and "a, b" in error["message"]
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/embeddings", {"input": "x"}),
                       ("/tokenize", {"content": "x"})]:
        response = post(server.url + path, json={**body, "model": "nope"})
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found", path
    missing = post(server.url + "/v1/completions", json={"prompt": "x"})
    assert missing.status_code == 400 and "names no model" in missing.json()["error"]["message"]

    messages = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(anthropic.NotFoundError) as caught:
        messages.messages.create(model="nope", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    assert "a, b" in caught.value.body["error"]["message"]
    counted = post(server.url + "/v1/messages/count_tokens", json={"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]})
    assert counted.status_code == 404 and counted.json()["error"]["type"] == "not_found_error"


def test_anthropic_and_the_other_endpoints_route_by_model(server):
    messages = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=TIMEOUT)
    reply = messages.messages.create(model="b", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert reply.model == "b" and reply.usage.output_tokens >= 1
    assert messages.messages.count_tokens(model="a", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    embedded = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) \
        .embeddings.create(model="b", input="hello")
    assert embedded.model == "b" and len(embedded.data[0].embedding) == 32
    tokens = post(server.url + "/tokenize", json={"model": "a", "content": "hello world"}).json()["tokens"]
    assert post(server.url + "/detokenize", json={"model": "b", "tokens": tokens}).json()["content"] == "hello world"


def test_metrics_carry_the_model_label(server, client):
    first_logprobs(client, "a")
    text = get(server.url + "/metrics").text
    for name in ("llmfw_requests_running", "llmfw_requests_waiting", "llmfw_prompt_tokens_total",
                 "llmfw_generated_tokens_total"):
        for model in ("a", "b"):
            assert re.search(rf'^{name}{{model="{model}"}} \S+$', text, re.M), (name, model)
    generated = re.search(r'^llmfw_generated_tokens_total{model="a"} (\S+)$', text, re.M)
    assert float(generated.group(1)) >= 3  # counted across a's unloads and reloads
    assert re.search(r'^llmfw_time_to_first_token_seconds_count{model="b"} \S+$', text, re.M)


# -- a YAML models: list with aliases, and --models-dir -------------------------------------------------------------
def test_yaml_models_list_with_aliases_and_a_models_dir(files, tmp_path):
    config = tmp_path / "serve.yaml"
    shutil.copy(files / "a.gguf", tmp_path / "a.gguf")
    config.write_text("backend: numpy\ncontext: {n_ctx: 256}\n"
                      "models:\n  - {model: a.gguf, name: alpha, aliases: [first, small]}\n"
                      f"server: {{parallel: 1, webui: false, models_max: 0, models_dir: {files / 'more'}}}\n")
    serve = ServeCommand("--config", str(config))
    try:
        data = get(serve.url + "/v1/models").json()["data"]
        assert [(m["id"], m["aliases"], m["status"]["value"]) for m in data] == [
            ("alpha", ["first", "small"], "unloaded"), ("c", [], "unloaded")]
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        reply = client.completions.create(model="small", prompt=PROMPT, max_tokens=2)
        assert reply.model == "alpha"
        assert client.completions.create(model="c", prompt=PROMPT, max_tokens=2).model == "c"
        assert states(serve.url) == {"alpha": "loaded", "c": "loaded"}  # models_max 0: no limit
        with pytest.raises(openai.NotFoundError, match="alpha, c"):
            client.completions.create(model="a", prompt=PROMPT, max_tokens=2)
    finally:
        assert serve.stop() == 0, serve.log()


# -- bad entries: one line, exit 1 ------------------------------------------------------------------------------------
def one_error_line(*args: str) -> str:
    result = llmfw_in_process("serve", *args)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("llmfw: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_each_model_is_checked_at_start(files, tmp_path):
    a = str(files / "a.gguf")
    assert "nosuch.gguf" in one_error_line("-m", a, "-m", str(tmp_path / "nosuch.gguf"))
    text = tmp_path / "text.gguf"
    text.write_text("not a model")
    assert "not a usable GGUF" in one_error_line("-m", a, "-m", str(text))
    assert "no such folder" in one_error_line("--models-dir", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    assert "holds no .gguf" in one_error_line("--models-dir", str(tmp_path / "empty"))
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    shutil.copy(text, bad_dir / "x.gguf")
    assert "x.gguf" in one_error_line("-m", a, "--models-dir", str(bad_dir))
    twin = tmp_path / "twin"
    twin.mkdir()
    shutil.copy(files / "a.gguf", twin / "a.gguf")
    assert "two models are named 'a'" in one_error_line("-m", a, "-m", str(twin / "a.gguf"))
    assert "--alias" in one_error_line("-m", a, "-m", str(files / "b.gguf"), "--alias", "x")
    assert "--ray" in one_error_line("-m", a, "-m", str(files / "b.gguf"), "--ray")
    both = tmp_path / "both.yaml"
    both.write_text(f"model: {a}\nmodels: [{{model: {a}}}]\n")
    assert "not both" in one_error_line("--config", str(both))


def test_a_models_list_is_validated_like_every_section():
    from llmfw.app.pipeline import validate_config
    from llmfw.core.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        validate_config({"models": [{"model": "a.gguf", "nme": "x"}, {"name": "b"}],
                         "server": {"models_max": -1}}, "p.yaml")
    message = str(caught.value)
    assert message.startswith("p.yaml: 3 problems:")
    assert "models.0.nme: unknown key, did you mean `name`?" in message
    assert "models.1.model: is required" in message and "server.models_max: must be >= 0" in message


# -- the router in-process: LRU never unloads mid-request, one load for many requests ---------------------------------
@pytest.fixture()
def router(files, request):
    reports: list[str] = []

    def build(served, metrics):
        return Engine(llmfw.load_model(str(served.path), backend="numpy"), parallel=1, n_ctx=128,
                      alias=served.name, metrics=metrics)

    models = [ServedModel("a", files / "a.gguf"), ServedModel("b", files / "b.gguf", ("bee",))]
    router = ModelRouter(models, build, max_loaded=1, max_waiting=getattr(request, "param", 8),
                         report=reports.append)
    router.reports = reports
    yield router
    router.close()


def listed(router) -> dict[str, str]:
    return {model.name: state for model, state, _ in router.listing()}


def test_the_lru_model_is_unloaded_only_once_its_requests_finish(router):
    lease = router.acquire("a")  # a request in flight on a
    got = []
    waiter = threading.Thread(target=lambda: got.append(router.acquire("bee")))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and listed(router) == {"a": "loaded", "b": "unloaded"}
    assert lease.engine.running  # never unloaded under a request
    assert any("once its 1 request(s) finish" in line for line in router.reports)
    lease.release()
    waiter.join(TIMEOUT)
    assert got and got[0].engine.alias == "b" and not lease.engine.running
    assert listed(router) == {"a": "unloaded", "b": "loaded"}
    got[0].release()


def test_concurrent_first_requests_load_the_model_once(router):
    leases = []
    threads = [threading.Thread(target=lambda: leases.append(router.acquire("b"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert len(leases) == 4 and len({id(lease.engine) for lease in leases}) == 1
    assert sum(line.startswith("llmfw: loading model b (") for line in router.reports) == 1
    for lease in leases:
        lease.release()


@pytest.mark.parametrize("router", [1], indirect=True)
def test_requests_waiting_for_a_model_are_bounded(router):
    """Each waiting request holds a worker thread, which running streams need too: past the bound, 503."""
    lease = router.acquire("a")
    waiter = threading.Thread(target=lambda: router.acquire("b").release())
    waiter.start()
    deadline = time.monotonic() + TIMEOUT
    while router._n_waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(EngineBusy, match="waiting for their model"):
        router.acquire("b")
    lease.release()
    waiter.join(TIMEOUT)
    assert listed(router) == {"a": "unloaded", "b": "loaded"}


# -- one model: any name reaches it, as before -------------------------------------------------------------------------
def test_one_model_answers_whatever_model_a_request_names(files):
    with Engine(llmfw.load_model(str(files / "a.gguf"), backend="numpy"), parallel=1, n_ctx=128,
                alias="solo") as engine:
        live = LiveServer(create_app(engine))
        try:
            reply = post(live.url + "/v1/completions", json={"model": "anything", "prompt": PROMPT, "max_tokens": 1})
            assert reply.status_code == 200 and reply.json()["model"] == "solo"
            [entry] = get(live.url + "/v1/models").json()["data"]
            assert entry["id"] == "solo" and entry["status"] == {"value": "loaded"} and entry["meta"]["parallel"] == 1
            assert re.search(r"^llmfw_requests_running 0\.0$", get(live.url + "/metrics").text, re.M)
        finally:
            live.stop()
