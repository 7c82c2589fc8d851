"""The memory a mixture-of-experts load adds (issue 33), on a generated qwen3moe file of about 140 MB
(tests/support/moe_file.py: Qwen3-30B-A3B's expert shapes and Q4_K_M's block types), each load in a fresh process;
and a load that cannot fit is refused before anything is allocated.

numpy keeps the experts as the file's blocks (decoded when a token picks them): the load adds at most 1.3x the
file, with room for allocator noise. The default backend (onnx) leaves the experts to the native backend, which
repacks them streaming into its cache and maps them (a token touches the pages of the experts it picks): at most
1.3x too, on the first load (repacking, cache empty) and on a cached one. onnx asked for by name converts every
expert into ONNX Runtime's MatMulNBits form, which is larger than a K-quant block (float scales, block sums;
docs/benchmarks.md, MoE memory): its bounds only guard against a regression. benchmarks/moe_memory.py measures
the same on a file of at least 1 GB.
"""
from __future__ import annotations

import pytest

import llmfw
from llmfw.core.errors import ConfigError, InsufficientMemory
from llmfw.core.runtime.memory_fit import MEMORY_ENV, parse_size
from llmfw.commands.bench_measure import current_rss
from support.moe_file import MoeFileShape, measure_load, write_moe_file
from support.native import kernels_or_skip

SHAPE = MoeFileShape(n_layer=1, n_embd=1024, n_head=8, n_head_kv=2, n_expert=128, n_expert_used=4, n_ff_exp=512)
#: the issue's bound on (peak RSS - RSS before the load) / file size
RATIO_BOUND = 1.3
#: onnx today: 2.3x after the load, 3.3x at the peak (MatMulNBits forms + ORT mapping the converted weights
#: while it prepacks them); a regression guard with room for noise, not the goal
ONNX_PEAK_GUARD, ONNX_AFTER_GUARD = 4.0, 2.8


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    return write_moe_file(tmp_path_factory.mktemp("moe-memory") / "moe.gguf", SHAPE)


def test_numpy_load_adds_at_most_1_3x_the_file(moe_file):
    record = measure_load(moe_file, "numpy", {})
    assert record["ratio"] <= RATIO_BOUND, record


def test_onnx_load_memory_does_not_regress(moe_file, tmp_path):
    record = measure_load(moe_file, "onnx", {"LLMFW_ONNX_CACHE_DIR": str(tmp_path / "cache")})
    assert record["after_ratio"] <= ONNX_AFTER_GUARD, record
    assert record["ratio"] <= ONNX_PEAK_GUARD, record


# the default today: 0.88x at the first load's peak (one expert tensor repacked beside its file pages), 0.43x
# cached, 0.38x after either; held to the bound, with room for noise
def test_the_default_load_adds_at_most_1_3x_the_file(moe_file, tmp_path):
    kernels_or_skip()
    env = {"LLMFW_ONNX_CACHE_DIR": str(tmp_path / "onnx"), "LLMFW_NATIVE_CACHE_DIR": str(tmp_path / "native")}
    first = measure_load(moe_file, "default", env)
    cached = measure_load(moe_file, "default", env)
    assert first["ratio"] <= RATIO_BOUND and cached["ratio"] <= RATIO_BOUND, (first, cached)


@pytest.mark.parametrize("backend", ["numpy", "onnx", "native"])
def test_a_load_that_does_not_fit_is_refused_before_allocating(moe_file, backend):
    if backend == "native":
        kernels_or_skip()
    before = current_rss()
    with pytest.raises(InsufficientMemory, match=r"need 0\.\d\d GiB .* 0\.05 GiB is available"):
        llmfw.load_model(moe_file, backend=backend, memory_available=50 << 20)
    # the metadata and vocabulary were read, no weight: far less than the 140 MB of experts
    assert current_rss() - before < 40 << 20


def test_the_environment_sets_the_memory_available(moe_file, monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, "20M")
    with pytest.raises(InsufficientMemory, match=MEMORY_ENV):
        llmfw.load_model(moe_file, backend="numpy")
    monkeypatch.setenv(MEMORY_ENV, "-1")  # the check off
    model = llmfw.load_model(moe_file, backend="numpy")
    model.close()


def test_memory_sizes_parse():
    assert parse_size("12G") == 12 << 30 and parse_size("512") == 512 and parse_size("1.5MiB") == 3 << 19
    with pytest.raises(ConfigError, match=MEMORY_ENV):
        parse_size("lots")
