"""How far the ONNX backend's weight forms are from ggml's dequantized float32 weights, per GGUF tensor type.

    python3 benchmarks/onnx_weight_error.py [MODEL ...]      # catalog names or paths (default: both real models)

For each matrix the ONNX backend would multiply (2-D, quantized): the form it picks (exact 4/8-bit codes, or an
8-bit requantization), and the relative error ‖W_onnx − W_ggml‖ / ‖W_ggml‖ — 0 up to float rounding for the exact
maps; for requantized types compare it with the type's own error against the original weights (≈ 1-5 %).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from llmfw.core.exec.backend import WeightSource
from llmfw.core.format.catalog import resolve_model
from llmfw.core.format.gguf import open_gguf
from llmfw.core.format.quants import GGMLType, dequantize
from llmfw.plugins.backends.onnx.weights import BlockWeight, convert_weight, dequantize_block_weight

DEFAULT_MODELS = ("smollm2", "gemma-3-270m")


def measure(path: Path) -> None:
    per_type: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    with open_gguf(path) as gguf:
        for name, info in gguf.tensors.items():
            if len(info.shape) != 2 or info.ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
                continue
            raw = gguf.tensor_bytes(name)
            source = WeightSource(name, name, int(info.ggml_type), tuple(info.shape), raw, frozenset({"mul_mat"}))
            weight = convert_weight(source)
            assert isinstance(weight, BlockWeight)
            want = dequantize(raw, info.ggml_type, info.shape)
            err = float(np.linalg.norm(dequantize_block_weight(weight) - want) / max(np.linalg.norm(want), 1e-30))
            form = f"{weight.bits}-bit blocks of {weight.block} {'exact' if weight.exact else 'requantized'}" + (
                " + offsets" if weight.offsets is not None else "")
            per_type[info.ggml_type.name].append((err, info.n_elements, form))
    print(f"\n{path.name}")
    print("| type | tensors | weights | ONNX form | rel. error (max) |")
    print("| --- | --- | --- | --- | --- |")
    for qtype, rows in sorted(per_type.items()):
        forms = ", ".join(sorted({r[2] for r in rows}))
        print(f"| {qtype} | {len(rows)} | {sum(r[1] for r in rows) / 1e6:.1f} M | {forms} | "
              f"{max(r[0] for r in rows):.2e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    for model in parser.parse_args().models:
        measure(resolve_model(model) if not Path(model).exists() else Path(model))


if __name__ == "__main__":
    main()
