"""Placement across backends: SmolLM2 split between numpy (layers 0-14) and torch (15-29 + the head).

The scheduler cuts the graph where the backend changes and copies the activations across; the split model must
clear the reference bar and agree closely with each single-backend run. An op a backend lacks runs on the CPU
(numpy) backend instead, and the log says which.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("torch")

import llmfw
from llmfw.core.backend import choose_host_backend
from llmfw.core.errors import BackendUnavailable
from llmfw.core.plugins import registry, reset_plugin_manager
from llmfw.plugins.backends.torch import TorchBackend

from support.scores import BAR

HALF = 15
PROMPT = 1
#: mean |log-prob difference| over llama.cpp's top-20 tokens allowed between two placements of one model;
#: numpy (f32 weights) and torch (fp16 weights) differ by float rounding only
SAME_MODEL_LP_TOL = 0.05


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def run(path, record, **params) -> tuple[np.ndarray, object]:
    with llmfw.load_model(path, **params) as model:
        sequence = record["sequence"]
        ctx = model.new_context(n_ctx=len(sequence), n_batch=len(sequence), n_threads=2)
        assert ctx.decode(llmfw.Batch(sequence, logits=True)) == 0, ctx.last_error
        plan = ctx._plan.describe()
        return ctx.get_logits().copy(), plan


def top20_lp_diff(a: np.ndarray, b: np.ndarray, record: dict) -> float:
    ids = np.array([p["top_ids"] for p in record["positions"]])
    rows = np.arange(len(ids))[:, None]
    return float(np.abs(log_softmax(a)[rows, ids] - log_softmax(b)[rows, ids]).mean())


def assert_clears_bar(result: dict, label: str) -> None:
    assert result["top1"] >= BAR["top1"] and result["top5"] >= BAR["top5"], (label, result)
    assert result["mean_lp_err"] <= BAR["mean_lp_err"], (label, result)


@pytest.fixture(scope="module")
def single_backend_logits(smollm2_path, smollm2_ref):
    record = smollm2_ref["prompts"][PROMPT]
    return {name: run(smollm2_path, record, backend=name)[0] for name in ("numpy", "torch")}


def test_half_numpy_half_torch_matches_both(smollm2_path, smollm2_ref, score, single_backend_logits) -> None:
    record = smollm2_ref["prompts"][PROMPT]
    placement = {il: "numpy" for il in range(HALF)}
    logits, plan = run(smollm2_path, record, backend="torch", placement=placement)
    # embedding lookup on the host, layers 0-14 on numpy, then one cut to torch for 15-29 and the head
    assert plan.split(" | ")[0].startswith("numpy") and plan.split(" | ")[-1].startswith("torch"), plan
    assert plan.count("torch") == 1, plan
    result = score(record, logits)
    print(f"\nsplit numpy/torch: {result}; plan {plan}")
    assert_clears_bar(result, "numpy 0-14 + torch 15-29")
    for name, single in single_backend_logits.items():
        diff = top20_lp_diff(logits, single, record)
        print(f"mean |lp(split) - lp({name})| = {diff:.4f}")
        assert diff <= SAME_MODEL_LP_TOL, name
        assert (logits.argmax(-1) == single.argmax(-1)).mean() >= 0.95, name


def test_interleaved_placement(smollm2_path, smollm2_ref, score, single_backend_logits) -> None:
    """Every other layer on numpy: 30 cuts each way, still the same model."""
    record = smollm2_ref["prompts"][PROMPT]
    placement = {il: "numpy" for il in range(0, 30, 2)}
    logits, plan = run(smollm2_path, record, backend="torch", placement=placement)
    assert plan.count("torch") >= 15, plan
    assert_clears_bar(score(record, logits), "interleaved")
    assert top20_lp_diff(logits, single_backend_logits["numpy"], record) <= SAME_MODEL_LP_TOL


class TorchWithoutSilu(TorchBackend):
    """A torch backend that lacks one op, as a third-party backend might."""

    name = "torch-without-silu"
    supported_ops = TorchBackend.supported_ops - {"silu"}


def test_missing_op_falls_back_to_the_cpu_backend(smollm2_path, smollm2_ref, score, single_backend_logits,
                                                   caplog) -> None:
    registry("backends").register(TorchWithoutSilu.name, TorchWithoutSilu, source="tests/reference/test_placement.py")
    record = smollm2_ref["prompts"][PROMPT]
    try:
        with caplog.at_level(logging.WARNING, logger="llmfw.core.scheduler"):
            logits, plan = run(smollm2_path, record, backend=TorchWithoutSilu.name)
    finally:  # the next test sees only the installed backends again
        reset_plugin_manager()
    host = choose_host_backend({})  # the highest-priority host backend: native where its extension is built
    assert any("lacks op 'silu'" in r.getMessage() and host in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    assert host in plan and TorchWithoutSilu.name in plan, plan
    assert_clears_bar(score(record, logits), f"silu on {host}")
    assert top20_lp_diff(logits, single_backend_logits["torch"], record) <= SAME_MODEL_LP_TOL


def test_gpu_layers_without_a_gpu_is_a_clear_error(smollm2_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(BackendUnavailable, match="CUDA"):
        llmfw.load_model(smollm2_path, backend="torch", n_gpu_layers=4)
