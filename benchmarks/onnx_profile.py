"""Where a tg run's time goes on the onnx backend: ONNX Runtime's per-node trace summed by op type, and the share
of each token spent outside the session (Python: batch, memory, scheduler, bindings).

    python3 benchmarks/onnx_profile.py [-m MODEL] [--tg 128] [--threads 2]
    python3 benchmarks/onnx_profile.py [-m MODEL] --pp 512 [--threads 2]     # one prompt ubatch instead
    python3 benchmarks/onnx_profile.py -m MOE_MODEL --tg 32 --moe           # the chosen experts' matmuls apart
    python3 benchmarks/onnx_profile.py -m MOE_MODEL --tg 32 --default       # the default: experts on native

With ``--pp N`` it profiles prompt ubatches of N tokens (one warm-up, three counted) and splits the matmul ops
by their input shapes, so that the table shows which projection costs what; the last line says how fast the
prompt would run if everything but ``MatMulNBits`` were free (the ceiling of any non-matmul work).

The trace comes from the backend's ``profile`` option (ORT's ``enable_profiling``); the prompt and the decode
steps run in one session, so its first run (the prompt) is skipped and only the decode runs are counted. Profiling slows every
node down by a roughly constant cost, so absolute times are inflated and cheap, frequent ops (Reshape, Slice)
look dearer than they are: read the table for its ranking, and a plain ``llmfw bench`` for the speed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


#: ops whose rows are split by input shapes in a pp profile (one row per projection)
MATMUL_OPS = ("MatMulNBits", "MatMul", "FusedMatMul", "Gemm")


def op_times(trace: list[dict], skip_runs: int = 0, by_shape: bool = False,
             by_rows: bool = False) -> tuple[dict[str, float], int, float]:
    """µs per op type over the trace's node events, the number of session runs and their total µs, leaving out
    the first ``skip_runs`` runs (and their nodes). ``by_shape``: matmul ops keyed by their two input shapes;
    ``by_rows``: matmul ops split into those that multiplied no row (a mixture of experts' unchosen experts) and
    the others."""
    model_runs = sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                        key=lambda e: float(e["ts"]))
    counted = model_runs[skip_runs:]
    since = float(counted[0]["ts"]) if counted else float("inf")
    per_op: dict[str, float] = defaultdict(float)
    for event in trace:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time") and \
                float(event["ts"]) >= since:
            per_op[_op_key(event["args"], by_shape, by_rows)] += float(event["dur"])
    return per_op, len(counted), sum(float(e["dur"]) for e in counted)


def _op_key(args: dict, by_shape: bool, by_rows: bool = False) -> str:
    op = args.get("op_name", "?")
    if op not in MATMUL_OPS or not (by_shape or by_rows):
        return op
    shapes = [list(entry.values())[0] for entry in args.get("input_type_shape", [])[:2]]
    if by_rows:
        return f"{op} ({'no rows: an expert nobody chose' if shapes and shapes[0][:1] == [0] else 'rows'})"
    return f"{op} {' x '.join(str(shape) for shape in shapes)}"


def profile_decode(model, args, after_prompt=lambda: None) -> float:
    """The tg run: a 16-token prompt, then ``--tg`` one-token decodes; their wall time."""
    import llmfw

    ctx = model.new_context(n_ctx=args.tg + 64, n_threads=args.threads)
    ctx.decode(llmfw.Batch(list(range(100, 116))))
    after_prompt()
    start = time.perf_counter()
    for i in range(args.tg):
        ctx.decode(llmfw.Batch([200 + i]))
    wall = time.perf_counter() - start
    ctx.close()
    return wall


def profile_prompt(model, args, repetitions: int) -> float:
    """``repetitions`` + 1 prompt ubatches of ``--pp`` tokens from an empty cache (the first is the warm-up);
    the wall time of the counted ones."""
    import llmfw

    tokens = [100 + (7 * i) % 20000 for i in range(args.pp)]
    ctx = model.new_context(n_ctx=args.pp + 64, n_batch=args.pp, n_ubatch=args.pp, n_threads=args.threads)
    wall = 0.0
    for rep in range(repetitions + 1):
        ctx.memory.clear()
        start = time.perf_counter()
        ctx.decode(llmfw.Batch(tokens))
        wall += (time.perf_counter() - start) if rep else 0.0
    ctx.close()
    return wall


def main() -> None:
    import llmfw
    from llmfw.core.format.catalog import resolve_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="smollm2")
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pp", type=int, default=0, help="profile prompt ubatches of this many tokens instead")
    parser.add_argument("--moe", action="store_true",
                        help="split the matmuls of a decode into those on rows and those on none (unchosen experts)")
    parser.add_argument("--default", action="store_true",
                        help="load on the default backend (onnx, an MoE model's experts on native) and add the "
                             "native programs' per-op times")
    args = parser.parse_args()
    repetitions = 3

    with tempfile.TemporaryDirectory() as folder:
        prefix = str(Path(folder) / "ort")
        options = {"onnx": {"profile": prefix}, **({"native": {"profile": True}} if args.default else {})}
        model = llmfw.load_model(resolve_model(args.model), backend=None if args.default else "onnx",
                                 backend_options=options)
        native = model.backends.get("native")
        at_prompt_end: dict[str, float] = {}
        if args.pp:
            wall = profile_prompt(model, args, repetitions)
        else:
            wall = profile_decode(model, args, lambda: at_prompt_end.update(native.profile() if native else {}))
        native_s = {op: s - at_prompt_end.get(op, 0.0) for op, s in native.profile().items()} if native else {}
        model.close()  # sessions end their profiles when released
        traces = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("ort*.json"))]
        main_trace = max(traces, key=lambda t: op_times(t)[1])
    if args.pp:
        report_prompt(main_trace, args, wall, repetitions)
    else:  # every split's session (each ran the prompt first)
        report_decode(traces, args, wall, native_s)


def report_decode(traces: list[list[dict]], args, wall: float, native_s: dict[str, float]) -> None:
    """ORT's table over every session's trace; with ``--default``, native's, and the token's time split between
    ORT, native and the rest."""
    per_op: dict[str, float] = defaultdict(float)
    runs, run_us = 0, 0.0
    for trace in traces:
        ops, n, us = op_times(trace, skip_runs=1, by_rows=args.moe)  # the prompt's run
        runs, run_us = runs + n, run_us + us
        for op, op_us in ops.items():
            per_op[op] += op_us
    node_us = sum(per_op.values())
    print(f"{args.model}: tg{args.tg} {args.tg / wall:.1f} t/s, {1e3 * wall / args.tg:.2f} ms/token; "
          f"{runs} session runs: {run_us / 1e3 / max(runs, 1):.2f} ms/run in ORT "
          f"({100 * run_us / 1e6 / wall:.0f}% of the wall time), kernels {node_us / 1e3 / max(runs, 1):.2f} ms/run")
    print_table(per_op, args.tg, "ms/token")  # a token may take several session runs (one per split)
    if native_s:
        ort_ms, native_ms, token_ms = run_us / 1e3 / args.tg, 1e3 * sum(native_s.values()) / args.tg, 1e3 * wall / args.tg
        print(f"\nnative programs: {native_ms:.2f} ms/token; per token: ORT runs {ort_ms:.2f} ms, native "
              f"{native_ms:.2f} ms, the rest (Python, scheduler, copies between them) {token_ms - ort_ms - native_ms:.2f} ms")
        print_table({op: 1e6 * s for op, s in native_s.items()}, args.tg, "ms/token")


def report_prompt(trace: list[dict], args, wall: float, repetitions: int) -> None:
    per_op, runs, run_us = op_times(trace, skip_runs=1, by_shape=True)  # the warm-up's run
    node_us = sum(per_op.values())
    nbits_us = sum(us for op, us in per_op.items() if op.startswith("MatMulNBits"))
    per_ubatch = wall / repetitions
    print(f"{args.model}: pp{args.pp} {args.pp / per_ubatch:.1f} t/s, {1e3 * per_ubatch:.0f} ms/ubatch; "
          f"{runs} session runs: {run_us / 1e3 / max(runs, 1):.0f} ms/run in ORT, "
          f"kernels {node_us / 1e3 / max(runs, 1):.0f} ms/run")
    print_table(per_op, runs, "ms/ubatch")
    if nbits_us:
        print(f"MatMulNBits alone: {100 * nbits_us / node_us:.0f}% of the kernel time; with every other op free the "
              f"prompt would run {node_us / nbits_us:.2f}x as fast as now")


def print_table(per_op: dict[str, float], runs: int, unit: str) -> None:
    node_us = sum(per_op.values())
    print(f"| op type | {unit} | share of kernel time |")
    print("| --- | --- | --- |")
    for op, us in sorted(per_op.items(), key=lambda kv: -kv[1]):
        print(f"| {op} | {us / 1e3 / max(runs, 1):.3f} | {100 * us / node_us:.1f}% |")


if __name__ == "__main__":
    main()
