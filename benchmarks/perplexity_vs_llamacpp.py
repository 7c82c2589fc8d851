"""Perplexity of a text with every CPU backend against llama.cpp (llama-cpp-python in another interpreter).

    python benchmarks/perplexity_vs_llamacpp.py TEXT [--n-ctx 512] [--chunks 20] [--backends numpy,torch,onnx]
        [--models smollm2,gemma-3-270m] [--llama-python /tmp/lcpp/bin/python] [--json OUT]

Prints one row per model and backend: PPL, stderr, seconds, and the difference to llama.cpp's PPL (computed
by tests/reference_gen/make_tools_reference.py, llama-perplexity's method) when --llama-python is given.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def llama_cpp_ppl(python: str, model_path: Path, text: str, n_ctx: int, chunks: int) -> dict:
    script = ROOT / "tests" / "reference_gen" / "make_tools_reference.py"
    out = subprocess.run([python, str(script), "perplexity", str(model_path), text, str(n_ctx), str(chunks)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("text")
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--backends", default="numpy,torch,onnx")
    parser.add_argument("--models", default="smollm2,gemma-3-270m")
    parser.add_argument("--llama-python", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import llmfw
    from llmfw.core.format.catalog import resolve_model
    from llmfw.core.generation.perplexity import perplexity_of_tokens, perplexity_tokens

    text = Path(args.text).read_text(encoding="utf-8")
    rows = []
    for name in args.models.split(","):
        path = resolve_model(name)
        ref = llama_cpp_ppl(args.llama_python, path, args.text, args.n_ctx, args.chunks) if args.llama_python else None
        if ref:
            print(f"{name:14s} llama.cpp   PPL {ref['ppl']:.4f} +/- {ref['stderr']:.5f}", flush=True)
        for backend in args.backends.split(","):
            model = llmfw.load_model(path, backend=backend)
            tokens = perplexity_tokens(model, text)
            t0 = time.perf_counter()
            with model.new_context(n_ctx=args.n_ctx, n_batch=args.n_ctx, n_ubatch=args.n_ctx) as ctx:
                result = perplexity_of_tokens(ctx, tokens, args.n_ctx, n_chunks=args.chunks)
            seconds = time.perf_counter() - t0
            row = {"model": name, "backend": backend, "n_ctx": args.n_ctx, "n_chunks": result.n_chunks,
                   "ppl": result.ppl, "stderr": result.stderr, "seconds": seconds}
            if ref:
                row["llama_cpp_ppl"] = ref["ppl"]
                row["rel_diff"] = result.ppl / ref["ppl"] - 1
            rows.append(row)
            diff = f"  vs llama.cpp {100 * row['rel_diff']:+.3f} %" if ref else ""
            print(f"{name:14s} {backend:11s} PPL {result.ppl:.4f} +/- {result.stderr:.5f}  {seconds:6.1f} s{diff}",
                  flush=True)
            model.close()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
