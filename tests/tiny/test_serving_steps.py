"""The engine's step profile (issue 32): each step's decode call against the engine's own work, in ``/metrics``
(``llmfw_step_decode_seconds``, ``llmfw_step_engine_seconds``), in :attr:`Engine.step_profile`, in the ``-v`` log
and in ``llmfw bench-serve``'s engine column. A real uvicorn server on 127.0.0.1 over a tiny random-weight model,
driven by the real ``openai`` client; counts and consistency only, never speed."""
from __future__ import annotations

import json
import re
import threading

import openai
import pytest

import llmfw
from llmfw.serving import Engine
from llmfw.serving.app import create_app
from support.cli import llmfw_in_process
from support.live_server import TIMEOUT, LiveServer, ServeCommand, get
from support.models import write_tiny_llama

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("steps") / "tiny.gguf")


@pytest.fixture(scope="module")
def engine(model_path):
    with llmfw.load_model(str(model_path), backend="numpy") as model, \
            Engine(model, parallel=2, n_ctx=256, alias="tiny") as e:
        yield e


@pytest.fixture(scope="module")
def model(engine):
    return engine.model


@pytest.fixture(scope="module")
def server(engine):
    live = LiveServer(create_app(engine))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def no_end(model) -> dict[str, int]:
    """A logit bias banning end of generation: every reply runs its full length."""
    return {str(t): -100 for t in model.vocab.eog_ids}


def stream(client, model, n: int, prompt: str = PROMPT) -> int:
    """Stream a greedy completion of ``n`` tokens; the number of text chunks received."""
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                       logit_bias=no_end(model))
    return sum(1 for c in chunks if c.choices and c.choices[0].text)


def scrape(server) -> dict[str, float]:
    text = get(server.url + "/metrics").text
    values = {}
    for name in ("llmfw_step_decode_seconds_count", "llmfw_step_decode_seconds_sum", "llmfw_step_engine_seconds_count",
                 "llmfw_step_engine_seconds_sum", "llmfw_generated_tokens_total"):
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        assert found, name
        values[name] = float(found.group(1))
    assert re.search(r'^llmfw_step_engine_seconds_bucket\{le="0\.001"\} \S+$', text, re.M)
    return values


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def test_one_stream_one_step_per_token(server, client, engine, model):
    n = 12
    before, profile_before = scrape(server), engine.step_profile
    assert stream(client, model, n) > 0
    d, profile = delta(before, scrape(server)), engine.step_profile
    # the prompt fits one step, which samples the first token; each further token is one decode step
    assert d["llmfw_generated_tokens_total"] == n
    assert d["llmfw_step_decode_seconds_count"] == d["llmfw_step_engine_seconds_count"] == n
    decode, own = d["llmfw_step_decode_seconds_sum"], d["llmfw_step_engine_seconds_sum"]
    assert decode > 0 and own > 0
    assert 0 < own / (own + decode) < 1
    assert (profile.steps - profile_before.steps, profile.tokens - profile_before.tokens) == (n, n)
    assert profile.engine_s == pytest.approx(profile.schedule_s + profile.sample_s + profile.output_s)
    assert min(profile.schedule_s, profile.sample_s, profile.output_s) > 0
    assert 0 < profile.engine_share < 1
    assert re.match(r"\d+ steps, \d+ tokens: [\d.]+ ms/step = decode [\d.]+ \+ engine [\d.]+ ms \([\d.]+ % of a "
                    r"step: schedule [\d.]+, sample [\d.]+, output [\d.]+ ms\)$", profile.summary())


def test_concurrent_streams_share_steps(server, client, engine, model):
    """Three requests on two slots: a step samples the next token of every sequence in it, so there are at most
    as many steps as tokens (fewer where the requests overlapped, which this test does not time), at least as
    many as one request's tokens; the profile counts every sampled token once."""
    n, requests = 8, 3
    before, profile_before = scrape(server), engine.step_profile
    counts: list[int] = []
    threads = [threading.Thread(target=lambda i=i: counts.append(stream(client, model, n, f"{PROMPT} {i}")))
               for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(counts) == requests and min(counts) > 0
    d, profile = delta(before, scrape(server)), engine.step_profile
    steps = d["llmfw_step_decode_seconds_count"]
    assert d["llmfw_generated_tokens_total"] == n * requests == profile.tokens - profile_before.tokens
    assert n <= steps <= n * requests
    assert steps == d["llmfw_step_engine_seconds_count"] == profile.steps - profile_before.steps


def test_bench_serve_reports_the_engine_share(server, model_path):
    result = llmfw_in_process("bench-serve", server.url, "-m", str(model_path), "--concurrency", "1,2", "-n", "6",
                              "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [(r["concurrency"], r["tokens"], r["n_errors"]) for r in rows] == [(1, 6, 0), (2, 12, 0)]
    assert rows[0]["steps"] == 6 and 6 <= rows[1]["steps"] <= 12
    for row in rows:
        assert 0 < row["engine_share"] < 1
        assert row["step_decode_ms"] > 0 and row["step_engine_ms"] > 0
    assert re.search(r"^server\s+1\s+6 .* \d+\.\d%$", result.stderr, re.M)  # the table's engine column


def test_bench_serve_leaves_the_engine_share_empty_without_step_metrics():
    """A server without the step histograms (another server, an old llmfw): the columns stay empty."""
    from llmfw.commands.bench_serve import step_profile

    assert step_profile(None, {"decode_sum": 1.0, "decode_count": 1, "engine_sum": 0.1, "engine_count": 1}) == {
        "steps": None, "step_decode_ms": None, "step_engine_ms": None, "engine_share": None}


def test_verbose_serve_logs_a_busy_periods_step_profile(model_path):
    serve = ServeCommand("-m", str(model_path), "--backend", "numpy", "-c", "256", "-np", "1", "--no-webui", "-v")
    try:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(t): -100 for t in llmfw.load_model(str(model_path),
                                                                                     vocab_only=True).vocab.eog_ids})
        line = serve.wait_for_log("ms/step")
        assert re.search(r"INFO llmfw\.serving\.engine: tiny\.gguf: 3 steps, 3 tokens: .* % of a step", line), line
    finally:
        serve.stop()
