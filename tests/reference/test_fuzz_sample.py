"""A small sample of benchmarks/fuzz_gguf.py (the run at scale is a benchmark, its figures in docs/correctness.md):
mutated headers / tensor tables and vocabularies of both real models, NaN / inf quant blocks. Every case ends
normally or with an LLMFWError, within the fuzzer's 2 s watchdog, allocating at most its input's size."""
from __future__ import annotations

import random
import struct
import sys
import tracemalloc
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import fuzz_gguf  # noqa: E402

from llmfw.core.errors import GGUFError  # noqa: E402
from llmfw.core.gguf import GGUFValueType, GGUFWriter, open_gguf  # noqa: E402


@pytest.fixture(scope="module")
def real_models(smollm2_path, gemma3_path) -> list[Path]:
    return [Path(smollm2_path), Path(gemma3_path)]


def test_mutated_headers_and_tensor_tables(real_models, tmp_path):
    seeds = [fuzz_gguf.header_seed(path, tmp_path) for path in real_models]
    assert all(seed.table_start < len(seed.header) for seed in seeds)
    tally = fuzz_gguf.fuzz_headers(seeds, 40, tmp_path, random.Random(1))
    assert tally.failures == 0, tally.crashes
    assert tally.cases == 40 and any(k.startswith("error:") for k in tally.outcomes)


def test_unmutated_header_seeds_load(real_models, tmp_path):
    for path in real_models:
        seed = fuzz_gguf.header_seed(path, tmp_path)
        target = tmp_path / "seed.gguf"
        fuzz_gguf.write_sparse(target, seed.header, seed.data_bytes)
        outcome, _, _ = fuzz_gguf.run_guarded(lambda target=target: fuzz_gguf.load_like_load_model(target), limit_s=60)
        assert outcome == "ok"  # so the mutations are what the loader must survive


def test_mutated_vocabularies(real_models):
    bases = [fuzz_gguf.tokenizer_keys(path) for path in real_models]
    tally = fuzz_gguf.fuzz_vocabs(bases, 6, random.Random(2))
    assert tally.failures == 0, tally.crashes
    assert tally.traced >= 1


def test_nan_and_inf_quant_blocks_dequantize():
    tally = fuzz_gguf.fuzz_quants(3)
    assert tally.failures == 0, tally.crashes
    assert tally.cases >= 4 * 15


@pytest.mark.parametrize("mode", ["mmap", "read"])
def test_a_huge_string_length_costs_at_most_the_file(tmp_path, mode):
    # a key whose string length claims almost all of an 8 MiB file of invalid UTF-8: one bounded pass, no copies
    path = tmp_path / "huge-string.gguf"
    writer = GGUFWriter(path)
    writer.add("general.architecture", "llama")
    writer.write()
    data = bytearray(path.read_bytes())
    size = 8 << 20
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4  # the string's u64 length, after the key and its type tag
    struct.pack_into("<Q", data, at, size - at - 8)
    data += b"\xff" * (size - len(data))
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError, match="not valid UTF-8"):
            open_gguf(path, mode)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # mmap: a few chunks of the validation pass; read mode: the buffer the header is read into (grown by doubling)
    assert peak < (2 * size if mode == "read" else 4 << 20), peak


@pytest.mark.parametrize("element", ["bool", "string"])
def test_a_huge_array_count_costs_at_most_the_file(tmp_path, element):
    # an array whose count claims the rest of a 2 MiB file of zero bytes (empty strings / false bools): the value
    # is built once, at its final size (it used to be copied once more, or grown by doubling)
    path = tmp_path / f"huge-{element}-array.gguf"
    writer = GGUFWriter(path)
    writer.add("general.architecture", "llama")
    if element == "bool":
        writer.add("x.flags", [True], GGUFValueType.ARRAY, array_type=GGUFValueType.BOOL)
    else:
        writer.add("x.names", ["a"], GGUFValueType.ARRAY, array_type=GGUFValueType.STRING)
    writer.write()
    data = bytearray(path.read_bytes())
    size = 2 << 20
    count_at = data.index(b"x.") + len("x.flags") + 4 + 4  # after the key, the ARRAY tag and the element type
    struct.pack_into("<Q", data, count_at, (size - count_at - 8) // (1 if element == "bool" else 8))
    data += bytes(size - len(data))
    path.write_bytes(data)
    tracemalloc.start()
    try:
        try:
            with open_gguf(path) as gguf:
                assert len(next(v for k, v in gguf.metadata.items() if k.startswith("x."))) > 1000
        except GGUFError:
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.1 * size, peak


def test_native_repacking_of_mutated_tables(real_models, tmp_path):
    """Tensors of mutated headers that the GGUF reader opens (changed ones and unchanged ones) through the native
    repacker and one product on each ISA path: no crash, no hang (benchmarks/fuzz_gguf.py --repack at scale)."""
    kernels = fuzz_gguf.native_kernels()
    if kernels is None:
        pytest.skip("the native extension is not built")
    seeds = [fuzz_gguf.header_seed(path, tmp_path) for path in real_models]
    tally = fuzz_gguf.fuzz_repack(seeds, 60, tmp_path, random.Random(3), kernels)
    assert tally.failures == 0, tally.crashes
    assert tally.cases == 60 and any(k.startswith("changed:") for k in tally.outcomes), tally.outcomes
