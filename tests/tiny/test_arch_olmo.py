"""The third-party ``olmo`` architecture from ``examples/llmfw-olmo``, installed like any plugin package.

The package is pip-installed (no dependencies, into a temporary directory on the path), so llmfw finds it only
through its entry point in the group ``llmfw``; then ``llmfw plugins --json`` must show ``olmo`` coming from
``llmfw-olmo``, and the model it runs must match llama.cpp on the random-weight OLMo file (non-parametric layer
norms, QKV clamping at 3.0 — a sizeable share of the queries and keys is clipped).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.plugins import install_example_package

from reference_gen.arch_testing import (SAME_LOGITS_ATOL, assert_clears_bar, decode_all, decode_two_sequences,
                                        longest, model_file, records, reference)

import llmfw
from llmfw.core.plugins import registry, reset_plugin_manager

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "examples" / "llmfw-olmo"


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory) -> Path:
    """The example package installed into a fresh directory (what ``pip install`` does, minus the venv)."""
    return install_example_package(PACKAGE.name, tmp_path_factory)


@pytest.fixture()
def with_olmo(site_dir, monkeypatch):
    """llmfw's plugin manager rebuilt with the installed package on the path; rebuilt again afterwards."""
    monkeypatch.syspath_prepend(str(site_dir))
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def test_plugins_lists_olmo_from_its_package(site_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site_dir), str(ROOT)])}
    out = subprocess.run([sys.executable, "-m", "llmfw.cli", "plugins", "--json"], env=env, check=True,
                         capture_output=True, text=True).stdout
    listing = json.loads(out)
    olmo = [e for e in listing["plugins"]["architectures"] if e["name"] == "olmo"]
    assert olmo == [{"name": "olmo", "ref": "llmfw_olmo:OlmoArchitecture", "source": "llmfw-olmo 0.1.0"}]
    assert not listing["failures"]


def test_a_blocked_plugin_leaves_olmo_unknown(site_dir, monkeypatch, tmp_path):
    """Installed but block-listed (LLMFW_DISABLE_PLUGINS), the package registers nothing: llmfw itself does
    not know olmo, and the error lists what it does know."""
    from llmfw.core.errors import UnknownArchitecture

    monkeypatch.syspath_prepend(str(site_dir))
    monkeypatch.setenv("LLMFW_DISABLE_PLUGINS", "olmo")
    reset_plugin_manager()
    try:
        with pytest.raises(UnknownArchitecture, match="'olmo'.*known: .*llama"):
            llmfw.load_model(model_file("olmo", tmp_path), backend="numpy")
    finally:
        reset_plugin_manager()


def test_olmo_matches_llama_cpp(with_olmo, tmp_path, score):
    assert registry("architectures").entry("olmo").source == "llmfw-olmo 0.1.0"
    ref = reference("olmo")
    with llmfw.load_model(model_file("olmo", tmp_path), backend="numpy") as model:
        assert model.hparams.f_clamp_kqv == 3.0
        for record in records(ref):
            assert_clears_bar(score, record, decode_all(model, record["sequence"], n_ctx=512), "olmo")
        record = longest(ref)
        split = decode_all(model, record["sequence"], n_ctx=512, n_ubatch=16)
        assert_clears_bar(score, record, split, "olmo with n_ubatch 16")
        first, second = records(ref)[:2]
        logits_a, logits_b = decode_two_sequences(model, first["sequence"], second["sequence"], n_ctx=512)
        assert_clears_bar(score, first, logits_a, "olmo, sequence 0 of 2")
        assert_clears_bar(score, second, logits_b, "olmo, sequence 1 of 2")
        assert np.abs(decode_all(model, first["sequence"], n_ctx=512) - logits_a).max() <= SAME_LOGITS_ATOL
