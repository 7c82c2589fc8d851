"""One decode step's native attention alone: the time of ``kernels.attention`` per layer.

    python3 benchmarks/native_attention.py [--seqs 1] [--depth 2048] [--heads 9:3] [--dim 64] [--layers 8]
                                           [-t 2] [--isa avx512] [--kv f16] [-r 100]

``--seqs`` sequences decode one token each over ``--depth`` cells apiece, their cells in runs of 32 as the KV cache
places sequences decoded together (``--layout interleaved``: taking turns cell by cell, as llama.cpp's cache
does). ``--layers`` caches of their own are attended in turn, so a run's keys and values come from wherever that
many layers' caches fit: 8 SmolLM2-shaped layers at depth 2,048 (12 MB) stay in a large L3, 60 (90 MB) come from
memory, as in a real step whose weights stream between the attention ops. ``--heads`` is query heads:KV heads
(SmolLM2 9:3, Gemma-3 4:1 with ``--dim 256``). Prints the best and the median per layer of ``-r`` rounds; the
Python call around each op (a few microseconds) is included.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from llmfw.core.runtime.kv_cache import RUN_CELLS  # noqa: E402
from llmfw.plugins.backends.native import kernels  # noqa: E402


def head_counts(text: str) -> tuple[int, int]:
    """'9:3' → (9, 3): query heads and KV heads, the first a multiple of the second."""
    try:
        n_head, n_head_kv = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"heads {text!r}: expected QUERY:KV, e.g. 9:3") from None
    if n_head_kv < 1 or n_head < n_head_kv or n_head % n_head_kv:
        raise argparse.ArgumentTypeError(f"heads {text!r}: the query heads must be a multiple of the KV heads")
    return n_head, n_head_kv


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive integer")
    return value


def seconds_per_layer(args: argparse.Namespace) -> list[float]:
    """Per round: the seconds one layer's attention took, the rounds' layers taken in turn."""
    rng = np.random.default_rng(0)
    n_head, n_head_kv = args.heads
    n_kv = args.seqs * args.depth
    dtype = np.float16 if args.kv == "f16" else np.float32
    caches = [(rng.standard_normal((n_head_kv, n_kv, args.dim)).astype(dtype),
               rng.standard_normal((n_head_kv, n_kv, args.dim)).astype(dtype)) for _ in range(args.layers)]
    q = rng.standard_normal((args.seqs, n_head, args.dim)).astype(np.float32)
    if args.layout == "interleaved":
        owner = np.arange(n_kv) % args.seqs  # cell j belongs to sequence j % seqs
    else:  # blocks of RUN_CELLS cells, the sequences' blocks taking turns
        owner = np.arange(n_kv) // RUN_CELLS % args.seqs
    mask = np.where(owner[None, :] == np.arange(args.seqs)[:, None], 0.0, -np.inf).astype(np.float32)
    pool = kernels.ThreadPool(args.threads)
    try:
        rounds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for k, v in caches:
                kernels.attention(q, k, v, mask, args.dim ** -0.5, 0.0, pool, args.isa)
            rounds.append((time.perf_counter() - start) / args.layers)
        return rounds
    finally:
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=positive, default=1, help="sequences decoding together (one row each)")
    parser.add_argument("--depth", type=positive, default=2048, help="cells each sequence sees")
    parser.add_argument("--heads", type=head_counts, default=(9, 3), help="query heads:KV heads (default 9:3)")
    parser.add_argument("--dim", type=positive, default=64, help="key and value dimensions of a head")
    parser.add_argument("--layers", type=positive, default=8, help="layers' caches attended in turn")
    parser.add_argument("-t", "--threads", type=positive, default=2)
    parser.add_argument("--isa", default="auto", choices=("auto", *kernels.available_isas()))
    parser.add_argument("--kv", default="f16", choices=("f16", "f32"), help="the cache's element type")
    parser.add_argument("-r", "--rounds", type=positive, default=100)
    parser.add_argument("--layout", default="runs", choices=("runs", "interleaved"),
                        help="where each sequence's cells lie (default: runs, as the KV cache places them)")
    args = parser.parse_args()
    rounds = seconds_per_layer(args)
    n_head, n_head_kv = args.heads
    print(f"{args.seqs} x {args.depth} cells ({args.layout}), {n_head}:{n_head_kv} heads of {args.dim}, "
          f"{args.kv} cache, {args.layers} layers, {args.threads} threads, {kernels.resolve_isa(args.isa)}: "
          f"{min(rounds) * 1e6:.1f} us a layer best, {statistics.median(rounds) * 1e6:.1f} median")


if __name__ == "__main__":
    main()
