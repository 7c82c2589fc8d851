"""`llmfw bench-serve URL_OR_MODEL`: throughput and latency of an OpenAI-compatible server under concurrency.

Per concurrency level, that many streaming ``/v1/completions`` requests start at once (each its own prompt,
greedy, ``-n`` tokens, end-of-generation banned through ``logit_bias`` so every request runs its full length);
the table shows the aggregate generated tokens/s (all tokens / wall time of the level), and p50 / p99 of the
time to first token and of the per-token latency (the gaps between streamed tokens, all requests pooled). An llmfw
server's ``/metrics`` is read before and after each level: the ``engine`` column is the engine's own work as a share
of its steps (``llmfw_step_engine_seconds`` against ``llmfw_step_decode_seconds``), the JSON adds the steps and
their mean decode and engine milliseconds (a server without those metrics leaves them empty).

Given a model instead of a URL, it starts ``llmfw serve`` on a free port; ``--compare-llama-cpp PYTHON`` also
starts llama-cpp-python's server (``PYTHON -m llama_cpp.server``, a throw-away environment, never a dependency)
on the same model and threads, so both are measured in one run: per level the servers take turns ``-r`` times
and the median run is shown. Only the standard library talks HTTP here.
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import click

PROMPT = "Write a long story about a robot who learns to paint. Chapter"
#: seconds a started server gets to answer its first request
START_TIMEOUT_S = 600


@dataclass
class RequestTiming:
    t_start: float
    t_first: float | None = None
    t_last: float | None = None
    n_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def connection(url: str, timeout: float) -> http.client.HTTPConnection:
    """An HTTP connection to the server of ``url`` (port 80 when it names none)."""
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        raise click.ClickException(f"no host in the server URL {url!r}")
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)


def stream_completion(url: str, body: dict[str, Any], api_key: str | None = None) -> RequestTiming:
    """POST a streaming completion and time each chunk that carries text."""
    conn = connection(url, START_TIMEOUT_S)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    timing = RequestTiming(time.perf_counter())
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        response = conn.getresponse()
        if response.status != 200:
            timing.error = f"HTTP {response.status}: {response.read(300)!r}"
            return timing
        for raw in response:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                timing.error = str(chunk["error"])
                break
            if any(c.get("text") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                if timing.t_last is not None:
                    timing.gaps.append(now - timing.t_last)
                timing.t_first = timing.t_first or now
                timing.t_last = now
                timing.n_tokens += 1
    except (OSError, ValueError, http.client.HTTPException) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return timing


#: the step histograms' sums and counts in the Prometheus text (any labels: several models are summed)
STEP_SAMPLE = re.compile(r"^llmfw_step_(decode|engine)_seconds_(sum|count)(?:\{[^}]*\})? (\S+)$", re.M)


def scrape_steps(url: str, api_key: str | None) -> dict[str, float] | None:
    """``decode_sum``, ``decode_count``, ``engine_sum``, ``engine_count`` from the server's ``/metrics`` (None when
    it has no such metrics: another server, or one that failed to answer)."""
    conn = connection(url, 30)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        response = conn.getresponse()
        text = response.read().decode("utf-8", errors="replace")
        if response.status != 200:
            return None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    totals: dict[str, float] = {}
    for part, kind, value in STEP_SAMPLE.findall(text):
        totals[f"{part}_{kind}"] = totals.get(f"{part}_{kind}", 0.0) + float(value)
    return totals if len(totals) == 4 else None


def step_profile(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """The steps a level ran: how many, their mean decode and engine milliseconds, the engine's share."""
    if before is None or after is None or after["decode_count"] <= before["decode_count"]:
        return {"steps": None, "step_decode_ms": None, "step_engine_ms": None, "engine_share": None}
    steps = after["decode_count"] - before["decode_count"]
    decode, engine = after["decode_sum"] - before["decode_sum"], after["engine_sum"] - before["engine_sum"]
    return {"steps": int(steps), "step_decode_ms": 1e3 * decode / steps, "step_engine_ms": 1e3 * engine / steps,
            "engine_share": engine / (decode + engine) if decode + engine > 0 else 0.0}


