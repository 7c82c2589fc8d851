"""One quantized matmul kernel of the native backend alone, in cycles per tile: no Python, thread pool or activation
quantization around it.

    python3 benchmarks/native_tile.py [-m smollm2] [--tensor blk.0.ffn_gate.weight] [--copies 1,10,200]
                                      [--rows 1,2,4,8] [--isa avx512|amx|avx2] [-t 1] [--paired] [--huge-pages]

Repacks one tensor of the model as the backend does, compiles ``benchmarks/native_tile.c`` with the kernels' sources
and ``setup.py``'s flags (gcc), and times ``nat_qgemm_<isa>`` for each activation row count (``--rows``): the best
of five rounds. ``-t`` threads split each call's row groups into equal shares and wait for each other after every
call, as the engine's pool does; cycles a tile are then the wall clock's over all threads' tiles. ``--copies`` lays
that many copies of the weight one after another and cycles through them, so the weight comes from L2 (1), L3 (a few
MB) or memory (far more than the L3). A tile is 16 weight rows by 32 columns, the unit of the AVX-512 path; cycles
come from the core's clock as a chain of dependent multiplies measures it. Numbers from such runs are in the docs'
benchmarks page, not here. ``--paired`` repacks the weight with its row groups side by side in pairs, as the
backend does where the AVX2 path runs (``repack.pairable`` types). ``--huge-pages`` lays the copies out in memory
advised to take 2 MiB pages, as the engine maps its repacked-weight cache (a weight streamed from memory then arrives
at the rate a decode step sees, not after a page walk every 4 KiB).
"""
from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from llmfw.core.errors import LLMFWError  # noqa: E402
from llmfw.core.format.catalog import resolve_model  # noqa: E402
from llmfw.core.format.gguf import open_gguf  # noqa: E402
from llmfw.plugins.backends.native import kernels, repack  # noqa: E402

CSRC = ROOT / "llmfw" / "plugins" / "backends" / "native" / "csrc"
MAX_WEIGHT_BYTES = 4 << 30  # all copies together
MAX_ROW_BYTES = 1 << 30  # the activation rows and outputs of one call
FLAGS = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-falign-loops=64"]


def counts(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every count must be at least 1")
    return values


def write_weight(model: str, tensor: str, path: Path, paired: bool = False) -> repack.PackedWeight:
    """Repack ``tensor`` of ``model`` (``paired``: its row groups in pairs) and write the header native_tile.c
    reads, then the weight's bytes."""
    with open_gguf(resolve_model(model)) as gguf:
        info = gguf.tensor_info(tensor)
        if len(info.shape) != 2:
            raise SystemExit(f"native_tile: {tensor} is not a matrix (shape {info.shape})")
        weight = repack.repack(gguf.tensor_bytes(tensor), int(info.ggml_type), info.shape, paired)
    if weight.kind not in kernels.QUANTIZED_KINDS:
        raise SystemExit(f"native_tile: {tensor} ({info.ggml_type.name}) is not quantized: no quantized matmul kernel runs it")
    data = np.ascontiguousarray(weight.data).view(np.uint8)
    head = struct.pack("<4i2q16b2i", weight.kind, weight.n_scales, int(weight.has_offsets), int(weight.half_params),
                       weight.n_rows, weight.n_cols, *(int(v) for v in weight.table), int(weight.factored),
                       int(weight.paired))
    path.write_bytes(head + struct.pack("<q", data.nbytes) + data.tobytes())
    return weight


def check_sizes(weight: repack.PackedWeight, copies: list[int], rows: list[int]) -> None:
    """Refuse runs whose copies or rows would take more memory than a benchmark should ask for."""
    if max(copies) * weight.data.nbytes > MAX_WEIGHT_BYTES:
        raise SystemExit(f"native_tile: {max(copies)} copies of {weight.data.nbytes / 1e6:.1f} MB exceed "
                         f"{MAX_WEIGHT_BYTES >> 30} GiB; ask for fewer")
    if max(rows) * (weight.n_rows + weight.n_cols) * 4 > MAX_ROW_BYTES:
        raise SystemExit(f"native_tile: {max(rows)} rows of this weight's inputs and outputs exceed "
                         f"{MAX_ROW_BYTES >> 30} GiB; ask for fewer")


def compile_harness(out: Path) -> None:
    sources = [ROOT / "benchmarks" / "native_tile.c", CSRC / "kernels_x86.c", CSRC / "kernels_scalar.c"]
    subprocess.run(["gcc", *FLAGS, f"-I{CSRC}", *map(str, sources), "-lm", "-o", str(out)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="smollm2")
    parser.add_argument("--tensor", default="blk.0.ffn_gate.weight")
    parser.add_argument("--copies", type=counts, default=[1, 10, 200], help="copies of the weight cycled through")
    parser.add_argument("--rows", type=counts, default=[1, 2, 4, 8], help="activation rows of each timed call")
    parser.add_argument("--isa", choices=["amx", "avx512", "avx2"], default="avx512")
    parser.add_argument("-t", "--threads", type=int, default=1, help="threads sharing each call (1-64)")
    parser.add_argument("--paired", action="store_true", help="the row groups side by side in pairs")
    parser.add_argument("--huge-pages", action="store_true", help="the copies in memory advised to take huge pages")
    args = parser.parse_args()
    if not 1 <= args.threads <= 64:
        raise SystemExit(f"native_tile: --threads {args.threads}: from 1 to 64")
    if args.isa not in kernels.available_isas():
        raise SystemExit(f"native_tile: this CPU cannot run the {args.isa} path (it runs {kernels.available_isas()})")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            weight_file, harness = Path(tmp) / "weight.bin", Path(tmp) / "native_tile"
            weight = write_weight(args.model, args.tensor, weight_file, args.paired)
            check_sizes(weight, args.copies, args.rows)
            compile_harness(harness)
            print(f"{args.tensor} of {args.model}: {weight.n_rows} x {weight.n_cols}, {weight.data.nbytes / 1e6:.2f} MB "
                  f"repacked, {args.isa}, {args.threads} thread{'s' if args.threads > 1 else ''}"
                  f"{', huge pages' if args.huge_pages else ''}")
            for copies in args.copies:
                calls = max(2 * copies, 4000 // copies)  # each round reads every copy: their total size decides the cache
                run = subprocess.run([str(harness), str(weight_file), str(copies), str(calls), args.isa,
                                      str(args.threads), "huge" if args.huge_pages else "small",
                                      *map(str, args.rows)], check=True, capture_output=True,
                                     text=True)
                lines = run.stdout.split("\n")
                print(f"\n{copies} cop{'y' if copies == 1 else 'ies'} ({copies * weight.data.nbytes / 1e6:.1f} MB), "
                      f"{lines[0]}\n| rows | us a call | cycles a tile | cycles a tile per row | GB/s |\n|---|---|---|---|---|")
                for line in filter(None, lines[1:]):
                    rows, micros, cycles = line.split()
                    gbps = weight.data.nbytes / float(micros) / 1e3  # the weight's bytes a call
                    print(f"| {rows} | {float(micros):.2f} | {float(cycles):.1f} | {float(cycles) / int(rows):.1f} | "
                          f"{gbps:.1f} |")
    except (OSError, LLMFWError) as exc:  # a missing model or tensor, no gcc
        raise SystemExit(f"native_tile: {exc}") from None
    except subprocess.CalledProcessError as exc:  # the compile or the timing loop failed: what it said
        raise SystemExit(f"native_tile: {exc} {(exc.stderr or '').strip()}") from None


if __name__ == "__main__":
    main()
