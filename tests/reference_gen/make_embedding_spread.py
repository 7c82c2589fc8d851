"""Write tests/data/tools/llama_cpp_spread.json: how far llama.cpp's own builds land from the committed vectors.

The embedding tests compare llmfw's vectors with llama.cpp's (tests/data/tools/llama_cpp_tools.json, one build on
one CPU). A margin read off that one run's digits fails on the next machine kind: llama.cpp itself moves with
its SIMD path (8-bit activation roundings, summation orders), and so does llmfw with its kernels. This script
measures that spread: the same texts embedded by llama.cpp builds of the same source (llama-cpp-python 0.3.36's
vendored llama.cpp) whose CPU library was compiled for other instruction sets, with flash attention off and on.
For each model and pooling it records the worst cosine similarity between any of those runs and the committed
vectors; the tests take the lowest of these (and of the committed flash-attention run) as llama.cpp's own noise
floor.

Run it with llmfw's interpreter from a throw-away environment holding llama-cpp-python 0.3.36 and one folder of
llama.cpp shared libraries per build (``libllama.so``, ``libggml*.so``; only ``libggml-cpu.so`` differs,
built by cmake from the same sources with the flags named on the command line)::

    python tests/reference_gen/make_embedding_spread.py --llama-python /tmp/llcpp/venv/bin/python \\
        --build avx2=/tmp/libs-avx2 --build avx2-no-fma=/tmp/libs-avx2nofma --build avx512=/tmp/libs-avx512

``--flags NAME="cmake flags"`` records how each build was made (provenance only).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "tools"
POOLINGS = ("mean", "cls", "last")


def _embed(python: str, lib_dir: str, mode: str, path: str, pooling: str, texts: list[str]) -> dict:
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=lib_dir, LD_LIBRARY_PATH=lib_dir)
    out = subprocess.run([python, str(HERE / "make_tools_reference.py"), mode, path, pooling, *texts],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout)


def _worst_cosine(ours: list, theirs: list) -> float:
    a, b = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    return float(cos.min())


def spread_of(python: str, builds: dict[str, str], path: str, reference: dict) -> dict:
    """Per pooling: the worst cosine of each build (flash attention off and on) against the committed vectors."""
    result: dict = {}
    for pooling in POOLINGS:
        ref = reference[pooling]
        by_build = {}
        for name, lib_dir in builds.items():
            for mode, label in (("embed", name), ("embed-flash-attn", f"{name}+flash-attn")):
                got = _embed(python, lib_dir, mode, path, pooling, ref["texts"])
                by_build[label] = min(_worst_cosine(got["one_by_one"], ref["one_by_one"]),
                                      _worst_cosine(got["batched"], ref["batched"]))
                print(f"{Path(path).name} {pooling} {label}: {by_build[label]:.6f}", file=sys.stderr)
        result[pooling] = {"worst_cosine": min(by_build.values()), "by_build": by_build}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", required=True)
    parser.add_argument("--build", action="append", required=True, metavar="NAME=LIB_DIR")
    parser.add_argument("--flags", action="append", default=[], metavar="NAME=CMAKE_FLAGS")
    parser.add_argument("--models-dir", default=str(Path.home() / ".cache" / "llmfw" / "models"))
    args = parser.parse_args()
    builds = dict(item.split("=", 1) for item in args.build)
    tools = json.loads((DATA / "llama_cpp_tools.json").read_text())
    out: dict = {
        "provenance": "llama-cpp-python 0.3.36, libggml-cpu.so rebuilt per instruction set from its vendored "
                      "llama.cpp, 2 threads; tests/reference_gen/make_embedding_spread.py",
        "builds": dict(item.split("=", 1) for item in args.flags),
        "models": {},
    }
    for which, entry in tools["models"].items():
        path = str(Path(args.models_dir) / entry["file"])
        out["models"][which] = spread_of(args.llama_python, builds, path, entry["embeddings"])
    (DATA / "llama_cpp_spread.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