def run_level(url: str, concurrency: int, n_tokens: int, banned: list[int], api_key: str | None) -> dict[str, Any]:
    """``concurrency`` requests at once; their aggregate tokens/s, latency percentiles and (from an llmfw server)
    the engine's step profile."""
    timings: list[RequestTiming] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"model": "bench", "prompt": f"{PROMPT} {i + 1}:", "max_tokens": n_tokens, "temperature": 0,
                "stream": True, "logit_bias": {str(t): -100 for t in banned}}
        result = stream_completion(url, body, api_key)
        if result.error is None and result.n_tokens < n_tokens:
            result.error = f"the stream ended after {result.n_tokens} of {n_tokens} tokens"
        with lock:
            timings.append(result)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    steps_before = scrape_steps(url, api_key)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    steps = step_profile(steps_before, scrape_steps(url, api_key))
    wall = max((t.t_last or t0) for t in timings) - t0
    errors = [t.error for t in timings if t.error]
    total = sum(t.n_tokens for t in timings)
    ttft = [t.t_first - t.t_start for t in timings if t.t_first is not None]
    gaps = [g for t in timings for g in t.gaps]
    return {"concurrency": concurrency, "requests": concurrency, "tokens": total, "wall_s": wall,
            "aggregate_tps": total / wall if wall > 0 else 0.0,
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "tpot_p50_s": _percentile(gaps, 50), "tpot_p99_s": _percentile(gaps, 99),
            **steps, "errors": errors[:3], "n_errors": len(errors)}


