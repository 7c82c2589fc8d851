"""The pre-tokenizers issue 17 added, against llama.cpp (tests/data/bpe_pretokenizers_more.json, made by
tests/reference_gen/bpe_pretokenizers_more.py): SmolLM2's tokenizer keys with only ``tokenizer.ggml.pre``
replaced, written with llmfw's GGUF writer, tokenized with add_special and parse_special off."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from llmfw.core.gguf import open_gguf
from llmfw.core.vocab import Vocab

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "bpe_pretokenizers_more.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def smollm2_tokenizer_keys(smollm2_path):
    with open_gguf(smollm2_path) as source:
        return {k: v for k, v in source.metadata.items() if k.startswith("tokenizer.ggml.")}


@pytest.mark.parametrize("pre", sorted(REFERENCE["by_pre"]))
def test_pre_tokenizer_matches_llama_cpp(pre, smollm2_tokenizer_keys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known pre value: no fallback warning
        vocab = Vocab.from_metadata(dict(smollm2_tokenizer_keys, **{"tokenizer.ggml.pre": pre}))
    texts, expected = REFERENCE["texts"], REFERENCE["by_pre"][pre]
    wrong = [(t, vocab.tokenize(t, add_special=False), e) for t, e in zip(texts, expected)
             if vocab.tokenize(t, add_special=False, parse_special=False) != e]
    assert len(texts) == len(expected) >= 50
    assert not wrong, wrong[:2]
