"""The physical limit of token generation on this machine: a decode step reads every weight a token touches once, so
``tg <= streaming-read bandwidth / bytes read per token``.

* **Bandwidth** — a streaming read of a buffer far larger than the caches (numpy's integer OR-reduction, which
  does one cheap operation per 8 bytes, so memory, not arithmetic, is what it waits for), on 1 and 2 threads
  (each reads its own half; numpy releases the GIL inside the reduction). The best of ``--repeats`` runs.
* **Bytes per token** of each model, from its GGUF table: every tensor a decode step reads whole (each matrix of
  every layer, the norms, the output head — for a model whose head is its token embedding, that whole table),
  one row of the token embedding otherwise, and the KV cache at the mean position of a ``-n`` token run (f16 as
  llama.cpp keeps it). Stated for the weights as the file stores them (what llama.cpp streams) and as the native
  backend's repacked layout holds them (csrc/native.h: whole bytes for 5/6/8-bit codes and a float32 scale and
  offset per 16 or 32 values, larger than the file's blocks).
* **Measured tg** of llmfw's backends and llama.cpp, taken from ``llmfw bench --json`` results files
  (``--bench FILE``, one per model), so the table sets each engine against the bound.

    python benchmarks/bandwidth_bound.py --bench benchmarks/results/tg-smollm2.json \\
        --bench benchmarks/results/tg-gemma3.json --json benchmarks/results/bandwidth-bound.json

``benchmarks/make_docs.py`` renders the results file (``"kind": "bandwidth_bound"``) into the benchmark page.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llmfw.commands.machine import describe_machine  # noqa: E402
from llmfw.core.format.gguf import open_gguf  # noqa: E402
from llmfw.core.format.quants import TYPE_INFO, GGMLType  # noqa: E402

KIND = "bandwidth_bound"
KV_BYTES = 2  # f16, as llama.cpp keeps its KV cache


def read_bandwidth(n_threads: int, size_mib: int, repeats: int) -> float:
    """Bytes per second of a streaming read of ``size_mib`` MiB split over ``n_threads`` threads (best run)."""
    buffer = np.ones((size_mib << 20) // 8, dtype=np.uint64)
    parts = np.array_split(buffer, n_threads)
    best = 0.0
    for _ in range(repeats):
        barrier = threading.Barrier(n_threads + 1)

        def read(part: np.ndarray, barrier: threading.Barrier) -> None:
            barrier.wait()
            np.bitwise_or.reduce(part)

        threads = [threading.Thread(target=read, args=(part, barrier)) for part in parts]
        for thread in threads:
            thread.start()
        barrier.wait()
        start = time.perf_counter()
        for thread in threads:
            thread.join()
        best = max(best, buffer.nbytes / (time.perf_counter() - start))
    return best


def native_bytes(ggml_type: GGMLType, ne: tuple[int, ...], n_bytes: int) -> int:
    """The bytes of a tensor in the native backend's repacked layout (its file bytes where it stays as it is)."""
    from llmfw.plugins.backends.native.repack import FLOAT_KINDS, LAYOUTS, packed_bytes

    if len(ne) != 2 or (ggml_type not in LAYOUTS and ggml_type not in FLOAT_KINDS):
        return n_bytes
    if ggml_type in FLOAT_KINDS:
        return packed_bytes(FLOAT_KINDS[ggml_type], int(ne[1]), int(ne[0]), 0, False)
    layout = LAYOUTS[ggml_type]
    return packed_bytes(layout.kind, int(ne[1]), int(ne[0]), layout.n_scales, layout.has_offsets, layout.half_params,
                        layout.factored)


