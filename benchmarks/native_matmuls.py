"""A decode step's matmuls alone: the native backend's own weights, in a step's order, one row against several.

    python3 benchmarks/native_matmuls.py [-m smollm2] [--rows 1,4] [-t 2] [-r 6] [--attention]

Loads the model on the native backend (its weights as a step reads them: the repacked-weight cache mapped in huge
pages, the matmuls that share an input fused), then calls the kernels' matmul (``nat_mul_mat``: the pool, the
activations' quantization, the kernel) on every layer's weights in a decode step's order — attention's inputs, its
output, the FFN's inputs, its output — and the output head, with random activations of each ``--rows`` count: no
other op between them, unless ``--attention`` puts one layer's attention (an f16 cache of the model's KV heads per
layer, each sequence seeing 64 cells of its own) before each layer's attention output, as in a step. Rounds of
each row count take turns; prints the best and median seconds the matmul calls of one pass took (the attention
between them not counted) and each count's ratio to one row's (the ctypes call around each, a few microseconds,
is in every count). Where the numbers
stand is in the docs' benchmarks page (where a native decode step goes), not here.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import llmfw  # noqa: E402
from llmfw.core.errors import LLMFWError  # noqa: E402
from llmfw.plugins.backends.native import kernels  # noqa: E402
from native_tile import counts  # noqa: E402  (this folder: the row counts' parser)

#: a layer's matmuls in a decode step's order, each by a part its weight (fused or not) holds
LAYER_MATMULS = ("attn_q", "attn_output", "ffn_up", "ffn_down")
VISIBLE_CELLS = 64  # each sequence's cells in --attention's caches: the mean depth of llmfw bench's tg128


def step_weights(weights: dict[str, Any], n_layers: int) -> list[tuple[str, Any]]:
    """The matrices a decode step multiplies by, in its order: per layer the weight (fused, where the backend fused
    it) holding each of LAYER_MATMULS' parts, then the output head."""
    chosen = []
    for layer in range(n_layers):
        for part in LAYER_MATMULS:
            name = f"blk.{layer}.{part}.weight"
            fused = [key for key in weights if "+" in key and name in key.split("+")]
            chosen.append(fused[0] if fused else name)
    chosen.append("output.weight" if "output.weight" in weights else "token_embd.weight")
    missing = [name for name in chosen if name not in weights]
    if missing:
        raise SystemExit(f"native_matmuls: no weight {missing[0]} on the native backend (a dense transformer's "
                         f"{', '.join(LAYER_MATMULS)} matmuls expected)")
    return [(name, weights[name]) for name in chosen]


def attention_call(lib: Any, pool: kernels.ThreadPool, isa: int, hparams: Any, rows: int,
                   rng: np.random.Generator) -> Callable[[int], None]:
    """A function attending `rows` decode rows over layer l's own f16 cache (each row its own VISIBLE_CELLS cells;
    the first layer's head counts and key width for every layer)."""
    heads, kv_heads, dim = hparams.n_head(), hparams.n_head_kv(), hparams.n_embd_head_k
    cells = rows * VISIBLE_CELLS
    caches = [(rng.standard_normal((kv_heads, cells, dim)).astype(np.float16),
               rng.standard_normal((kv_heads, cells, dim)).astype(np.float16)) for _ in range(hparams.n_layer)]
    q = rng.standard_normal((rows, heads, dim)).astype(np.float32)
    out = np.empty((rows, heads * dim), np.float32)
    mask = np.full((rows, cells), -np.inf, np.float32)
    for row in range(rows):
        mask[row, row::rows] = 0.0  # sequences decoded together take turns cell by cell

    def attend(layer: int) -> None:
        k, v = caches[layer]
        lib.nat_attention(pool.handle, isa, q.ctypes.data, k.ctypes.data, v.ctypes.data, mask.ctypes.data, None, None,
                          out.ctypes.data, rows, heads, kv_heads, dim, dim, cells, cells, dim ** -0.5, 0.0, 1)
    return attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="smollm2")
    parser.add_argument("--rows", type=counts, default=[1, 4], help="activation rows of each pass (1-64)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("-r", "--rounds", type=int, default=6, help="rounds of three passes of each row count")
    parser.add_argument("--attention", action="store_true", help="each layer's attention before its output matmul")
    args = parser.parse_args()
    if not 1 <= args.threads <= 64 or args.rounds < 1 or max(args.rows) > 64:
        raise SystemExit("native_matmuls: --threads and --rows from 1 to 64, --rounds at least 1")
    try:
        model = llmfw.load_model(args.model, backend="native")
    except LLMFWError as exc:
        raise SystemExit(f"native_matmuls: {exc}") from None
    try:
        backend = next(iter(model.backends.values()))
        hparams = model.hparams
        weights = step_weights(backend.weights, hparams.n_layer)
        lib, pool = kernels.load_library(), kernels.ThreadPool(args.threads)
        isa = kernels.ISAS.index(backend.isa)
        rng = np.random.default_rng(0)
        passes = {rows: one_pass(lib, pool, isa, weights, rows, rng,
                                 attention_call(lib, pool, isa, hparams, rows, rng) if args.attention else None)
                  for rows in args.rows}
        times: dict[int, list[float]] = {rows: [] for rows in args.rows}
        for _ in range(args.rounds):
            for rows, run in passes.items():
                times[rows] += [run() for _ in range(3)]
        total = sum(matrix.packed.data.nbytes for _, matrix in weights) / 1e6
        print(f"{args.model}: {len(weights)} matmuls ({total:.1f} MB), {backend.isa}, {args.threads} threads"
              f"{', attention between' if args.attention else ''}\n| rows | best ms | median ms | median / one row's |"
              "\n|---|---|---|---|")
        base = statistics.median(times[args.rows[0]])
        for rows, spent in times.items():
            print(f"| {rows} | {min(spent) * 1e3:.3f} | {statistics.median(spent) * 1e3:.3f} | "
                  f"{statistics.median(spent) / base:.2f}x |")
    finally:
        model.close()


def one_pass(lib: Any, pool: kernels.ThreadPool, isa: int, weights: list[tuple[str, Any]], rows: int,
             rng: np.random.Generator, attend: Callable[[int], None] | None) -> Callable[[], float]:
    """A function making one pass over the weights with `rows` activation rows, returning the seconds its matmul
    calls took (the attention between them, if any, not counted)."""
    calls = []
    for name, matrix in weights:
        x = rng.standard_normal((rows, matrix.packed.n_cols)).astype(np.float32)
        y = np.empty((rows, matrix.packed.n_rows), np.float32)
        layer = int(name.split(".")[1]) if name.startswith("blk.") and ".attn_output." in name else None
        calls.append((ctypes.byref(matrix.c_struct), x, y, layer))

    def run() -> float:
        spent = 0.0
        for struct, x, y, layer in calls:
            if attend is not None and layer is not None:
                attend(layer)
            start = time.perf_counter()
            lib.nat_mul_mat(pool.handle, isa, struct, x.ctypes.data, rows, y.ctypes.data)
            spent += time.perf_counter() - start
        return spent
    return run


if __name__ == "__main__":
    main()
