"""Time opening both real models with llmfw's GGUF reader: header, metadata (incl. the vocabulary) and the
tensor map, then close. Prints the median and the best of several repetitions per model and mode.

    python3 benchmarks/open_models.py [--repeat 7] [--mode mmap|read|both] [MODEL ...]

MODEL is a catalog name or a path (default: smollm2 and gemma-3-270m).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from llmfw.core.format.catalog import resolve_model
from llmfw.core.format.gguf import open_gguf

DEFAULT_MODELS = ("smollm2", "gemma-3-270m")


def time_open(path: Path, mode: str, repeat: int) -> tuple[list[float], int, int, int]:
    """Milliseconds per open+close, and (keys, tensors, vocabulary size) of the last open."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        g = open_gguf(path, mode)
        times.append((time.perf_counter() - start) * 1e3)
        keys, tensors = len(g.metadata), len(g.tensors)
        vocab = len(g.metadata.get("tokenizer.ggml.tokens", ()))
        g.close()
    return times, keys, tensors, vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--mode", choices=("mmap", "read", "both"), default="both")
    args = parser.parse_args()
    modes = ("mmap", "read") if args.mode == "both" else (args.mode,)
    print(f"{'model':16} {'mode':5} {'median ms':>10} {'best ms':>9} {'keys':>5} {'tensors':>8} {'vocab':>7}")
    for model in args.models:
        path = resolve_model(model)
        for mode in modes:
            time_open(path, mode, 1)  # warm the page cache so every mode measures parsing, not the disk
            times, keys, tensors, vocab = time_open(path, mode, args.repeat)
            print(f"{model:16} {mode:5} {statistics.median(times):10.1f} {min(times):9.1f} {keys:5} {tensors:8} "
                  f"{vocab:7}")


if __name__ == "__main__":
    main()
