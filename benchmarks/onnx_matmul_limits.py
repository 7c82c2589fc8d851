"""What ONNX Runtime's ``MatMulNBits`` leaves the onnx backend for an affine 4-bit block (Q4_1, Q4_K: ``w = d*q +
m``), and why neither a faster form nor a shortcut at load is open (docs/backends.md, "What ONNX Runtime 1.32 does not offer").

    python3 benchmarks/onnx_matmul_limits.py [--k 576] [--n 1536] [--rows 1,64] [--reps 200] [--json]

1. **Forms of one affine 4-bit matrix**, µs per call at each row count (one session each, 2 intra-op threads):

   * ``symmetric``: 4-bit codes with the default zero point 8 and no offsets — the bound, wrong for Q4_1;
   * ``uint8_zp``: 4-bit zero points — exact only when ``-m/d`` is a whole number from 0 to 15, which Q4_1's
     minimum almost never is;
   * ``float_zp``: float zero points ``-m/d`` — exact, but ORT runs them on a slow path;
   * ``offsets``: what the backend emits (translate.py): the symmetric product plus ``blocksum(x) @ offsets.T``
     (``Reshape``, ``ReduceSum``, ``Gemm``) — exact.

   All four are checked against the float product of the same weights (``max_err``; ``uint8_zp`` with the
   minimum rounded to the grid, so its error is the rounding's).
2. **ORT's packed form** (accuracy level 4): bytes per 32 weights of the buffer ORT packs a 4-bit matrix into (the
   codes, a float32 scale and a float32 block sum per block) against the GGUF block's 20 (Q4_1) or 18 (Q4_0).
3. **Serialized packed weights** (``session.save_external_prepacked_constant_initializers``): ORT saves the
   packed buffers beside an optimized model; reloaded, it packs the weights again and compares. The probe finds
   the block sums in the saved buffer (scales chosen to be recognisable), changes them to the Q4_1 offsets and
   reloads: ``accepted`` says whether ORT took buffers it did not make itself — the one way an exact affine block
   could run as one kernel with no offsets pass — and ``repack_s`` / ``reload_s`` what a reload costs.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from llmfw.plugins.backends.onnx.weights import BLOCK, F32, pack_nbits

SAVE_PREPACKED = "session.save_external_prepacked_constant_initializers"
#: --k and --n at most this (a 65536 x 65536 matrix of 4-bit codes is 2 GiB: larger ones are not a benchmark)
MAX_DIM = 65536


def affine_blocks(n: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A random Q4_1-like matrix [n, k]: codes 0..15, a positive scale and a free minimum per block of 32."""
    rng = np.random.default_rng(seed)
    n_blocks = k // BLOCK
    codes = rng.integers(0, 16, size=(n, n_blocks, BLOCK), dtype=np.uint8)
    scales = (rng.random((n, n_blocks), dtype=F32) + 0.5) * F32(0.01)
    minimums = -(rng.random((n, n_blocks), dtype=F32) * 8 + 4) * scales
    return {"codes": codes, "scales": scales, "minimums": minimums}


