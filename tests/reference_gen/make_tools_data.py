"""Write tests/data/tools/llama_cpp_tools.json: llama.cpp's perplexity and embeddings for the tools tests.

    python tests/reference_gen/make_tools_data.py --llama-python /tmp/lcpp/bin/python

(run with llmfw's interpreter: it resolves the catalog models; llama-cpp-python runs in the other one through
make_tools_reference.py). Embedding vectors are stored rounded to 6 decimals (unit vectors: the rounding moves
a cosine by < 1e-9). Each pooling also keeps llama.cpp's vectors with flash attention on (``flash_attn``): the
tests measure our distance to llama.cpp against the distance between llama.cpp's two attention paths.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
DATA = ROOT / "tests" / "data" / "tools"
TEXT = DATA / "lighthouses.txt"
#: (n_ctx, chunks) of the perplexity numbers the suite checks
PPL_RUNS = [(128, -1)]
EMBED_TEXTS = ["Hello world", "The capital of France is Paris.",
               "A lighthouse sends out a beam of light so that ships can find the harbour at night.",
               "Привіт, світе! Як справи?", "def add(a, b):\n    return a + b"]
POOLINGS = ["mean", "cls", "last", "none"]
MODELS = {"smollm2": "smollm2", "gemma3": "gemma-3-270m"}


def _call(python: str, *args: str) -> dict:
    script = ROOT / "tests" / "reference_gen" / "make_tools_reference.py"
    out = subprocess.run([python, str(script), *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _round(value):
    if isinstance(value, list):
        return [_round(v) for v in value]
    return round(float(value), 6) if value is not None else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-python", required=True)
    args = parser.parse_args()
    from llmfw.core.format.catalog import resolve_model

    out: dict = {"provenance": "llama-cpp-python 0.3.36 (llama.cpp vendored in it), CPU build with AMX off, "
                               "2 threads; tests/reference_gen/make_tools_data.py", "models": {}}
    for key, name in MODELS.items():
        path = str(resolve_model(name))
        entry: dict = {"file": Path(path).name, "perplexity": [], "embeddings": {}}
        for n_ctx, chunks in PPL_RUNS:
            entry["perplexity"].append(_call(args.llama_python, "perplexity", path, str(TEXT), str(n_ctx), str(chunks)))
        for pooling in POOLINGS:
            texts = EMBED_TEXTS if pooling != "none" else EMBED_TEXTS[:2]
            result = _call(args.llama_python, "embed", path, pooling, *texts)
            result["one_by_one"] = _round(result["one_by_one"])
            result["batched"] = _round(result["batched"])
            flash = _call(args.llama_python, "embed-flash-attn", path, pooling, *texts)
            result["flash_attn"] = {"one_by_one": _round(flash["one_by_one"]), "batched": _round(flash["batched"])}
            entry["embeddings"][pooling] = result
        out["models"][key] = entry
        print(key, [p["ppl"] for p in entry["perplexity"]], flush=True)
    (DATA / "llama_cpp_tools.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
