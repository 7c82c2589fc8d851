"""Time the numpy backend: one-token decodes (tg) and one batched prefill (pp), in CPU time and wall time.

On a shared CPU, CPU seconds (``time.process_time``) are the repeatable figure; wall seconds are printed too.
``--profile tg`` / ``--profile pp`` prints a CPU-time cProfile of that test (where the time goes).

    PYTHONPATH=. python3 benchmarks/numpy_decode.py [--model smollm2] [--tg 32] [--pp 512] [--threads 1]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

import llmfw
from llmfw.core.format.catalog import resolve_model


def timed(fn) -> tuple[float, float]:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu0, time.perf_counter() - wall0


def profiled(fn, profile: bool) -> tuple[float, float]:
    """``timed(fn)``, under a CPU-time cProfile (printed) when ``profile``."""
    if not profile:
        return timed(fn)
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    result = timed(fn)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="catalog name or GGUF path")
    ap.add_argument("--tg", type=int, default=32, help="one-token decodes to time (0 = skip)")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens of the prefill (0 = skip)")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads")
    ap.add_argument("--profile", choices=["tg", "pp"], help="cProfile (CPU time) the tg or pp run")
    args = ap.parse_args()

    model = llmfw.load_model(resolve_model(args.model), backend="numpy")
    rng = np.random.default_rng(0)
    ctx = model.new_context(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=args.threads)
    if args.pp:
        tokens = rng.integers(0, model.n_vocab, args.pp).tolist()
        ctx.decode(llmfw.Batch(tokens[:8]))  # warm-up
        ctx.memory.clear()
        cpu, wall = profiled(lambda: ctx.decode(llmfw.Batch(tokens)), args.profile == "pp")
        print(f"pp{args.pp}: {args.pp / cpu:8.1f} tok/CPU-s  {args.pp / wall:8.1f} tok/s wall")
        ctx.memory.clear()

    def decode_steps() -> None:
        for _ in range(args.tg):
            assert ctx.decode(llmfw.Batch([int(rng.integers(0, model.n_vocab))])) == 0

    ctx.decode(llmfw.Batch([1]))  # warm-up and graph build
    cpu, wall = profiled(decode_steps, args.profile == "tg")
    print(f"tg{args.tg}: {args.tg / cpu:8.1f} tok/CPU-s  {args.tg / wall:8.1f} tok/s wall  "
          f"(builds {ctx.n_graph_builds}, reuses {ctx.n_graph_reuses})")


if __name__ == "__main__":
    main()
