"""Tests of the llmfw-olmo package (run them after ``pip install ./examples/llmfw-olmo``).

The model check needs llmfw's checkout (the random-weight OLMo builder and llama.cpp's numbers in
``tests/``); outside a checkout it is skipped.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import llmfw
from llmfw.core.plugins import registry, reset_plugin_manager

CHECKOUT_TESTS = Path(__file__).resolve().parents[3] / "tests"


def test_entry_point_registers_olmo():
    reset_plugin_manager()
    entry = registry("architectures").entry("olmo")
    assert entry.source.startswith("llmfw-olmo ")
    arch = registry("architectures").get("olmo")
    assert arch.__name__ == "OlmoArchitecture" and arch.rope_type == "norm"


def _checkout_helpers():
    if not (CHECKOUT_TESTS / "reference_gen" / "arch_testing.py").is_file():
        pytest.skip("needs llmfw's checkout (tests/reference_gen)")
    sys.path.insert(0, str(CHECKOUT_TESTS))
    from conftest import REFERENCE_DIR  # the checkout's tests/data/reference
    from reference_gen import arch_testing

    spec = importlib.util.spec_from_file_location("olmo_compare", REFERENCE_DIR / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    return arch_testing, compare.score


def test_matches_llama_cpp_on_the_random_olmo(tmp_path):
    helpers, score = _checkout_helpers()
    reset_plugin_manager()
    with llmfw.load_model(helpers.model_file("olmo", tmp_path), backend="numpy") as model:
        for record in helpers.records(helpers.reference("olmo")):
            logits = helpers.decode_all(model, record["sequence"], n_ctx=record["n_ctx"])
            helpers.assert_clears_bar(score, record, logits, "olmo")