def dense(blocks: dict[str, np.ndarray], minimums: np.ndarray | None = None) -> np.ndarray:
    """The float matrix ``d*q + m``."""
    m = blocks["minimums"] if minimums is None else minimums
    values = blocks["codes"].astype(F32) * blocks["scales"][..., None] + m[..., None]
    return values.reshape(values.shape[0], -1)


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit values [rows, m] (m even) packed two per byte as the backend packs MatMulNBits' B."""
    rows, m = values.shape
    signed = (values.astype(np.int16) - 8).astype(np.int8)  # pack_nbits adds the zero point 8 back
    return pack_nbits(signed, 4, block=m).reshape(rows, m // 2)


def nbits_model(blocks: dict[str, np.ndarray], form: str) -> tuple[Any, np.ndarray]:
    """The ONNX model of one form and the float matrix it should reproduce."""
    from onnx import TensorProto, helper, numpy_helper

    n, n_blocks, _ = blocks["codes"].shape
    k = n_blocks * BLOCK
    scales = blocks["scales"]
    packed_codes = pack_nibbles(blocks["codes"].reshape(n, k)).reshape(n, n_blocks, BLOCK // 2)
    inits = [numpy_helper.from_array(packed_codes, "B"),
             numpy_helper.from_array(scales.reshape(-1), "S")]
    inputs, nodes, expected = ["x", "B", "S"], [], dense(blocks)
    if form == "symmetric":
        expected = dense(blocks, -8 * scales)
    elif form == "uint8_zp":
        zero_points = np.clip(np.rint(-blocks["minimums"] / scales), 0, 15).astype(np.uint8)
        padded = np.pad(zero_points, ((0, 0), (0, n_blocks % 2)))
        inits.append(numpy_helper.from_array(pack_nibbles(padded), "Z"))
        inputs.append("Z")
        expected = dense(blocks, -zero_points.astype(F32) * scales)
    elif form == "float_zp":
        inits.append(numpy_helper.from_array((-blocks["minimums"] / scales).reshape(-1).astype(F32), "Z"))
        inputs.append("Z")
    matmul_out = "y" if form != "offsets" else "mm"
    nodes.append(helper.make_node("MatMulNBits", inputs, [matmul_out], domain="com.microsoft", K=k, N=n, bits=4,
                                  block_size=BLOCK, accuracy_level=4))
    if form == "offsets":  # the backend's form: offsets relative to the default zero point 8
        inits += [numpy_helper.from_array(np.array([-1, n_blocks, BLOCK], dtype=np.int64), "blocked_shape"),
                  numpy_helper.from_array(np.array([-1], dtype=np.int64), "last_axis"),
                  numpy_helper.from_array(np.ascontiguousarray((blocks["minimums"] + 8 * scales).T), "offsets_t")]
        nodes += [helper.make_node("Reshape", ["x", "blocked_shape"], ["blocked"]),
                  helper.make_node("ReduceSum", ["blocked", "last_axis"], ["sums"], keepdims=0),
                  helper.make_node("Gemm", ["sums", "offsets_t", "mm"], ["y"])]
    graph = helper.make_graph(nodes, form, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return model, expected


def session(model_or_path: Any, threads: int = 2, **entries: str) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    for key, value in entries.items():
        if key == "optimized_model_filepath":
            options.optimized_model_filepath = value
        else:
            options.add_session_config_entry(key, value)
    source = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def time_forms(blocks: dict[str, np.ndarray], rows: list[int], reps: int) -> dict[str, dict[str, float]]:
    """µs per call (best of three rounds of ``reps`` calls) and the largest error against the float product."""
    rng = np.random.default_rng(1)
    k = blocks["codes"].shape[1] * BLOCK
    results: dict[str, dict[str, float]] = {}
    for form in ("symmetric", "uint8_zp", "float_zp", "offsets"):
        model, expected = nbits_model(blocks, form)
        sess = session(model)
        row: dict[str, float] = {}
        for m in rows:
            x = rng.standard_normal((m, k)).astype(F32)
            got = sess.run(None, {"x": x})[0]
            reference = x @ expected.T
            row["max_err"] = max(row.get("max_err", 0.0),
                                 float(np.abs(got - reference).max() / np.abs(reference).max()))
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(reps):
                    sess.run(None, {"x": x})
                best = min(best, (time.perf_counter() - start) / reps)
            row[f"us_m{m}"] = best * 1e6
        results[form] = row
    return results


def packed_bytes_per_block(blocks: dict[str, np.ndarray], folder: Path,
                           form: str = "symmetric") -> tuple[float, dict[str, Any]]:
    """ORT's packed bytes per 32 weights of a form saved under ``folder``, and where its packed buffer lies in the
    saved weights file."""
    import onnx

    model, _ = nbits_model(blocks, form)
    session(model, threads=1, optimized_model_filepath=str(folder / "saved.onnx"), **{
        SAVE_PREPACKED: "1", "session.optimized_model_external_initializers_file_name": "saved.bin",
        "session.optimized_model_external_initializers_min_size_in_bytes": "1"})
    saved = onnx.load(str(folder / "saved.onnx"), load_external_data=False)
    codes = next(init for init in saved.graph.initializer if init.name == "B")
    entry = next(e.value for e in codes.external_data if e.key.startswith("prepacked"))
    offset, length = (int(v) for v in entry.split("|")[1].split(";")[:2])
    n, n_blocks, _ = blocks["codes"].shape
    return length / (n * n_blocks), {"offset": offset, "length": length}


def probe_serialized(blocks: dict[str, np.ndarray], folder: Path) -> dict[str, Any]:
    """Save a matrix's packed form with recognisable block sums; time a reload of it as saved against packing
    anew; then replace the block sums with a Q4_1 matrix's and reload."""
    n, n_blocks, _ = blocks["codes"].shape
    # zero codes and scales (i+1)/1024 (exact in float32) with zero point 1: block sum i is -(i+1)/1024, found by value
    scales = ((np.arange(n * n_blocks, dtype=F32) + 1) / 1024).reshape(n, n_blocks)
    probe = dict(codes=np.zeros_like(blocks["codes"]), scales=scales, minimums=-scales)
    _, where = packed_bytes_per_block(probe, folder, form="uint8_zp")
    timings = {}
    for name, source in (("reload_s", str(folder / "saved.onnx")), ("repack_s", nbits_model(probe, "uint8_zp")[0])):
        start = time.perf_counter()
        session(source)
        timings[name] = time.perf_counter() - start
    blob = np.fromfile(folder / "saved.bin", dtype=np.uint8)
    packed = blob[where["offset"]: where["offset"] + where["length"] // 4 * 4].view(F32)
    block_sums = np.flatnonzero((packed < 0) & np.isin(packed, -scales.reshape(-1)))
    found = len(block_sums) == n * n_blocks
    if found:  # a block sum is the block's additive term, -d*zp: Q4_1's is its minimum m
        index = np.rint(-packed[block_sums] * 1024).astype(np.int64) - 1
        packed[block_sums] = blocks["minimums"].reshape(-1)[index]
        blob.tofile(folder / "saved.bin")
    try:
        session(str(folder / "saved.onnx"))
        accepted, error = True, ""
    except Exception as exc:  # noqa: BLE001 - ORT's own exception types
        # ORT's text after its "[ONNXRuntimeError] : 1 : FAIL : " prefix
        accepted, error = False, str(exc).splitlines()[0].split(" : ")[-1]
    return {"block_sums_found": found, "accepted": accepted, "error": error, **timings}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=576, help="input width (a multiple of 32; SmolLM2's n_embd)")
    parser.add_argument("--n", type=int, default=1536, help="output rows (SmolLM2's n_ff)")
    parser.add_argument("--rows", default="1,64", help="activation rows per call, comma-separated")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.k % BLOCK or not 0 < args.k <= MAX_DIM or not 0 < args.n <= MAX_DIM or args.reps <= 0:
        parser.error(f"--k must be a multiple of {BLOCK} and --n positive, both at most {MAX_DIM}; --reps positive")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows takes whole numbers separated by commas, not {args.rows!r}")
    if min(rows) <= 0:
        parser.error("--rows must be positive")
    blocks = affine_blocks(args.n, args.k)
    report: dict[str, Any] = {"k": args.k, "n": args.n, "forms": time_forms(blocks, rows, args.reps)}
    with tempfile.TemporaryDirectory() as tmp:
        report["packed_bytes_per_32"] = packed_bytes_per_block(blocks, Path(tmp))[0]
    with tempfile.TemporaryDirectory() as tmp:
        report["serialized"] = probe_serialized(blocks, Path(tmp))
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"one {args.n}x{args.k} affine 4-bit matrix (Q4_1-like), 2 threads:")
    for form, row in report["forms"].items():
        timings = ", ".join(f"{key[4:]} rows {value:.1f} us" for key, value in row.items() if key.startswith("us_"))
        print(f"  {form:10s} {timings}; max relative error {row['max_err']:.1e}")
    print(f"ORT's packed 4-bit form: {report['packed_bytes_per_32']:.1f} bytes per 32 weights "
          f"(GGUF Q4_1: 20, Q4_0: 18)")
    probe = report["serialized"]
    print(f"serialized packed weights with other block sums: block sums found {probe['block_sums_found']}, "
          f"accepted {probe['accepted']} {probe['error']}")
    print(f"  a session from the saved packed form {probe['reload_s'] * 1e3:.1f} ms, "
          f"from the weights (packing anew) {probe['repack_s'] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
