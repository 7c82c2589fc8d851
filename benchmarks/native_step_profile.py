"""Where the native backend's decode step goes: per op, for one sequence and for N sequences decoded together.

    python3 benchmarks/native_step_profile.py [-m smollm2] [--seqs 4] [-n 128] [-t 2] [-r 3] [--isa auto]

Each run decodes ``-n`` steps from an empty cache (one token per sequence per step, every row's logits out, as
``llmfw bench``'s ``tg`` and ``tgNxS`` tests do). The step time is the wall time of ``Context.decode`` (the best of
``-r`` runs); the program time is the native programs' own C call (``nat_program_run``, the GIL released), and the
rest of a step is the Python around it (batch checks, the KV cache's bookkeeping and mask, the graph inputs, the
logits). The per-op split comes from one more run with ``backend_options={"native": {"profile": true}}``, whose
timers cost a little themselves: its sum is a bit above the unprofiled program time.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import llmfw  # noqa: E402
from llmfw.commands.bench import batched_step, random_tokens  # noqa: E402
from llmfw.core.errors import LLMFWError  # noqa: E402
from llmfw.plugins.backends.native import program as native_program  # noqa: E402


def program_timer() -> tuple[list[float], Callable[[], None]]:
    """Accumulate the seconds spent in the native programs' run (a list of one float), and a function undoing it."""
    spent = [0.0]
    original = native_program.Program.run

    def timed(self: Any, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        original(self, *args, **kwargs)
        spent[0] += time.perf_counter() - start

    native_program.Program.run = timed  # type: ignore[method-assign]
    return spent, lambda: setattr(native_program.Program, "run", original)


def decode_steps(ctx: Any, tokens: list[int], n_seqs: int, n_steps: int) -> float:
    """Seconds for n_steps decode steps of n_seqs sequences from an empty cache (as llmfw bench's tg and tgNxS)."""
    ctx.memory.clear()
    start = time.perf_counter()
    for step in range(n_steps):
        batch = llmfw.Batch([tokens[step % len(tokens)]]) if n_seqs == 1 else batched_step(tokens, step, n_seqs)
        if ctx.decode(batch) != 0:
            raise SystemExit(f"decode failed: {ctx.last_error}")
    return time.perf_counter() - start


def step_times(model_name: str, args: argparse.Namespace, profile: bool) -> tuple[dict[int, tuple[float, float]],
                                                                                  dict[int, dict[str, float]]]:
    """Per sequence count: (ms a step, ms of it in programs), and the per-op ms a step of the profiled run."""
    model = llmfw.load_model(model_name, backend="native", backend_options={"native": {"profile": profile, "isa": args.isa}})
    try:
        ctx = model.new_context(n_ctx=max(768, args.seqs * args.n_gen), n_batch=args.seqs, n_seq_max=args.seqs,
                                n_ubatch=args.seqs, n_threads=args.threads)
        tokens = random_tokens(model.n_vocab, 128)
        backend = next(iter(model.backends.values()))
        times, ops = {}, {}
        spent, undo = program_timer()
        try:
            for n_seqs in (1, args.seqs):
                decode_steps(ctx, tokens, n_seqs, args.n_gen)  # warm-up: programs compiled, caches warm
                best = None
                for _ in range(args.repeats):
                    spent[0] = 0.0
                    wall = decode_steps(ctx, tokens, n_seqs, args.n_gen)
                    if best is None or wall < best[0]:
                        best = (wall, spent[0])
                assert best is not None
                times[n_seqs] = (best[0] / args.n_gen * 1e3, best[1] / args.n_gen * 1e3)
                if profile:
                    before = backend.profile()
                    decode_steps(ctx, tokens, n_seqs, args.n_gen)
                    after = backend.profile()
                    ops[n_seqs] = {op: (after[op] - before.get(op, 0.0)) / args.n_gen * 1e3 for op in after}
        finally:
            undo()
        return times, ops
    finally:
        model.close()


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="smollm2")
    parser.add_argument("--seqs", type=positive, default=4, help="sequences decoded together in the batched runs")
    parser.add_argument("-n", "--n-gen", type=positive, default=128, help="decode steps a run")
    parser.add_argument("-t", "--threads", type=positive, default=2)
    parser.add_argument("-r", "--repeats", type=positive, default=3)
    parser.add_argument("--isa", default="auto", help="the kernels' ISA path (auto, scalar, avx2, avx512, amx)")
    args = parser.parse_args()
    try:
        times, _ = step_times(args.model, args, profile=False)
        _, ops = step_times(args.model, args, profile=True)
    except LLMFWError as exc:  # an unknown model, a file that does not load, a context it cannot make
        raise SystemExit(f"native_step_profile: {exc}") from None
    counts = sorted(times)
    print(f"{args.model}: native, {args.threads} threads, {args.n_gen} steps from an empty cache\n")
    print("| | " + " | ".join(f"{n} sequence{'s' if n > 1 else ''}" for n in counts) + " |")
    print("|---|" + "---|" * len(counts))
    print("| step (ms) | " + " | ".join(f"{times[n][0]:.3f}" for n in counts) + " |")
    print("| tokens/s | " + " | ".join(f"{n / times[n][0] * 1e3:.1f}" for n in counts) + " |")
    print("| in programs (ms) | " + " | ".join(f"{times[n][1]:.3f}" for n in counts) + " |")
    print("| Python around them (ms) | " + " | ".join(f"{times[n][0] - times[n][1]:.3f}" for n in counts) + " |")
    names = sorted({op for n in counts for op in ops[n]}, key=lambda op: -ops[counts[-1]].get(op, 0.0))
    for op in names:
        print(f"| `{op}` (ms, profiled) | " + " | ".join(f"{ops[n].get(op, 0.0):.3f}" for n in counts) + " |")
    if counts[-1] > 1:
        ratio = (counts[-1] / times[counts[-1]][0]) / (1 / times[1][0])
        print(f"\n{counts[-1]} sequences: {ratio:.2f}x one sequence's rate")


if __name__ == "__main__":
    main()
