"""Wall time of a one-token ``llmfw run -n 1`` from the shell, as a new user meets it (issue 12's target:
<= 2 s for SmolLM2 on the default backend with a warm model cache).

    python3 benchmarks/first_token.py [-m smollm2] [--backend onnx] [-r 5] [--json]

Each repeat is a fresh process (``python -m llmfw.cli run -m MODEL -n 1 PROMPT --no-progress``): interpreter
start, imports, plugin discovery, opening the GGUF, converting the weights, building the backend's session,
one prompt decode and one sampled token. The model must already be cached (one unmeasured warm-up run pulls it
and warms the OS page cache). Reported per repeat: wall seconds and the child's CPU seconds (user + sys); on a
shared machine CPU seconds are the repeatable figure and wall seconds also count waiting for a core, so the
load average is printed beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_run(args: argparse.Namespace) -> dict[str, float | str]:
    cmd = [sys.executable, "-m", "llmfw.cli", "run", "-m", args.model, "-n", "1", args.prompt, "--no-progress", "-v"]
    if args.backend:
        cmd += ["--backend", args.backend]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"llmfw run failed ({result.returncode}): {result.stderr.strip()}")
    backend = next((line.removeprefix("backend: ") for line in result.stderr.splitlines()
                    if line.startswith("backend: ")), "?")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "backend": backend, "load_avg_1m": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default="smollm2")
    parser.add_argument("--backend", default=None, help="default: the default backend")
    parser.add_argument("-r", "--repeats", type=int, default=5)
    parser.add_argument("--prompt", default="Hello")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    one_run(args)  # warm-up: the model cache and the OS page cache
    runs = [one_run(args) for _ in range(args.repeats)]
    summary = {
        "model": args.model, "backend": runs[0]["backend"], "repeats": args.repeats,
        "wall_s_median": statistics.median(r["wall_s"] for r in runs),
        "wall_s_min": min(r["wall_s"] for r in runs),
        "cpu_s_median": statistics.median(r["cpu_s"] for r in runs),
        "load_avg_1m": statistics.median(r["load_avg_1m"] for r in runs),
        "cpus": os.cpu_count(), "runs": runs,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"llmfw run -m {args.model} -n 1 ({summary['backend']})")
    for i, r in enumerate(runs):
        print(f"  run {i + 1}: wall {r['wall_s']:.2f} s, cpu {r['cpu_s']:.2f} s, load average {r['load_avg_1m']:.1f}")
    print(f"median wall {summary['wall_s_median']:.2f} s (min {summary['wall_s_min']:.2f} s), median cpu "
          f"{summary['cpu_s_median']:.2f} s, on {summary['cpus']} CPUs at load average {summary['load_avg_1m']:.1f}")


if __name__ == "__main__":
    main()
