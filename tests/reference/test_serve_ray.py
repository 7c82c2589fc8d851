"""`llmfw serve --ray`: the server as a Ray Serve application on a real local Ray instance (issue 19).

Ray starts once for this module (``num_cpus=2``); the deployments serve SmolLM2 on the numpy backend with one
engine thread each, so two replicas share the machine's two cores. Requests come from the real ``openai``
client through Ray's HTTP proxy. Every wait is bounded.
"""
from __future__ import annotations

import concurrent.futures as futures
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'llmfw[ray]')")
from ray import serve  # noqa: E402

from llmfw.serving.ray_app import APP_NAME, DEPLOYMENT_NAME, ray_app  # noqa: E402

REPLICA_HEADER = "x-llmfw-replica"
#: bounds on every wait: the machine running the suite may be busy
REQUEST_TIMEOUT = 120
RECOVERY_TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_serve():
    """A local Ray instance with Serve's proxy on a free port; torn down after the module."""
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=150 * 2**20)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def config(smollm2_path, ray_section: dict) -> dict:
    return {"model": str(smollm2_path), "backend": "numpy", "context": {"n_threads": 1},
            "server": {"parallel": 2, "ray": ray_section}}


def deploy(smollm2_path, ray_section: dict) -> None:
    serve.run(ray_app(config(smollm2_path, ray_section)), name=APP_NAME, route_prefix="/", blocking=False)
    wait_for(lambda: app_status() == "RUNNING", RECOVERY_TIMEOUT, "the application to start")


def app_status() -> str | None:
    app = serve.status().applications.get(APP_NAME)
    return app.status.value if app is not None else None


def running_replicas() -> int:
    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return 0
    states = app.deployments[DEPLOYMENT_NAME].replica_states
    return int(states.get("RUNNING", 0))


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.5)


def client(url: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=retries, timeout=REQUEST_TIMEOUT)


def complete(cli: openai.OpenAI, prompt: str, max_tokens: int = 8) -> tuple[str, str]:
    """One completion; returns (text, the replica that answered)."""
    raw = cli.completions.with_raw_response.create(model="smollm2", prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0)
    return raw.parse().choices[0].text, raw.headers[REPLICA_HEADER]


@pytest.fixture(scope="module")
def two_replicas(ray_serve, smollm2_path):
    deploy(smollm2_path, {"num_replicas": 2})
    wait_for(lambda: running_replicas() == 2, RECOVERY_TIMEOUT, "two running replicas")
    yield ray_serve
    serve.delete(APP_NAME)


def test_forty_requests_spread_over_both_replicas(two_replicas):
    cli = client(two_replicas)
    prompts = [f"Count to {i}:" for i in range(40)]
    with futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: complete(cli, p), prompts, timeout=REQUEST_TIMEOUT * 4))
    assert len(results) == 40 and all(text for text, _ in results)
    assert len({replica for _, replica in results}) == 2
    # greedy: the same prompt gives the same text on either replica
    again = [complete(cli, prompts[0])[0] for _ in range(4)]
    assert set(again) == {results[0][0]}


def test_every_endpoint_behaves_as_in_one_process(two_replicas):
    health = httpx.get(f"{two_replicas}/health", timeout=REQUEST_TIMEOUT)
    assert health.status_code == 200 and health.json() == {"status": "ok"} and health.headers[REPLICA_HEADER]
    metrics = httpx.get(f"{two_replicas}/metrics", timeout=REQUEST_TIMEOUT)
    assert "llmfw_requests_running" in metrics.text and metrics.headers[REPLICA_HEADER]
    stream = client(two_replicas).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    bad = httpx.post(f"{two_replicas}/v1/completions", content=b"\xff{not json", timeout=REQUEST_TIMEOUT,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "error" in bad.json()


def _replica_pids() -> list[int]:
    """The processes of this deployment's live replicas (Ray titles them ``ray::ServeReplica:APP:DEPLOYMENT``)."""
    title = f"ServeReplica:{APP_NAME}:{DEPLOYMENT_NAME}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if title in f.read():
                        pids.append(int(entry))
            except OSError:  # the process ended meanwhile
                pass
    return pids


def test_a_replica_killed_mid_burst_is_replaced(two_replicas):
    """Requests on the killed replica end with an HTTP 500 from Ray's proxy that the client sees (this client
    does not retry; the openai client's default ``max_retries=2`` would re-send them); every other request
    succeeds; Ray restarts the replica and all requests succeed again."""
    pids = _replica_pids()
    assert len(pids) == 2
    cli = client(two_replicas)

    def attempt(i: int) -> str:
        try:
            complete(cli, f"Tell me about the number {i}.", max_tokens=24)
            return "ok"
        except (openai.APIError, httpx.HTTPError) as exc:
            return type(exc).__name__

    with futures.ThreadPoolExecutor(8) as pool:
        pending = [pool.submit(attempt, i) for i in range(24)]
        time.sleep(2.0)  # the burst is under way on both replicas
        os.kill(pids[0], signal.SIGKILL)
        outcomes = [f.result(timeout=REQUEST_TIMEOUT * 4) for f in pending]
    assert outcomes.count("ok") >= 12, outcomes  # the survivor kept serving
    assert all(o in ("ok", "InternalServerError", "APIStatusError", "APIConnectionError", "APITimeoutError")
               for o in outcomes), outcomes

    wait_for(lambda: running_replicas() == 2 and len(_replica_pids()) == 2, RECOVERY_TIMEOUT,
             "Ray to replace the killed replica")
    assert pids[0] not in _replica_pids()
    results = [complete(cli, f"Again {i}:") for i in range(8)]
    assert all(text for text, _ in results)


def test_autoscaling_scales_up_under_load_and_back_down(ray_serve, smollm2_path):
    deploy(smollm2_path, {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 1,
        "downscale_delay_s": 4, "metrics_interval_s": 0.5, "look_back_period_s": 2}})
    try:
        assert running_replicas() == 1
        cli = client(ray_serve, retries=2)
        deadline = time.monotonic() + RECOVERY_TIMEOUT
        with futures.ThreadPoolExecutor(6) as pool:
            while running_replicas() < 2:  # a sustained burst: six clients, one request after another
                assert time.monotonic() < deadline, "did not scale up to 2 replicas"
                batch = [pool.submit(complete, cli, f"Story {i}:", 32) for i in range(6)]
                assert all(f.result(timeout=REQUEST_TIMEOUT)[0] for f in batch)
        wait_for(lambda: running_replicas() == 1, RECOVERY_TIMEOUT, "scaling back down to 1 replica")
    finally:
        serve.delete(APP_NAME)


def test_serve_ray_without_ray_names_the_extra(tmp_path):
    """In an interpreter where ``ray`` cannot be imported, ``llmfw serve --ray`` says which extra to install."""
    blocker = tmp_path / "ray.py"
    blocker.write_text("raise ImportError('no ray here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "llmfw.cli", "serve", "--ray", "--port", "0"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert "pip install 'llmfw[ray]'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--replicas", "2"], "only makes sense with --ray"),
    (["--ray", "--replicas", "2", "--autoscale", "1:2"], "not both"),
    (["--ray", "--autoscale", "3:1"], "MIN:MAX"),
    (["--ray", "--autoscale", "two"], "MIN:MAX"),
])
def test_bad_ray_flags_are_clear_errors(args, message):
    result = subprocess.run([sys.executable, "-m", "llmfw.cli", "serve", *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
