"""llama-bench's pp512 / tg128 for llmfw's ONNX Runtime backend and llama.cpp, side by side in one run.

    python3 benchmarks/onnx_vs_llamacpp.py [-m MODEL] [--llama-python /tmp/lcpp/bin/python] [--threads 2]
                                          [--backend onnx] [--rounds 2] [--tg 128] [--pp 512]

llama.cpp runs through llama-cpp-python in a throw-away interpreter (``--llama-python``; skipped when absent),
llmfw in this one. The two alternate ``--rounds`` times so that both see the same machine load; the best round
of each is printed (tokens/s), with the ratio llmfw / llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

LLAMA_CPP_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from llama_cpp import Llama
    path, threads, n_pp, n_tg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = Llama(model_path=path, n_ctx=max(1024, n_pp + n_tg + 8), n_batch=n_pp, n_ubatch=n_pp,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    tokens = [(i * 7919) % 1000 + 100 for i in range(n_pp)]
    llm.eval(tokens[:8]); llm.reset()                       # warm-up
    start = time.perf_counter(); llm.eval(tokens); pp = n_pp / (time.perf_counter() - start)
    llm.reset(); llm.eval(tokens[:1])
    start = time.perf_counter()
    for i in range(n_tg):
        llm.eval([tokens[(i + 1) % n_pp]])
    tg = n_tg / (time.perf_counter() - start)
    print(json.dumps({"pp": pp, "tg": tg}))
""")


def bench_llama_cpp(python: str, path: Path, threads: int, n_pp: int, n_tg: int) -> dict | None:
    if not Path(python).exists():
        return None
    out = subprocess.run([python, "-c", LLAMA_CPP_SCRIPT, str(path), str(threads), str(n_pp), str(n_tg)],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_llmfw(model, threads: int, n_pp: int, n_tg: int) -> dict:
    import llmfw

    tokens = [(i * 7919) % 1000 + 100 for i in range(n_pp)]
    ctx = model.new_context(n_ctx=max(1024, n_pp + n_tg + 8), n_batch=n_pp, n_ubatch=n_pp, n_threads=threads)
    ctx.decode(llmfw.Batch(tokens[:8]))                     # warm-up: builds the prefill session
    ctx.memory.clear()
    start = time.perf_counter()
    assert ctx.decode(llmfw.Batch(tokens)) == 0
    pp = n_pp / (time.perf_counter() - start)
    ctx.memory.clear()
    ctx.decode(llmfw.Batch(tokens[:1]))
    ctx.decode(llmfw.Batch(tokens[1:2]))                    # warm-up: builds the one-token session
    start = time.perf_counter()
    for i in range(n_tg):
        assert ctx.decode(llmfw.Batch([tokens[(i + 2) % n_pp]])) == 0
    tg = n_tg / (time.perf_counter() - start)
    ctx.close()
    return {"pp": pp, "tg": tg}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="smollm2")
    parser.add_argument("--backend", default="onnx")
    parser.add_argument("--llama-python", default="/tmp/lcpp/bin/python")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--tg", type=int, default=128)
    args = parser.parse_args()

    import llmfw
    from llmfw.core.format.catalog import resolve_model

    path = Path(args.model) if Path(args.model).exists() else resolve_model(args.model)
    model = llmfw.load_model(path, backend=args.backend)
    best: dict[str, dict[str, float]] = {}
    for round_ in range(args.rounds):
        for who in ("llama.cpp", f"llmfw {args.backend}"):
            if who == "llama.cpp":
                result = bench_llama_cpp(args.llama_python, path, args.threads, args.pp, args.tg)
            else:
                result = bench_llmfw(model, args.threads, args.pp, args.tg)
            if result is None:
                continue
            print(f"round {round_}: {who:14s} pp{args.pp} {result['pp']:7.1f} t/s   "
                  f"tg{args.tg} {result['tg']:7.1f} t/s", flush=True)
            entry = best.setdefault(who, {"pp": 0.0, "tg": 0.0})
            entry["pp"], entry["tg"] = max(entry["pp"], result["pp"]), max(entry["tg"], result["tg"])
    print(f"\n| {path.name} ({args.threads} threads) | pp{args.pp} t/s | tg{args.tg} t/s |\n| --- | --- | --- |")
    for who, entry in best.items():
        print(f"| {who} | {entry['pp']:.1f} | {entry['tg']:.1f} |")
    if "llama.cpp" in best and len(best) == 2:
        ours = best[f"llmfw {args.backend}"]
        ref = best["llama.cpp"]
        print(f"| ratio | {ours['pp'] / ref['pp']:.2f} | {ours['tg'] / ref['tg']:.2f} |")
    model.close()


if __name__ == "__main__":
    main()
