"""Speculative decoding speed: greedy tokens/s with n-gram (prompt-lookup) drafts vs without, same outputs.

    python benchmarks/speculative_bench.py [--model smollm2] [--backend BACKEND] [--draft-max 16] [--ngram-n 3]
        [-n 128] [--repeat 2] [--json OUT] [--backend-options JSON]

The prompts are input-grounded ("repeat / edit this code"): the answer copies long stretches of the prompt,
which is where prompt lookup pays off. For each prompt both runs start from the same cached prompt (only the
generation is timed), and the outputs must be identical (the script exits 1 otherwise).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CODE = '''def parse_config(path):
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    config = {}
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value")
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
'''

PROMPTS = [
    "<|im_start|>user\nRepeat this code exactly, without any change:\n\n" + CODE + "<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nRename the function parse_config to read_config in this code and print the whole "
    "code:\n\n" + CODE + "<|im_end|>\n<|im_start|>assistant\n",
    "Here is a file.\n\n" + CODE + "\nThe same file again, unchanged:\n\n",
]


def timed_generation(ctx, prompt: str, n: int, draft) -> tuple[list[int], float, object]:
    from llmfw.core.generation.generate import GenerationStats, generate

    stats = GenerationStats()
    for _ in generate(ctx, prompt, max_tokens=n, stats=stats, draft=draft):
        pass
    return stats.tokens, stats.t_generate, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--draft-max", type=int, default=16)
    parser.add_argument("--ngram-n", type=int, default=3)
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--backend-options", type=json.loads, default={}, metavar="JSON",
                        help='per-backend options, e.g. \'{"onnx": {"row_padding": "always"}}\'')
    args = parser.parse_args()

    import llmfw
    from llmfw.core.generation.speculative import NgramDrafter

    model = llmfw.load_model(args.model, backend=args.backend, backend_options=args.backend_options)
    ctx = model.new_context(n_ctx=2048)
    rows, same = [], True
    for prompt in PROMPTS:
        timed_generation(ctx, prompt, 4, None)  # warm up graphs and cache the prompt
        best: dict[str, tuple[float, object]] = {}
        outputs = {}
        for _ in range(args.repeat):
            for mode, draft in (("plain", None), ("ngram", NgramDrafter(args.draft_max, args.ngram_n))):
                tokens, seconds, stats = timed_generation(ctx, prompt, args.n, draft)
                outputs[mode] = tokens
                if mode not in best or seconds < best[mode][0]:
                    best[mode] = (seconds, stats)
        same &= outputs["plain"] == outputs["ngram"]
        (t_plain, s_plain), (t_spec, s_spec) = best["plain"], best["ngram"]
        row = {"prompt": prompt[:40], "tokens": s_plain.n_generated, "plain_tps": s_plain.n_generated / t_plain,
               "ngram_tps": s_spec.n_generated / t_spec, "speedup": t_plain / t_spec,
               "acceptance": s_spec.acceptance_rate, "drafted": s_spec.n_drafted, "accepted": s_spec.n_accepted,
               "verify_batches": s_spec.n_verify_batches, "identical": outputs["plain"] == outputs["ngram"]}
        rows.append(row)
        print(f"{row['tokens']:4d} tokens  plain {row['plain_tps']:6.1f} t/s  ngram {row['ngram_tps']:6.1f} t/s  "
              f"x{row['speedup']:.2f}  accepted {row['accepted']}/{row['drafted']} ({100 * row['acceptance']:.0f} %)"
              f"  identical {row['identical']}  | {prompt[:40]!r}", flush=True)
    total_plain = sum(r["tokens"] / r["plain_tps"] for r in rows)
    total_spec = sum(r["tokens"] / r["ngram_tps"] for r in rows)
    print(f"overall speedup x{total_plain / total_spec:.2f} (backend {model.layer_specs[0]}, draft-max "
          f"{args.draft_max}, ngram-n {args.ngram_n})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
