"""Time tokenizing the seed document (258 KB of Ukrainian prose and code) with both real models, next to
llama.cpp's time on these machines (~120 ms SmolLM2, ~178 ms Gemma-3; the target is at most 3x that).

    python3 benchmarks/tokenize_bench.py [--repeat 3] [--parse-special] [--text FILE] [MODEL ...]

"cold" is the first tokenization after the tokenizer's per-word cache was cleared (what a single llama.cpp call
does); "warm" repeats it with the cache filled. Times are the best of --repeat runs, wall clock and CPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from llmfw.core.format.catalog import resolve_model  # noqa: E402
from llmfw.core.tokenizer.vocab import Vocab  # noqa: E402

LLAMA_CPP_MS = {"smollm2": 120.0, "gemma-3-270m": 178.0}
DEFAULT_TEXT = ROOT.parent / "shared" / "seed" / "000_5d2b87c55653f871.txt"


def best_of(repeat: int, run) -> tuple[float, float]:
    """Best wall-clock and best CPU milliseconds of ``repeat`` calls."""
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append((time.perf_counter() - wall) * 1e3)
        cpus.append((time.process_time() - cpu) * 1e3)
    return min(walls), min(cpus)


def bench_model(name: str, text: str, repeat: int, parse_special: bool) -> None:
    start = time.perf_counter()
    vocab = Vocab.from_file(resolve_model(name))
    load_ms = (time.perf_counter() - start) * 1e3
    n_tokens = len(vocab.tokenize(text, True, parse_special))

    def cold() -> None:
        vocab.tokenizer.clear_cache()
        vocab.tokenize(text, True, parse_special)

    cold_wall, cold_cpu = best_of(repeat, cold)
    warm_wall, warm_cpu = best_of(repeat, lambda: vocab.tokenize(text, True, parse_special))
    reference = LLAMA_CPP_MS.get(name)
    ratio = f"{cold_wall / reference:5.2f}x" if reference else "    -"
    print(f"{name:14} {vocab.model:5} {n_tokens:8d} {load_ms:8.0f} {cold_wall:9.1f} {cold_cpu:8.1f} "
          f"{warm_wall:9.1f} {warm_cpu:8.1f} {reference or float('nan'):9.0f} {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(LLAMA_CPP_MS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--parse-special", action="store_true")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    args = parser.parse_args()
    text = args.text.read_text(encoding="utf-8")
    print(f"text: {args.text.name}, {len(text.encode('utf-8'))} bytes; parse_special={args.parse_special}")
    print(f"{'model':14} {'type':5} {'tokens':>8} {'load ms':>8} {'cold ms':>9} {'cpu ms':>8} {'warm ms':>9} "
          f"{'cpu ms':>8} {'llama.cpp':>9} cold/llama.cpp")
    for name in args.models:
        bench_model(name, text, args.repeat, args.parse_special)


if __name__ == "__main__":
    main()
