"""What `llmfw bench` measures, shared by its llmfw worker and, pasted in as source text, by the peers' scripts
(so another interpreter needs nothing from llmfw)."""
from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from typing import Any, Callable

#: random tokens come from this seed so every backend and llama.cpp see the same ones
TOKEN_SEED = 1234
#: set in the environment of workers that take turns; the line a worker prints when it waits for its turn
TURNS_ENV = "LLMFW_BENCH_TURNS"
TURN_MARK = "@@bench worker: waiting for my turn"
#: pause before each turn: the engine before it may keep its threads spinning for a moment after a run
TURN_SETTLE_S = 0.05


def current_rss() -> int:
    """Resident set size of this process now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """Peak resident set size of this process so far, in bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def summarize(n_tokens: int, runs: list[tuple[float, float]]) -> dict[str, Any]:
    """tokens/s of each repetition (wall-clock start, seconds) → median, spread (sample stdev), min, max; the
    starts as ``runs_wall`` (Unix time, comparable across processes)."""
    seconds = [s for _, s in runs]
    rates = [n_tokens / s if s > 0 else 0.0 for s in seconds]
    return {"n_tokens": n_tokens, "runs_s": seconds, "runs_wall": [[start, start + s] for start, s in runs],
            "tps_median": statistics.median(rates),
            "tps_std": statistics.stdev(rates) if len(rates) > 1 else 0.0, "tps_min": min(rates), "tps_max": max(rates)}


def random_tokens(n_vocab: int, count: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(TOKEN_SEED).integers(0, n_vocab, size=count)]


def wait_for_turn() -> None:
    """Between two measured pieces of a worker that takes turns: say so on stdout and wait until the parent
    answers on stdin (the other engines measure meanwhile). A no-op in a worker that runs alone."""
    if os.environ.get(TURNS_ENV) != "1":
        return
    print(TURN_MARK, flush=True)
    if not sys.stdin.readline():  # the parent is gone
        sys.exit(1)


def timed_repetitions(repetitions: int, reset: Callable[[], object], run_once: Callable[[], object],
                      after_warm_up: Callable[[], object] | None = None) -> list[tuple[float, float]]:
    """A warm-up, then ``repetitions`` timed runs, each after ``reset()`` and each in its own turn; each run's
    wall-clock start and seconds."""
    wait_for_turn()
    reset()
    run_once()
    if after_warm_up is not None:
        after_warm_up()
    runs = []
    for _ in range(repetitions):
        wait_for_turn()
        reset()
        wall, start = time.time(), time.perf_counter()
        run_once()
        runs.append((wall, time.perf_counter() - start))
    return runs
