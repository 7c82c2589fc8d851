"""Where a tg run's time goes on the onnx backend: ONNX Runtime's per-node trace summed by op type, and the share
of each token spent outside the session (Python: batch, memory, scheduler, bindings).

    python3 benchmarks/onnx_profile.py [-m MODEL] [--tg 128] [--threads 2]

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


def op_times(trace: list[dict], skip_runs: int = 0) -> tuple[dict[str, float], int, float]:
    """µs per op type over the trace's node events, the number of session runs and their total µs, leaving out
    the first ``skip_runs`` runs (and their nodes)."""
    model_runs = sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                        key=lambda e: float(e["ts"]))
    counted = model_runs[skip_runs:]
    since = float(counted[0]["ts"]) if counted else float("inf")
    per_op: dict[str, float] = defaultdict(float)
    for event in trace:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time") and \
                float(event["ts"]) >= since:
            per_op[event["args"].get("op_name", "?")] += float(event["dur"])
    return per_op, len(counted), sum(float(e["dur"]) for e in counted)


def main() -> None:
    import llmfw
    from llmfw.core.catalog import resolve_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="smollm2")
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        prefix = str(Path(folder) / "ort")
        model = llmfw.load_model(resolve_model(args.model), backend="onnx",
                                 backend_options={"onnx": {"profile": prefix}})
        ctx = model.new_context(n_ctx=args.tg + 64, n_threads=args.threads)
        ctx.decode(llmfw.Batch(list(range(100, 116))))
        start = time.perf_counter()
        for i in range(args.tg):
            ctx.decode(llmfw.Batch([200 + i]))
        wall = time.perf_counter() - start
        ctx.close()
        model.close()  # sessions end their profiles when released
        traces = sorted(Path(folder).glob("ort*.json"), key=lambda p: p.stat().st_size)
        decode = max((json.loads(p.read_text()) for p in traces), key=lambda t: op_times(t)[1])
    per_op, runs, run_us = op_times(decode, skip_runs=1)  # the prompt's run
    node_us = sum(per_op.values())
    print(f"{args.model}: tg{args.tg} {args.tg / wall:.1f} t/s, {1e3 * wall / args.tg:.2f} ms/token; "
          f"{runs} session runs: {run_us / 1e3 / max(runs, 1):.2f} ms/run in ORT "
          f"({100 * run_us / 1e6 / wall:.0f}% of the wall time), kernels {node_us / 1e3 / max(runs, 1):.2f} ms/run")
    print("| op type | ms/token | share of kernel time |")
    print("| --- | --- | --- |")
    for op, us in sorted(per_op.items(), key=lambda kv: -kv[1]):
        print(f"| {op} | {us / 1e3 / max(runs, 1):.3f} | {100 * us / node_us:.1f}% |")


if __name__ == "__main__":
    main()
