"""Perplexity: llama-perplexity's method, checked against llama.cpp's numbers on a committed text.

tests/data/tools/lighthouses.txt is original prose written for these tests (CC0). llama.cpp's numbers in
tests/data/tools/llama_cpp_tools.json come from tests/reference_gen/make_tools_data.py (llama-cpp-python
0.3.36). The full-size proof (20 chunks of 512 on a longer document, every backend) is
benchmarks/perplexity_vs_llamacpp.py; its numbers are in docs/correctness.md.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmfw.core.errors import ContextError
from llmfw.core.perplexity import perplexity, perplexity_of_tokens, perplexity_tokens, token_nll
from support.cli import llmfw_in_process

DATA = Path(__file__).parents[1] / "data" / "tools"
TEXT = (DATA / "lighthouses.txt").read_text(encoding="utf-8")
#: every chunk of the text (11 of 128 tokens, 693 scored): fewer chunks score too few tokens for a 1 % bar —
#: Gemma-3's estimate after 1-3 chunks is 0.6-1.4 % off llama.cpp's, after all 11 it is 0.5 % off
N_CTX = 128


def llama_cpp_ppl(which: str, n_ctx: int) -> dict:
    data = json.loads((DATA / "llama_cpp_tools.json").read_text())
    return next(p for p in data["models"][which]["perplexity"] if p["n_ctx"] == n_ctx)


def test_token_nll_is_minus_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11)).astype(np.float32) * 4
    targets = rng.integers(0, 11, size=5)
    probs = np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True)
    assert np.allclose(token_nll(logits, targets), -np.log(probs[np.arange(5), targets]), rtol=1e-12)
    assert np.isfinite(token_nll(np.array([[1e4, -1e4]], dtype=np.float32), np.array([1]))).all()


@pytest.mark.parametrize("backend", ["numpy", "torch", "onnx", "native"])
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_perplexity_within_one_percent_of_llama_cpp(which, backend, shared_models):
    if backend == "onnx":
        pytest.importorskip("onnxruntime")
    if backend == "native":
        from support.native import kernels_or_skip

        kernels_or_skip()
    model = shared_models.get(which, backend)
    tokens = perplexity_tokens(model, TEXT)
    ref = llama_cpp_ppl(which, N_CTX)
    assert len(tokens) == ref["n_tokens"]  # llama.cpp's tokenization, BOS included where the vocabulary adds it
    with model.new_context(n_ctx=N_CTX, n_batch=N_CTX) as ctx:
        result = perplexity_of_tokens(ctx, tokens, N_CTX)
    assert result.n_chunks == ref["n_chunks"] == len(tokens) // N_CTX
    assert result.n_scored == result.n_chunks * (N_CTX - 1 - N_CTX // 2)
    assert abs(result.ppl / ref["ppl"] - 1) < 0.01
    assert abs(result.stderr / ref["stderr"] - 1) < 0.05


def test_batches_smaller_than_a_chunk_give_the_same_estimate(shared_models):
    model = shared_models.get("smollm2", "numpy")
    whole = perplexity(model, TEXT, n_ctx=N_CTX, n_chunks=2)
    split = perplexity(model, TEXT, n_ctx=N_CTX, n_batch=48, n_chunks=2)  # 48 < n_ctx/2: a batch with no output
    assert math.isclose(whole[0], split[0], rel_tol=1e-4) and math.isclose(whole[1], split[1], rel_tol=1e-3)


def test_cli_prints_running_estimates_and_llama_perplexitys_final_line(smollm2_path, tmp_path):
    cmd = [sys.executable, "-m", "llmfw.cli", "perplexity", "-m", str(smollm2_path), "-f", str(DATA / "lighthouses.txt"),
           "-c", str(N_CTX), "--chunks", "2", "--backend", "numpy", "--no-progress"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert re.fullmatch(r"\[1\]\d+\.\d{4},\[2\]\d+\.\d{4},", lines[0])
    final = re.fullmatch(r"Final estimate: PPL = (\d+\.\d{4}) \+/- (\d+\.\d{5})", lines[-1])
    assert final, lines[-1]
    ref = llama_cpp_ppl("smollm2", N_CTX)["running"][1]
    assert abs(float(final.group(1)) / ref - 1) < 0.02  # 2 chunks, 126 scored tokens


def test_bad_input_is_a_clear_error(smollm2_path, shared_models, tmp_path):
    model = shared_models.get("smollm2", "numpy")
    with pytest.raises(ContextError, match="at least 2\\*n_ctx"):
        perplexity(model, "too short", n_ctx=128)
    with pytest.raises(ContextError, match="n_ctx must be at least"):
        perplexity(model, TEXT, n_ctx=2)
    base = ["perplexity", "-m", str(smollm2_path), "--no-progress"]
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    for args, message in [(["-f", str(tmp_path / "none.txt")], "cannot read"), (["-f", str(binary)], "not UTF-8"),
                          (["-f", str(DATA / "lighthouses.txt"), "--chunks", "0"], "--chunks"),
                          (["-f", str(DATA / "lighthouses.txt"), "-c", "4096"], "2*n_ctx")]:
        result = llmfw_in_process(*base, *args)
        assert result.returncode != 0 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
