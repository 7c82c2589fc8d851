"""Prompt cache: time to the first generated token of a ~1,000-token prompt, without and with a saved state.

    python benchmarks/prompt_cache_bench.py [--model smollm2] [--backend BACKEND] [--tokens 1000]

Run 1: fresh context, decode the whole prompt, sample the first token, save the state (``run --prompt-cache``
does the same). Run 2: another fresh context loads the state, decodes the one token the cache must re-decode
for its logits, samples. Both first tokens must be equal. The ratio of the two times is the speed-up.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def first_token(ctx, prompt_tokens, state=None) -> tuple[int, float]:
    from llmfw.core.generation.generate import generate, GenerationStats

    t0 = time.perf_counter()
    if state is not None:
        ctx.state_load_file(state)
    stats = GenerationStats()
    for _ in generate(ctx, prompt_tokens, max_tokens=1, stats=stats):
        pass
    return stats.tokens[0], time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    import llmfw

    model = llmfw.load_model(args.model, backend=args.backend)
    text = (ROOT / "tests" / "data" / "tools" / "lighthouses.txt").read_text(encoding="utf-8")
    tokens = model.vocab.tokenize(text, add_special=True, parse_special=False)[:args.tokens]
    model.sha256  # noqa: B018 - computed (or read from its memo) once, as a loaded model would have it
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "prompt.bin"
        ctx = model.new_context(n_ctx=2048)
        tok1, t_cold = first_token(ctx, tokens)
        t0 = time.perf_counter()
        ctx.state_save_file(state, ctx.token_records[0])
        t_save = time.perf_counter() - t0
        tok2, t_warm = first_token(model.new_context(n_ctx=2048), tokens, state)
        size = state.stat().st_size
    print(f"{len(tokens)} prompt tokens, backend {model.layer_specs[0]}: first token after {t_cold:.3f} s cold, "
          f"{t_warm:.3f} s from the saved state (x{t_cold / t_warm:.1f}); save {t_save:.3f} s, "
          f"{size / 1e6:.1f} MB; same token: {tok1 == tok2}")
    sys.exit(0 if tok1 == tok2 else 1)


if __name__ == "__main__":
    main()
