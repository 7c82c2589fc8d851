"""Tests of the llmfw-toyconv package (run them after ``pip install ./examples/llmfw-toyconv``): the entry point
registers the architecture, and a tiny random-weight file decodes like a plain-numpy implementation of it, also one
token at a time (the state carried between decodes)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import llmfw
from llmfw.core.plugins import registry, reset_plugin_manager

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tests' own helper module
from toyconv_model import oracle_logits, write_toyconv

TOKENS = [1, 5, 20, 3, 9, 9, 14, 30, 7, 22, 11]


def test_entry_point_registers_toyconv():
    reset_plugin_manager()
    entry = registry("architectures").entry("toyconv")
    assert entry.source.startswith("llmfw-toyconv ")
    assert registry("architectures").get("toyconv").memory == "recurrent"


def test_logits_match_the_numpy_oracle(tmp_path):
    with llmfw.load_model(write_toyconv(tmp_path / "toyconv.gguf"), backend="numpy") as model:
        whole = model.new_context(n_ctx=256)
        assert whole.decode(llmfw.Batch(TOKENS, logits=True)) == 0, whole.last_error
        np.testing.assert_allclose(whole.get_logits(), oracle_logits(TOKENS), atol=2e-3)
        stepped = model.new_context(n_ctx=256)
        for token in TOKENS:
            assert stepped.decode(llmfw.Batch([token])) == 0
        np.testing.assert_allclose(stepped.get_logits_ith(-1), oracle_logits(TOKENS)[-1], atol=2e-3)
