"""benchmarks/onnx_int8_route.py (the measured-and-rejected int8 prefill route, docs/backends.md): each route builds a graph
ONNX Runtime runs, its logits stay near MatMulNBits' without being its bits, and removing it restores the backend."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import llmfw  # noqa: E402
from benchmarks import onnx_int8_route  # noqa: E402

PROMPT = list(range(300, 316))


def prompt_logits(path: Path) -> np.ndarray:
    with llmfw.load_model(path, backend="onnx") as model:
        ctx = model.new_context(n_ctx=64)
        assert ctx.decode(llmfw.Batch(PROMPT, logits=True)) == 0
        logits = np.array(ctx.get_logits())
        ctx.close()
    return logits


@pytest.fixture(scope="module")
def baseline(smollm2_path) -> np.ndarray:
    return prompt_logits(smollm2_path)


@pytest.mark.parametrize("route", ["rows", "rows2"])
def test_route_runs_near_matmulnbits_but_not_on_its_bits(route, smollm2_path, baseline):
    try:
        onnx_int8_route.install_route(route, only="")
        logits = prompt_logits(smollm2_path)
    finally:
        onnx_int8_route.install_route(None, only="")
    assert logits.shape == baseline.shape and np.isfinite(logits).all()
    assert not np.array_equal(logits, baseline)
    # near: every row's logits follow MatMulNBits' (a broken graph, e.g. wrong scales or zero point, would not)
    correlation = [np.corrcoef(ours, theirs)[0, 1] for ours, theirs in zip(logits, baseline)]
    assert min(correlation) > 0.9, correlation
    assert prompt_logits(smollm2_path).tobytes() == baseline.tobytes()  # the backend's own translation again
