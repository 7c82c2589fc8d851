"""The memory a mixture-of-experts load adds, against the file's size (issue 33: at most 1.3x).

Writes a qwen3moe GGUF file of at least ``--gib`` GiB with the ``gguf`` package (Qwen3-30B-A3B's layer shape,
Q4_K_M's block types, random blocks: tests/support/moe_file.py) into a temporary folder, then, per backend, loads
it in a fresh Python process and decodes one token (the onnx backend builds its session at the first decode):
``added`` = peak RSS of that process minus its RSS just before the load, ``ratio`` = added / file size. The onnx
backend is measured twice with an empty converted-weight cache (the first load converts and writes the cache)
and then with the cache written (later loads map it); so are the native backend (its repacked-weight cache) and
``default`` (no backend named: native where its extension is built). Prints one JSON object.

    python benchmarks/moe_memory.py                 # a 1.05 GiB file: numpy, onnx, the default
    python benchmarks/moe_memory.py --gib 0.3 --backends onnx,native
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "tests"))

from support.moe_file import MoeFileShape, expert_bytes, measure_load, write_moe_file  # noqa: E402


#: the backends with a converted-weight cache, measured twice (empty cache, then written), and where it goes
CACHE_VARIABLES = {"onnx": "LLMFW_ONNX_CACHE_DIR", "native": "LLMFW_NATIVE_CACHE_DIR"}
#: what is measured with its caches empty, then written: those backends, and the default (native where built)
CACHED = (*CACHE_VARIABLES, "default")


def shape_for(gib: float) -> MoeFileShape:
    """Qwen3-30B-A3B's layer, as many layers as reach ``gib`` GiB."""
    shape = MoeFileShape()
    n_layer = max(1, math.ceil(gib * (1 << 30) / expert_bytes(shape)))
    return MoeFileShape(n_layer=n_layer)


def measured(model: Path, backend: str, env: dict[str, str]) -> dict:
    """:func:`measure_load`'s record, or why the load failed (a backend that declines the model, say)."""
    try:
        return measure_load(model, backend, env)
    except RuntimeError as exc:
        return {"failed": str(exc).strip().splitlines()[-1]}


def run(gib: float, backends: list[str], folder: Path) -> dict:
    model = write_moe_file(folder / "moe.gguf", shape_for(gib))
    results: dict = {"file": {"bytes": model.stat().st_size, "shape": vars(shape_for(gib))}, "runs": {}}
    for backend in backends:
        if backend not in CACHED:
            results["runs"][backend] = measured(model, backend, {})
            continue
        cache = {CACHE_VARIABLES[name]: str(folder / f"{backend}-{name}-cache") for name in CACHE_VARIABLES
                 if backend in (name, "default")}
        results["runs"][f"{backend} (first load: converts, writes the cache)"] = measured(model, backend, cache)
        results["runs"][f"{backend} (cached)"] = measured(model, backend, cache)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.05, help="file size to reach (GiB)")
    parser.add_argument("--backends", default="numpy,onnx,default",
                        help="comma-separated; 'default': no backend named (native where its extension is built)")
    parser.add_argument("--dir", help="folder for the file (default: a temporary one, removed after)")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        print(json.dumps(run(args.gib, backends, Path(args.dir)), indent=2))
        return
    with tempfile.TemporaryDirectory(prefix="moe-memory-") as folder:
        print(json.dumps(run(args.gib, backends, Path(folder)), indent=2))


if __name__ == "__main__":
    main()
