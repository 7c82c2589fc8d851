"""Prefill through ONNX Runtime's int8 GEMM instead of ``MatMulNBits``: the speed it would give and the accuracy it
costs (docs/backends.md, "What ONNX Runtime 1.32 does not offer").

    PYTHONPATH=. python3 benchmarks/onnx_int8_route.py [--models smollm2,gemma-3-270m] [--routes rows,rows2,weights]
                                                       [--only ffn_gate] [--reps 4]

Each route replaces the ``MatMulNBits`` of every quantized matmul but the output head (optionally only the weights
whose name contains ``--only``) — the script swaps the translator's emission for its own run; the backend is
unchanged:

* ``rows``: per-row int8 activations (absmax / 127) times per-column int8 weights in one ``MatMulIntegerToFloat``
  (u8s8: AMX / VNNI where the CPU has them), then the row scale;
* ``rows2``: two int8 planes per activation row (the residual quantized again at 1/254 of the step), so the
  activations are nearly float: the error left is the weights' per-column requantization;
* ``weights``: float activations times the per-column int8 weights dequantized (that error alone, not fast);
* ``float``: float activations times the exact float32 weights held dequantized (4 bytes a weight: a bound, not a
  form to ship — the accuracy and speed of a float32 prefill through ONNX Runtime's sgemm). Dequantizing in the
  graph instead is the same thing: ORT's constant folding turns it into these float32 copies (Gemma-3's pp512
  peak RSS ~3 GB); fed a run-time value so that it dequantizes on every call, it was no faster than MatMulNBits.

Per route and model: the reference scores of every prompt (the bar is mean_lp_err <= 0.25) and pp512 t/s measured
alternately with the unchanged backend in one process (medians of ``--reps`` runs).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import llmfw
from benchmarks.reference_scores import REFERENCE_DIR, REFERENCES, load_score
from llmfw.core.format.catalog import resolve_model
from llmfw.plugins.backends.onnx.translate import SplitTranslator
from llmfw.plugins.backends.onnx.weights import F32, BlockWeight, dequantize_block_weight

#: matrices with more rows than this are the output head: they keep MatMulNBits (their int8 copy alone would
#: cost ~170 MB on Gemma-3, and a prompt sends one row through them)
HEAD_ROWS = 65536
ONNX_UINT8 = 2
PP_TOKENS = 512


def per_column_int8(translator: SplitTranslator, key: str, weight: BlockWeight) -> tuple[str, str]:
    """The weight as int8 codes [n_in, n_out] (MatMulInteger's B) and their per-output scales [n_out]."""
    def scales() -> np.ndarray:
        step = np.abs(dequantize_block_weight(weight)).max(axis=1) / F32(127)
        return np.where(step > 0, step, F32(1)).astype(F32)

    step = translator.backend.derived(key, "int8 scales", scales)
    codes = translator.backend.derived(
        key, "int8 codes", lambda: np.rint(dequantize_block_weight(weight) / step[:, None]).astype(np.int8).T)
    return translator.e.external(f"i8:{key}", codes), translator.e.external(f"i8s:{key}", step)


def quantize_rows(t: SplitTranslator, x: str, step: str) -> tuple[str, str]:
    """round(x / step) and the remainder x - step * round(x / step)."""
    codes = t.e.op("Round", [t.e.op("Div", [x, step])])
    return codes, t.e.op("Sub", [x, t.e.op("Mul", [codes, step])])


def int8_product(t: SplitTranslator, codes: str, w_codes: str, w_scales: str) -> str:
    """codes (float, in [-127, 127]) as uint8 with zero point 128 times the int8 weights, times their scales."""
    activations = t.e.op("Cast", [t.e.op("Add", [codes, t.e.const(128.0, F32)])], to=ONNX_UINT8)
    return t.e.op("MatMulIntegerToFloat", [activations, w_codes, t.e.const(1.0, F32), w_scales,
                                           t.e.const(128, np.uint8)], domain="com.microsoft")


def route_rows(t: SplitTranslator, x: str, key: str, weight: BlockWeight, planes: int) -> str:
    w_codes, w_scales = per_column_int8(t, key, weight)
    absmax = t.e.op("ReduceMax", [t.e.op("Abs", [x])], axes=[-1], keepdims=1)
    step = t.e.op("Max", [t.e.op("Mul", [absmax, t.e.const(1 / 127, F32)]), t.e.const(1e-30, F32)])
    codes, rest = quantize_rows(t, x, step)
    out = t.e.op("Mul", [int8_product(t, codes, w_codes, w_scales), step])
    if planes == 2:
        step2 = t.e.op("Mul", [step, t.e.const(1 / 254, F32)])
        codes2, _ = quantize_rows(t, rest, step2)
        out = t.e.op("Add", [out, t.e.op("Mul", [int8_product(t, codes2, w_codes, w_scales), step2])])
    return out


def route_weights(t: SplitTranslator, x: str, key: str, weight: BlockWeight) -> str:
    w_codes, w_scales = per_column_int8(t, key, weight)
    return t.e.op("MatMul", [x, t.e.op("Mul", [t.e.op("Cast", [w_codes], to=1), w_scales])])


def route_float(t: SplitTranslator, x: str, key: str, weight: BlockWeight) -> str:
    exact = t.backend.derived(key, "float T", lambda: dequantize_block_weight(weight).T)
    return t.e.op("MatMul", [x, t.e.external(f"fT:{key}", exact)])


ROUTES: dict[str, Callable[..., str]] = {
    "rows": lambda t, x, key, w: route_rows(t, x, key, w, planes=1),
    "rows2": lambda t, x, key, w: route_rows(t, x, key, w, planes=2),
    "weights": route_weights,
    "float": route_float,
}


def install_route(route: str | None, only: str) -> None:
    """Make the translator emit ``route`` for the matmuls it covers (None: MatMulNBits, the backend's own)."""
    original = install_route.__dict__.setdefault("original", SplitTranslator._matmul_nbits)
    if route is None:
        SplitTranslator._matmul_nbits = original
        return
    emit = ROUTES[route]

    def matmul(self: SplitTranslator, x: str, x_shape, key: str, weight: BlockWeight) -> str:
        if weight.shape[0] > HEAD_ROWS or only not in key:
            return original(self, x, x_shape, key, weight)
        return emit(self, x, key, weight)

    SplitTranslator._matmul_nbits = matmul


def scores(model: llmfw.Model, reference: dict) -> list[float]:
    score = load_score()
    out = []
    for record in reference["prompts"]:
        sequence = record["sequence"]
        ctx = model.new_context(n_ctx=len(sequence), n_batch=len(sequence), n_ubatch=512, n_threads=1)
        assert ctx.decode(llmfw.Batch(sequence, logits=True)) == 0, ctx.last_error
        out.append(score(record, ctx.get_logits())["mean_lp_err"])
        ctx.close()
    return out


PROMPT = [100 + (7 * i) % 20000 for i in range(PP_TOKENS)]


def prompt_context(model: llmfw.Model) -> llmfw.Context:
    """A context whose sessions for a pp512 ubatch are built now (under the route installed now)."""
    ctx = model.new_context(n_ctx=PP_TOKENS + 128, n_batch=PP_TOKENS, n_ubatch=PP_TOKENS, n_threads=2)
    assert ctx.decode(llmfw.Batch(PROMPT)) == 0, ctx.last_error
    return ctx


def pp_rates(contexts: list[llmfw.Context], reps: int) -> list[float]:
    """Median pp512 t/s of each context, their runs alternating."""
    rates: list[list[float]] = [[] for _ in contexts]
    for _ in range(reps):
        for ctx, rate in zip(contexts, rates):
            ctx.memory.clear()
            start = time.perf_counter()
            ctx.decode(llmfw.Batch(PROMPT))
            rate.append(PP_TOKENS / (time.perf_counter() - start))
    return [float(np.median(rate)) for rate in rates]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma-3-270m")
    parser.add_argument("--routes", default="rows,rows2,weights")
    parser.add_argument("--only", default="", help="route only the weights whose name contains this")
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    print("| model | route | mean_lp_err per prompt | worst | pp512 t/s (MatMulNBits -> route) |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        reference = json.loads((REFERENCE_DIR / REFERENCES[name]).read_text())
        install_route(None, args.only)
        baseline = llmfw.load_model(resolve_model(name), backend="onnx")
        base_ctx = prompt_context(baseline)  # before any route: its sessions keep MatMulNBits
        for route in [None, *args.routes.split(",")]:
            install_route(route, args.only)
            model = llmfw.load_model(resolve_model(name), backend="onnx") if route else baseline
            errors = scores(model, reference)
            speed = ""
            if route:
                ctx = prompt_context(model)
                base_rate, rate = pp_rates([base_ctx, ctx], args.reps)
                speed = f"{base_rate:.0f} -> {rate:.0f} ({rate / base_rate:.2f}x)"
                ctx.close()
                model.close()
            print(f"| {name} | {route or 'MatMulNBits'} | {' '.join(f'{e:.3f}' for e in errors)} | "
                  f"{max(errors):.3f} | {speed} |", flush=True)
        base_ctx.close()
        baseline.close()
    install_route(None, args.only)


if __name__ == "__main__":
    main()
