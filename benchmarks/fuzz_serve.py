"""Fuzz ``llmfw serve`` from its own ``/openapi.json`` with schemathesis: every operation, bodies that match the
published schemas (positive) and bodies that break them (negative), against a real server on 127.0.0.1.

    nice -n 10 python benchmarks/fuzz_serve.py [--cases 3000] [--model smollm2] [--seed 0] [--json FILE]

Each response must be below 500, and each 4xx must be an error in its API's own shape: Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages*``, OpenAI's ``{"error": {"message",
"type", ...}}`` everywhere else. Generation is kept to a few tokens per case (``max_tokens`` and ``n`` are
clamped before sending), so the run measures the request handling, not the decoder.
tests/reference/test_serving_openapi.py runs a few hundred cases of the same fuzz. Exit 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: most tokens a fuzz case may generate, and most choices (the fields are clamped to these)
MAX_FUZZ_TOKENS = 4
MAX_FUZZ_CHOICES = 2
#: the endpoints that generate tokens
GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
#: seconds one request may take (a hang is a failure)
REQUEST_TIMEOUT = 120
#: cases per operation and generation mode in one round
ROUND_CASES = 10


@dataclass
class Tally:
    """Statuses per operation and the cases that failed (a 5xx, a 4xx in the wrong shape, no answer)."""

    counts: Counter[tuple[str, int]] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def cases(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict[str, Any]:
        by_operation: dict[str, dict[str, int]] = {}
        for (label, status), n in sorted(self.counts.items()):
            by_operation.setdefault(label, {})[str(status)] = n
        return {"cases": self.cases, "responses_5xx": sum(n for (_, s), n in self.counts.items() if s >= 500),
                "failures": len(self.failures), "first_failures": self.failures[:10], "by_operation": by_operation}


def error_shape_problem(path: str, body: bytes) -> str | None:
    """What is wrong with a 4xx body for its API (None: it is that API's error shape)."""
    try:
        error = json.loads(body)
    except ValueError:
        return "the error body is not JSON"
    if not isinstance(error, dict) or not isinstance(error.get("error"), dict):
        return "no error object"
    inner = error["error"]
    if path.startswith("/v1/messages"):  # Anthropic's shape
        ok = error.get("type") == "error" and isinstance(inner.get("type"), str) and inner.get("message")
    else:
        ok = isinstance(inner.get("message"), str) and inner["message"] and isinstance(inner.get("type"), str)
    return None if ok else "not the API's error shape"


def clamp_generation(path: str, body: Any) -> Any:
    """The body with ``max_tokens`` / ``max_completion_tokens`` and ``n`` cut to what a fuzz case may cost, and
    ``max_tokens`` set on a generation endpoint that was given none or null (chat's default is the slot's room); other
    values, wrong types included, go as they are."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_FUZZ_TOKENS:
            body[key] = MAX_FUZZ_TOKENS
    if path in GENERATING and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_FUZZ_TOKENS  # null is the default too: the slot's room on chat
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_FUZZ_CHOICES:
        body["n"] = MAX_FUZZ_CHOICES
    return body


def _sent(body: Any) -> str:
    """The body as sent, for the report (schemathesis' curl line masks every key with "token" in its name)."""
    try:
        return json.dumps(body)[:4000]
    except (TypeError, ValueError):
        return repr(body)[:4000]


def check(path: str, status: int, body: bytes) -> str | None:
    if status >= 500:
        return f"status {status}"
    if status >= 400:
        return error_shape_problem(path, body)
    return None


class _OutOfTime(Exception):
    pass


def fuzz(url: str, spec: dict[str, Any], cases: int, seed: int = 0, max_seconds: float | None = None) -> Tally:
    """About ``cases`` requests over the spec's operations, positive and negative, in rounds of
    ``ROUND_CASES`` per operation and mode (each round a new seed), so that a run stopped by ``max_seconds``
    still covered every operation."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_dict(spec)
    runs = [(result.ok(), mode) for result in schema.get_all_operations() for mode in GenerationMode]
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    tally = Tally()
    exhausted: set[int] = set()  # runs with no more cases to give (a GET without parameters has one)
    round_seed = seed * 1_000_003
    while tally.cases < cases and len(exhausted) < len(runs):
        for index, (operation, mode) in enumerate(runs):
            if index in exhausted or tally.cases >= cases:
                continue
            before = tally.cases
            try:
                _fuzz_round(url, operation, mode, round_seed, tally, deadline)
            except _OutOfTime:
                return tally
            if tally.cases - before < ROUND_CASES:
                exhausted.add(index)
        round_seed += 1
    return tally


def _fuzz_round(url: str, operation: Any, mode: Any, seed: int, tally: Tally, deadline: float | None) -> None:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable

    @hypothesis_seed(seed)
    @settings(max_examples=ROUND_CASES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise _OutOfTime
        case.body = clamp_generation(case.path, case.body)
        label = f"{case.method} {case.path}"
        try:
            response = case.call(base_url=url, timeout=REQUEST_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - no answer (a hang, a dropped connection) is a failure
            tally.counts[(label, 599)] += 1
            tally.failures.append({"operation": label, "problem": repr(exc), "body": _sent(case.body)})
            return
        tally.counts[(label, response.status_code)] += 1
        problem = check(case.path, response.status_code, response.content)
        if problem:
            tally.failures.append({"operation": label, "mode": mode.value, "problem": problem,
                                   "status": response.status_code, "answer": response.text[:300],
                                   "body": _sent(case.body)})

    try:
        run()
    except Unsatisfiable:  # e.g. negative cases of a GET without parameters: there are none
        pass


def main() -> None:
    import httpx

    from benchmarks.serve_process import llmfw_serve

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=None, help="stop after this long (default: no limit)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "serving" / "fuzz_serve.json")
    parser.add_argument("--server-log", type=Path, default=Path("/tmp/llmfw-fuzz-server.log"))
    args = parser.parse_args()
    serve_args = ["-m", args.model, "-np", "2", "-c", "1024"] + (["--backend", args.backend] if args.backend else [])
    with llmfw_serve(serve_args, args.server_log) as (url, _):
        spec = httpx.get(url + "/openapi.json", timeout=30).json()
        t0 = time.monotonic()
        tally = fuzz(url, spec, args.cases, args.seed, args.minutes and args.minutes * 60)
        result = {"model": args.model, "seed": args.seed, "seconds": round(time.monotonic() - t0, 1),
                  "operations": len([m for p in spec["paths"].values() for m in p]), **tally.summary()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "by_operation"}, indent=2))
    sys.exit(1 if tally.failures else 0)


if __name__ == "__main__":
    main()
