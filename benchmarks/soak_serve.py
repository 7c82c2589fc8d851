"""Soak: minutes of mixed traffic against a real ``llmfw serve`` on 127.0.0.1, at twice its slots.

    nice -n 10 python benchmarks/soak_serve.py [--minutes 20] [--model smollm2] [-np 2] [--backend numpy]

Traffic, drawn at random by ``2 * np`` concurrent clients: OpenAI chat and completions, streamed and not;
constrained output (``response_format`` json_schema, llama-server's ``grammar``); tool calls (``tool_choice``
required, the server started with a tool-capable chat template); streams the client cancels after a few events;
prompts larger than a slot; garbage bodies; Anthropic ``/v1/messages`` streamed and not, and ``count_tokens``;
embeddings and tokenize. What each kind must answer is fixed (200, or 400 for the oversized and garbage ones):
anything else counts as ``unexpected``.

Reported as JSON (``benchmarks/results/serving/soak_serve.json`` unless ``--out``): counts by kind and status, the 5xx
count, leaked slots (``llmfw_requests_running`` and ``llmfw_requests_waiting`` from ``/metrics`` once the
traffic stopped), the server's RSS after warm-up and at the end and its growth in percent. The targets (exit 1
when missed): 0 responses 5xx, 0 unexpected, 0 leaked slots, RSS growth at most 5 %.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.serve_process import llmfw_serve  # noqa: E402

#: a chat template that knows tools (Qwen2.5's: ChatML, whose tokens SmolLM2's vocabulary has)
TOOL_TEMPLATE = ROOT / "tests" / "data" / "tool_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PET_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
YES_NO_GRAMMAR = 'root ::= ("yes" | "no") " because " [a-z ]{1,20}'
GARBAGE = [b"", b"{", b"[]", b"\xff\xfe\x00", b'{"messages": 3}', b'{"prompt": {"a": 1}}', b"null",
           b'{"messages": [{"role": "wizard"}]}', b'{"max_tokens": -5, "prompt": "x"}', b'{"temperature": NaN}']
PROMPTS = ["Tell me about lighthouses.", "What is 2 + 2?", "Write a haiku about rain.", "Name three colours.",
           "Why is the sky blue?", "Say hello in French."]
#: seconds a request may take before the client gives up (a hang counts as a failure, not a wait)
REQUEST_TIMEOUT = 300


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def gauge(metrics_text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", metrics_text, re.M)
    return float(match.group(1)) if match else float("nan")


# -- one request of each kind: returns the status (and consumes the answer as a client would) ---------------------
def _chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": random.randint(4, 24), **extra}


def _messages(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": "x", "max_tokens": random.randint(4, 24), "messages": [{"role": "user", "content": prompt}],
            **extra}


async def _post(client: httpx.AsyncClient, path: str, body: Any) -> int:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = await client.post(path, **kwargs)
    return response.status_code


def _is_error_event(data: str) -> bool:
    try:
        event = json.loads(data)
    except ValueError:
        return data.strip() != "[DONE]"
    return isinstance(event, dict) and ("error" in event or event.get("type") == "error")


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], cancel_after: int | None = None) -> int:
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        lines = 0
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                lines += 1
                if response.status_code == 200 and _is_error_event(line[5:]):
                    return 590  # an error event mid-stream: counted apart from real statuses
            if cancel_after is not None and lines >= cancel_after:
                break  # leaving the block closes the connection: the server must free the slot
        return response.status_code


def traffic(slot_tokens: int) -> dict[str, tuple[int, Callable[[httpx.AsyncClient], Awaitable[int]]]]:
    """kind -> (expected status, request)."""
    oversized = "lighthouse " * (slot_tokens + 64)
    p = lambda: random.choice(PROMPTS)  # noqa: E731 - a fresh prompt per request
    return {
        "chat": (200, lambda c: _post(c, "/v1/chat/completions", _chat(p()))),
        "chat_stream": (200, lambda c: _stream(c, "/v1/chat/completions", _chat(p()))),
        "completion": (200, lambda c: _post(c, "/v1/completions", {"prompt": p(), "max_tokens": 16})),
        "completion_stream": (200, lambda c: _stream(c, "/v1/completions", {"prompt": p(), "max_tokens": 16})),
        "json_schema": (200, lambda c: _post(c, "/v1/chat/completions", _chat(
            "Describe a pet as JSON.", max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}))),
        "grammar_stream": (200, lambda c: _stream(c, "/v1/chat/completions", _chat(
            "Is water wet?", grammar=YES_NO_GRAMMAR, max_tokens=30))),
        "tool_call": (200, lambda c: _post(c, "/v1/chat/completions", _chat(
            "Weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required", max_tokens=40))),
        "tool_call_stream": (200, lambda c: _stream(c, "/v1/chat/completions", _chat(
            "Weather in Oslo?", tools=[WEATHER_TOOL], tool_choice="required", max_tokens=40))),
        "cancelled_stream": (200, lambda c: _stream(c, "/v1/chat/completions", _chat(p(), max_tokens=200),
                                                     cancel_after=3)),
        "oversized": (400, lambda c: _post(c, "/v1/chat/completions", _chat(oversized))),
        "oversized_messages": (400, lambda c: _post(c, "/v1/messages", _messages(oversized))),
        "garbage": (400, lambda c: _post(c, random.choice(["/v1/chat/completions", "/v1/completions",
                                                           "/v1/messages", "/v1/embeddings"]),
                                         random.choice(GARBAGE))),
        "messages": (200, lambda c: _post(c, "/v1/messages", _messages(p()))),
        "messages_stream": (200, lambda c: _stream(c, "/v1/messages", _messages(p()))),
        "messages_tool": (200, lambda c: _post(c, "/v1/messages", _messages(
            "Weather in Rome?", max_tokens=40, tool_choice={"type": "any"},
            tools=[{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]))),
        "messages_cancelled": (200, lambda c: _stream(c, "/v1/messages", _messages(p(), max_tokens=200),
                                                       cancel_after=3)),
        "count_tokens": (200, lambda c: _post(c, "/v1/messages/count_tokens",
                                              {"model": "x", "messages": [{"role": "user", "content": p()}]})),
        "embeddings": (200, lambda c: _post(c, "/v1/embeddings", {"input": [p(), p()]})),
        "tokenize": (200, lambda c: _post(c, "/tokenize", {"content": p()})),
    }


# -- the run ------------------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, url: str, kinds: dict[str, tuple[int, Any]], pid: int):
        self.url, self.kinds, self.pid = url, kinds, pid
        self.counts: Counter[tuple[str, int]] = Counter()
        self.seconds: Counter[str] = Counter()  # time spent per kind, for the mean latency
        self.unexpected: list[dict[str, Any]] = []
        self.rss: list[tuple[float, int]] = []

    async def client_loop(self, deadline: float, seed: int) -> None:
        rng = random.Random(seed)
        names = sorted(self.kinds)
        async with httpx.AsyncClient(base_url=self.url, timeout=REQUEST_TIMEOUT) as client:
            while time.monotonic() < deadline:
                kind = rng.choice(names)
                expected, request = self.kinds[kind]
                started = time.monotonic()
                try:
                    status = await request(client)
                except httpx.HTTPError as exc:
                    status = 599  # the connection failed or timed out: the server hung or died
                    self.unexpected.append({"kind": kind, "error": repr(exc)})
                self.counts[(kind, status)] += 1
                self.seconds[kind] += time.monotonic() - started
                if status != expected and status != 599:
                    self.unexpected.append({"kind": kind, "status": status})

    async def sample_rss(self, deadline: float) -> None:
        start = time.monotonic()
        while time.monotonic() < deadline:
            self.rss.append((time.monotonic() - start, rss_bytes(self.pid)))
            await asyncio.sleep(5)

    async def run(self, seconds: float, clients: int) -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(self.sample_rss(deadline),
                             *(self.client_loop(deadline, seed) for seed in range(clients)))


async def slots_after(url: str, wait_s: float = 60) -> tuple[float, float]:
    """``llmfw_requests_running`` and ``_waiting`` once they reach 0 (or after ``wait_s``)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        end = time.monotonic() + wait_s
        while True:
            text = (await client.get("/metrics")).text
            running, waiting = gauge(text, "llmfw_requests_running"), gauge(text, "llmfw_requests_waiting")
            if (running == 0 and waiting == 0) or time.monotonic() > end:
                return running, waiting
            await asyncio.sleep(1)


