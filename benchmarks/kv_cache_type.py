"""The native backend's KV cache in f16 (the default) against float32: decode rate after a prompt of ``--depth``
tokens, one or several sequences, the two cache types taking turns in one process (this machine's speed drifts:
compare medians of one run), and the cache's size. Not a timed test.

    python benchmarks/kv_cache_type.py -m smollm2 --depth 2048
    python benchmarks/kv_cache_type.py -m smollm2 --depth 64 --seqs 4 -n 128 --json /tmp/kv.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import llmfw  # noqa: E402
from llmfw.commands.machine import describe_machine  # noqa: E402

KV_TYPES = ("f32", "f16")


def prompt_tokens(count: int) -> list[int]:
    """Token ids spread over the vocabulary's common range (what they say does not change the work)."""
    return [(i * 7919) % 30000 + 100 for i in range(count)]


def decode_rate(ctx: llmfw.Context, depth: int, n_gen: int, n_seqs: int) -> float:
    """Tokens per second of ``n_gen`` decode steps of ``n_seqs`` sequences, each after its own ``depth``-token
    prompt (the prompts are not timed)."""
    tokens = prompt_tokens(depth + n_gen)
    ctx.memory.clear()
    for seq in range(n_seqs):
        for start in range(0, depth, 512):
            chunk = tokens[start:min(start + 512, depth)]
            batch = llmfw.Batch(chunk, pos=list(range(start, start + len(chunk))), seq_id=[seq] * len(chunk),
                                logits=False)
            if ctx.decode(batch) != 0:
                raise SystemExit(f"prompt decode failed: {ctx.last_error}")
    began = time.perf_counter()
    for step in range(n_gen):
        batch = llmfw.Batch([tokens[depth + step]] * n_seqs, pos=[depth + step] * n_seqs, seq_id=list(range(n_seqs)),
                            logits=True)
        if ctx.decode(batch) != 0:
            raise SystemExit(f"decode failed: {ctx.last_error}")
    return n_gen * n_seqs / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default="smollm2")
    parser.add_argument("--depth", type=int, default=2048, help="prompt tokens before the timed steps")
    parser.add_argument("-n", "--n-gen", type=int, default=64)
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("-r", "--rounds", type=int, default=3)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    contexts = {}
    for kv_type in KV_TYPES:
        options = {"native": {"kv_type": kv_type, "n_threads": args.threads}}
        model = llmfw.load_model(args.model, backend="native", backend_options=options)
        contexts[kv_type] = model.new_context(n_ctx=(args.depth + args.n_gen + 256) * args.seqs, n_batch=512,
                                              n_ubatch=512, n_seq_max=args.seqs)
    rates: dict[str, list[float]] = {kv_type: [] for kv_type in KV_TYPES}
    for _ in range(args.rounds):
        for kv_type in KV_TYPES:
            rates[kv_type].append(decode_rate(contexts[kv_type], args.depth, args.n_gen, args.seqs))
    result = {"kind": "kv_cache_type", "machine": describe_machine(), "model": args.model, "depth": args.depth,
              "n_gen": args.n_gen, "seqs": args.seqs, "threads": args.threads, "runs": {}}
    for kv_type in KV_TYPES:
        median = statistics.median(rates[kv_type])
        mib = contexts[kv_type].memory.nbytes / 2 ** 20
        result["runs"][kv_type] = {"tps_median": median, "tps": rates[kv_type], "kv_mib": mib}
        print(f"{args.model} depth {args.depth} x{args.seqs} kv {kv_type}: {median:.1f} t/s "
              f"(runs {', '.join(f'{r:.1f}' for r in rates[kv_type])}), cache {mib:.0f} MiB")
    ratio = result["runs"]["f16"]["tps_median"] / result["runs"]["f32"]["tps_median"]
    print(f"f16 / f32: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