def _metadata_int(metadata: dict[str, Any], key: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if value is None:
        raise KeyError(key)
    return int(value[0] if isinstance(value, (list, tuple, np.ndarray)) else value)


def bytes_per_token(model: Path, n_gen: int) -> dict[str, Any]:
    """What one decode step reads, in bytes: weights as stored and as repacked, and the KV cache (see above)."""
    with open_gguf(model) as gguf:
        tensors, metadata = gguf.tensors, gguf.metadata
        arch = metadata["general.architecture"]
        tied = "output.weight" not in tensors
        stored = repacked = 0
        for name, info in tensors.items():
            qtype = GGMLType(int(info.ggml_type))
            if name == "token_embd.weight" and not tied:
                row = info.nbytes // int(info.shape[1])  # one row looked up per token
                stored, repacked = stored + row, repacked + row
                continue
            stored += info.nbytes
            repacked += native_bytes(qtype, tuple(info.shape), info.nbytes)
        n_layer = _metadata_int(metadata, f"{arch}.block_count")
        n_head = _metadata_int(metadata, f"{arch}.attention.head_count")
        n_head_kv = _metadata_int(metadata, f"{arch}.attention.head_count_kv", n_head)
        n_embd = _metadata_int(metadata, f"{arch}.embedding_length")
        head_k = _metadata_int(metadata, f"{arch}.attention.key_length", n_embd // n_head)
        head_v = _metadata_int(metadata, f"{arch}.attention.value_length", n_embd // n_head)
    mean_cells = (n_gen + 1) / 2
    kv = int(n_layer * n_head_kv * (head_k + head_v) * KV_BYTES * mean_cells)
    return {"model": model.name, "weights_stored": stored, "weights_repacked": repacked, "kv_at_mean_position": kv,
            "head_is_token_embedding": tied, "n_gen": n_gen,
            "types": sorted({GGMLType(int(i.ggml_type)).name for i in tensors.values()}),
            "block_bytes_per_32": {t.name: round(TYPE_INFO[t].type_size * 32 / TYPE_INFO[t].block_size, 2)
                                   for t in {GGMLType(int(i.ggml_type)) for i in tensors.values()}}}


def measured_tg(bench_file: Path) -> tuple[str, dict[str, float]]:
    """(model file name, engine → tg tokens/s) of one ``llmfw bench --json`` run."""
    run = json.loads(bench_file.read_text())
    test = f"tg{run['params']['n_gen']}"
    speeds = {f"llmfw {record['backend']}": record["tests"][test]["tps_median"] for record in run["llmfw"]
              if test in record["tests"]}
    if run.get("llama_cpp") and test in run["llama_cpp"]["tests"]:
        speeds["llama.cpp"] = run["llama_cpp"]["tests"][test]["tps_median"]
    return Path(run["params"]["model"]).name, speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", type=Path, help="GGUF files (default: the two catalog models)")
    parser.add_argument("--bench", type=Path, action="append", default=[],
                        help="an `llmfw bench --json` results file whose tg figures the table shows (repeatable)")
    parser.add_argument("-n", "--n-gen", type=int, default=128, help="tokens of the tg run (the KV cache's size)")
    parser.add_argument("--size-mib", type=int, default=1024, help="buffer streamed by the bandwidth test")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    from llmfw.core.format.catalog import resolve_model

    models = args.models or [Path(resolve_model("smollm2")), Path(resolve_model("gemma-3-270m"))]
    bandwidth = {str(n): read_bandwidth(n, args.size_mib, args.repeats) for n in (1, 2)}
    measured = dict(measured_tg(path) for path in args.bench)
    rows = []
    for model in models:
        row = bytes_per_token(model, args.n_gen)
        row["bound_tps"] = {n: bw / (row["weights_stored"] + row["kv_at_mean_position"]) for n, bw in bandwidth.items()}
        row["native_bound_tps"] = {n: bw / (row["weights_repacked"] + row["kv_at_mean_position"])
                                   for n, bw in bandwidth.items()}
        row["measured_tg_tps"] = measured.get(model.name, {})
        rows.append(row)
    result = {"kind": KIND, "machine": describe_machine(), "size_mib": args.size_mib, "repeats": args.repeats,
              "bandwidth_bytes_per_s": bandwidth, "bench_files": [p.name for p in args.bench], "models": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