def report(soak: Soak, args: argparse.Namespace, seconds: float, slots: tuple[float, float],
           alive: int) -> dict[str, Any]:
    warm = [b for t, b in soak.rss if t >= args.warmup]
    rss_warm, rss_end = (warm[0], warm[-1]) if warm else (0, 0)
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, status), count in sorted(soak.counts.items()):
        by_kind.setdefault(kind, {})[str(status)] = count
    by_status = Counter(str(status) for (_, status), n in soak.counts.items() for _ in range(n))
    return {
        "model": args.model, "backend": args.backend, "parallel": args.parallel, "clients": 2 * args.parallel,
        "n_ctx": args.n_ctx, "seconds": round(seconds, 1), "warmup_s": args.warmup,
        "requests": sum(soak.counts.values()), "by_status": dict(sorted(by_status.items())), "by_kind": by_kind,
        "mean_seconds_by_kind": {kind: round(soak.seconds[kind] / sum(by_kind[kind].values()), 2) for kind in by_kind},
        "responses_5xx": sum(n for (_, s), n in soak.counts.items() if 500 <= s < 600),
        "unexpected": len(soak.unexpected), "unexpected_first": soak.unexpected[:10],
        "requests_running_after": slots[0], "requests_waiting_after": slots[1],
        "leaked_slots": int(slots[0] + slots[1]) if slots[0] == slots[0] else -1,
        "rss_after_warmup_mb": round(rss_warm / 2**20, 1), "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_max_mb": round(max((b for _, b in soak.rss), default=0) / 2**20, 1),
        "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2) if rss_warm else None,
        "healthy_after": alive == 200,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("-np", "--parallel", type=int, default=2)
    parser.add_argument("-c", "--n-ctx", type=int, default=2048)
    parser.add_argument("--backend", default=None, help="default: the server's choice (the fastest)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds before RSS is compared (default: "
                                                                     "a tenth of the run, at least 30)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving" / "soak_serve.json")
    parser.add_argument("--server-log", type=Path, default=Path("/tmp/llmfw-soak-server.log"))
    args = parser.parse_args()
    seconds = args.minutes * 60
    args.warmup = args.warmup if args.warmup is not None else max(30.0, seconds / 10)
    serve_args = ["-m", args.model, "-np", str(args.parallel), "-c", str(args.n_ctx), "--no-webui",
                  "--chat-template", str(TOOL_TEMPLATE)] + (["--backend", args.backend] if args.backend else [])
    with llmfw_serve(serve_args, args.server_log) as (url, server):
        soak = Soak(url, traffic(args.n_ctx // args.parallel), server.pid)
        t0 = time.monotonic()
        asyncio.run(soak.run(seconds, 2 * args.parallel))
        elapsed = time.monotonic() - t0
        slots = asyncio.run(slots_after(url))
        alive = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).status_code
        result = report(soak, args, elapsed, slots, alive)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "by_kind"}, indent=2))
    ok = (result["responses_5xx"] == 0 and result["unexpected"] == 0 and result["leaked_slots"] == 0
          and (result["rss_growth_pct"] or 0) <= 5 and result["healthy_after"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