# -- servers started for the run ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_serving(url: str, proc: subprocess.Popen[Any], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"{what} exited with code {proc.returncode} before serving")
        try:
            conn = connection(url, 5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise click.ClickException(f"{what} did not answer within {START_TIMEOUT_S} s")


def start_llmfw(path: str, parallel: int, n_ctx: int, threads: int, backend: str | None) -> tuple[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "llmfw.cli", "serve", "-m", path, "--port", str(port), "--parallel", str(parallel),
           "-c", str(n_ctx), "-t", str(threads)] + (["--backend", backend] if backend else [])
    return f"http://127.0.0.1:{port}", subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_llama_cpp(python: str, path: str, n_ctx: int, threads: int) -> tuple[str, Any]:
    port = free_port()
    # requests queue behind its lock instead of cutting the running stream short (its default)
    cmd = [python, "-m", "llama_cpp.server", "--model", path, "--port", str(port), "--n_threads", str(threads),
           "--n_ctx", str(n_ctx), "--interrupt_requests", "False"]
    return f"http://127.0.0.1:{port}", subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def end_of_generation_ids(path: str) -> list[int]:
    from ..core.runtime.model import load_model

    vocab = load_model(path, vocab_only=True).vocab
    return sorted(vocab.eog_ids)


def warm_up(url: str, api_key: str | None) -> None:
    stream_completion(url, {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}, api_key)


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The repetition with the median aggregate throughput (its latencies come with it)."""
    ordered = sorted(rows, key=lambda r: r["aggregate_tps"])
    row = dict(ordered[len(ordered) // 2])
    row["aggregate_tps_runs"] = [r["aggregate_tps"] for r in rows]
    row["n_errors"] = sum(r["n_errors"] for r in rows)
    row["errors"] = [e for r in rows for e in r["errors"]][:3]
    return row


def measure(servers: list[tuple[str, str, str | None]], levels: list[int], n_tokens: int, banned: list[int],
            repetitions: int) -> list[dict[str, Any]]:
    """Every level, ``repetitions`` times, the servers taking turns (so a busy machine's drift hits all alike);
    one row per server and level: the median repetition."""
    for _, url, key in servers:
        warm_up(url, key)
    rows = []
    for level in levels:
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in servers}
        for _ in range(repetitions):
            for name, url, key in servers:
                runs[name].append({"server": name, **run_level(url, level, n_tokens, banned, key)})
        for name, _, _ in servers:
            rows.append(median_row(runs[name]))
            click.echo(format_row(rows[-1]), err=True)
    return rows


HEADER = (f"{'server':<24} {'conc':>4} {'tokens':>6} {'agg t/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'tok p50':>8} {'tok p99':>8} {'engine':>7}")


def format_row(row: dict[str, Any]) -> str:
    errors = f"  ({row['n_errors']} errors: {row['errors'][0]})" if row["n_errors"] else ""
    share = "-" if row.get("engine_share") is None else f"{100 * row['engine_share']:.1f}%"
    return (f"{row['server']:<24} {row['concurrency']:>4} {row['tokens']:>6} {row['aggregate_tps']:>8.1f} "
            f"{row['ttft_p50_s'] * 1000:>7.0f}ms {row['ttft_p99_s'] * 1000:>7.0f}ms "
            f"{row['tpot_p50_s'] * 1000:>6.0f}ms {row['tpot_p99_s'] * 1000:>6.0f}ms {share:>7}{errors}")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected numbers separated by commas, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise click.BadParameter("concurrency levels must be >= 1")
    return levels


@click.command("bench-serve")
@click.argument("target")
@click.option("--concurrency", default="1,4,8,16", show_default=True, help="Concurrency levels, comma-separated.")
@click.option("-n", "--n-predict", "n_tokens", type=int, default=128, show_default=True, help="Tokens per request.")
@click.option("-np", "--parallel", type=int, default=4, show_default=True, help="Slots of the llmfw server started.")
@click.option("-c", "--n-ctx", "n_ctx", type=int, default=0, help="Context of started servers (default: fits).")
@click.option("-t", "--threads", type=int, default=2, show_default=True, help="Threads of started servers.")
@click.option("--backend", default=None, help="Backend of the llmfw server started.")
@click.option("-m", "--model", "model", default=None, help="With a URL: the model file (for its EOS token ids).")
@click.option("--api-key", default=None, help="Bearer key for the URL.")
@click.option("--compare-llama-cpp", "llama_python", default=None,
              help="Also measure llama-cpp-python's server run by this Python interpreter.")
@click.option("-r", "--repetitions", type=int, default=1, show_default=True,
              help="Runs per level and server (the servers take turns; the median is shown).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench_serve(target: str, concurrency: str, n_tokens: int, parallel: int, n_ctx: int, threads: int,
                backend: str | None, model: str | None, api_key: str | None, llama_python: str | None,
                repetitions: int, as_json: bool) -> None:
    """Benchmark TARGET: a server URL, or a model (an llmfw server is started for it)."""
    from ..core.format.catalog import resolve_model

    levels = _levels(concurrency)
    is_url = target.startswith(("http://", "https://"))
    path = str(resolve_model(model or target)) if (model or not is_url) else None
    banned = end_of_generation_ids(path) if path else []
    prompt_room = 64
    n_ctx = n_ctx or parallel * (n_tokens + prompt_room)
    started: list[Any] = []
    servers: list[tuple[str, str, str | None]] = []
    click.echo(HEADER, err=True)
    try:
        if is_url:
            servers.append(("server", target, api_key))
        else:
            url, proc = start_llmfw(str(path), parallel, n_ctx, threads, backend)
            started.append(proc)
            wait_until_serving(url, proc, "llmfw serve")
            servers.append((f"llmfw {backend or 'default'} -np {parallel}", url, None))
        if llama_python:
            if not path:
                raise click.UsageError("--compare-llama-cpp needs the model: give -m MODEL")
            url, proc = start_llama_cpp(llama_python, path, max(n_ctx, n_tokens + prompt_room), threads)
            started.append(proc)
            wait_until_serving(url, proc, "llama-cpp-python's server")
            servers.append(("llama-cpp-python", url, None))
        rows = measure(servers, levels, n_tokens, banned, repetitions)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    if as_json:
        click.echo(json.dumps({"n_tokens": n_tokens, "parallel": parallel, "threads": threads,
                               "repetitions": repetitions, "rows": rows},
                              indent=1))
    else:
        click.echo(HEADER)
        for row in rows:
            click.echo(format_row(row))
