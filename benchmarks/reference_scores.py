"""Fidelity table: every reference prompt teacher-forced on every backend, scored with the reference's compare.py.

    PYTHONPATH=. python benchmarks/reference_scores.py [--backends numpy,torch,onnx] [--models smollm2,gemma-3-270m]

Prints one row per (backend, model, prompt) with top1 / top5 / mean_lp_err / max_lp_err, so that a change to the
compiler (graph passes, kernels) can be shown to leave every score unchanged: run it before and after and diff.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import llmfw
from llmfw.core.format.catalog import resolve_model

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "reference"
REFERENCES = {"smollm2": "smollm2-135m-instruct-q4_1.json", "gemma-3-270m": "gemma-3-270m-q4_k_m.json"}


def load_score():
    spec = importlib.util.spec_from_file_location("reference_compare", REFERENCE_DIR / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="numpy,torch,onnx")
    parser.add_argument("--models", default="smollm2,gemma-3-270m")
    parser.add_argument("--n-ubatch", type=int, default=512)
    args = parser.parse_args()
    score = load_score()
    print("| backend | model | prompt | n | top1 | top5 | mean_lp_err | max_lp_err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for backend in args.backends.split(","):
        for name in args.models.split(","):
            reference = json.loads((REFERENCE_DIR / REFERENCES[name]).read_text())
            with llmfw.load_model(resolve_model(name), backend=backend) as model:
                for index, record in enumerate(reference["prompts"]):
                    sequence = record["sequence"]
                    ctx = model.new_context(n_ctx=len(sequence), n_batch=len(sequence), n_ubatch=args.n_ubatch,
                                            n_threads=1)
                    assert ctx.decode(llmfw.Batch(sequence, logits=True)) == 0, ctx.last_error
                    r = score(record, ctx.get_logits())
                    ctx.close()
                    print(f"| {backend} | {name} | {index} | {r['n']} | {r['top1']:.4f} | {r['top5']:.4f} | "
                          f"{r['mean_lp_err']:.5f} | {r['max_lp_err']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
