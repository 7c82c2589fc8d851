"""The third-party recurrent toy architecture ``toyconv`` from ``examples/llmfw-toyconv`` (issue 34), installed like
any plugin package: found through its entry point, run on the ``recurrent`` memory, checked against a plain-numpy
implementation of the same network (no other implementation of this toy exists), on numpy and on onnx."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.plugins import install_example_package

import llmfw
from llmfw.core.plugins import registry, reset_plugin_manager
from llmfw.core.runtime.recurrent import RecurrentMemory

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "examples" / "llmfw-toyconv"
sys.path.insert(0, str(PACKAGE / "tests"))
from toyconv_model import oracle_logits, write_toyconv  # noqa: E402  (the package's own test helper)

TOKENS = [1, 5, 20, 3, 9, 9, 14, 30, 7, 22, 11, 4, 8, 33, 2, 19, 25, 6]
ATOL = 2e-3


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory) -> Path:
    return install_example_package(PACKAGE.name, tmp_path_factory)


@pytest.fixture()
def toyconv(site_dir, monkeypatch, tmp_path):
    """The model file, with llmfw's plugin manager rebuilt around the installed package (and again afterwards)."""
    monkeypatch.syspath_prepend(str(site_dir))
    reset_plugin_manager()
    yield write_toyconv(tmp_path / "toyconv.gguf")
    reset_plugin_manager()


def test_plugins_lists_toyconv_from_its_package(site_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site_dir), str(ROOT)])}
    out = subprocess.run([sys.executable, "-m", "llmfw.cli", "plugins", "--json"], env=env, check=True,
                         capture_output=True, text=True).stdout
    listing = json.loads(out)
    entries = [e for e in listing["plugins"]["architectures"] if e["name"] == "toyconv"]
    assert entries == [{"name": "toyconv", "ref": "llmfw_toyconv:ToyConvArchitecture",
                        "source": "llmfw-toyconv 0.1.0"}]


@pytest.mark.parametrize("backend", ["numpy", "onnx"])
def test_toyconv_matches_its_numpy_oracle(toyconv, backend):
    assert registry("architectures").entry("toyconv").source == "llmfw-toyconv 0.1.0"
    want = oracle_logits(TOKENS)
    with llmfw.load_model(toyconv, backend=backend) as model:
        ctx = model.new_context(n_ctx=256, n_ubatch=4)  # five ubatches: the window carried from one to the next
        assert isinstance(ctx.memory, RecurrentMemory) and ctx.memory.cache_names == []
        assert ctx.decode(llmfw.Batch(TOKENS, logits=True)) == 0, ctx.last_error
        np.testing.assert_allclose(ctx.get_logits(), want, atol=ATOL)


def test_toyconv_fork_and_saved_state(toyconv, tmp_path):
    """seq_cp forks a decoded prefix; each branch then decodes like its whole sequence alone. A saved state
    restores the recurrent memory (it has no KV cache at all)."""
    prefix, tail_a, tail_b = TOKENS[:10], TOKENS[10:14], TOKENS[14:18]
    with llmfw.load_model(toyconv, backend="numpy") as model:
        ctx = model.new_context(n_ctx=256, n_seq_max=2)
        assert ctx.decode(llmfw.Batch(prefix)) == 0
        state = tmp_path / "prefix.state"
        ctx.state_save_file(state)
        ctx.memory.seq_cp(0, 1)
        tokens = [t for pair in zip(tail_a, tail_b) for t in pair]
        assert ctx.decode(llmfw.Batch(tokens, seq_id=[0, 1] * 4, logits=True)) == 0, ctx.last_error
        np.testing.assert_allclose(ctx.get_logits()[0::2], oracle_logits(prefix + tail_a)[10:], atol=ATOL)
        np.testing.assert_allclose(ctx.get_logits()[1::2], oracle_logits(prefix + tail_b)[10:], atol=ATOL)
        restored = model.new_context(n_ctx=256, n_seq_max=2)
        assert restored.state_load_file(state) == prefix
        assert restored.decode(llmfw.Batch(tail_b, logits=True)) == 0
        np.testing.assert_allclose(restored.get_logits(), oracle_logits(prefix + tail_b)[10:], atol=ATOL)
