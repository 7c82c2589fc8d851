"""Every BPE pre-tokenizer type against llama.cpp (tests/data/reference/bpe-pretokenizers.json).

For each `tokenizer.ggml.pre` value the test writes the vocab-only GGUF the reference describes — SmolLM2's
tokenizer keys with only `tokenizer.ggml.pre` replaced, `general.architecture = llama`, no tensors — with the
project's GGUF writer, reads it back with the project's reader and tokenizes every reference string.
"""
from __future__ import annotations

import warnings

import pytest

from llmfw.core.gguf import GGUFWriter, open_gguf
from llmfw.core.vocab import Vocab
from llmfw.plugins.tokenizers.bpe import PRE_TYPES, translate_regex

PRE_VALUES = ["default", "llama-bpe", "qwen2", "gpt-2", "smollm", "starcoder", "deepseek-llm", "deepseek-coder",
              "falcon", "tekken"]


@pytest.fixture(scope="module")
def vocab_only_writer(smollm2_path, tmp_path_factory):
    """write(pre) -> path of a vocab-only GGUF with SmolLM2's tokenizer and that pre value."""
    with open_gguf(smollm2_path) as source:
        tokenizer_keys = [(key, value, source.metadata_types[key], source.metadata_array_types.get(key))
                          for key, value in source.metadata.items()
                          if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.pre"]
    folder = tmp_path_factory.mktemp("vocab_only")

    def write(pre: str):
        path = folder / f"{pre}.gguf"
        writer = GGUFWriter(path)
        writer.add("general.architecture", "llama")
        for key, value, vtype, array_type in tokenizer_keys:
            writer.add(key, value, vtype, array_type=array_type)
        writer.add("tokenizer.ggml.pre", pre)
        writer.write()
        return path

    return write


def test_reference_covers_every_pre_value(bpe_pre_ref):
    assert sorted(bpe_pre_ref["by_pre"]) == sorted(PRE_VALUES)


@pytest.mark.parametrize("pre", PRE_VALUES)
def test_pre_tokenizer_matches_llama_cpp(pre, bpe_pre_ref, vocab_only_writer):
    path = vocab_only_writer(pre)
    with open_gguf(path) as gguf:
        assert not gguf.tensors
        vocab = Vocab.from_metadata(gguf.metadata)
    assert vocab.pre == pre
    cases = bpe_pre_ref["by_pre"][pre]
    assert len(cases) == 50
    mismatches = [(c["text"], vocab.tokenize(c["text"], add_special=False), c["ids"]) for c in cases
                  if vocab.tokenize(c["text"], add_special=False, parse_special=False) != c["ids"]]
    assert not mismatches, mismatches[:3]


def test_pre_types_set_llama_cpp_flags(smollm2_path):
    with open_gguf(smollm2_path) as gguf:
        metadata = dict(gguf.metadata)
    del metadata["tokenizer.ggml.add_bos_token"]  # let the pre type decide, as llama.cpp does without the key
    flags = {}
    for pre in ("llama-bpe", "tekken", "gpt-2", "qwen2"):
        vocab = Vocab.from_metadata(dict(metadata, **{"tokenizer.ggml.pre": pre}))
        flags[pre] = (vocab.add_bos, vocab.clean_spaces, vocab.tokenizer.pre.ignore_merges)
    assert flags == {"llama-bpe": (True, True, True), "tekken": (True, False, True),
                     "gpt-2": (False, True, False), "qwen2": (False, False, False)}


@pytest.mark.parametrize("pre", ["no-such-pre", ""])
def test_unknown_pre_falls_back_to_default_with_a_warning(pre, smollm2_path, bpe_pre_ref):
    with open_gguf(smollm2_path) as gguf:
        metadata = dict(gguf.metadata, **{"tokenizer.ggml.pre": pre})
    with pytest.warns(RuntimeWarning, match="using 'default'"):
        vocab = Vocab.from_metadata(metadata)
    for case in bpe_pre_ref["by_pre"]["default"][:20]:
        assert vocab.tokenize(case["text"], add_special=False) == case["ids"]


def test_every_known_pre_type_compiles():
    from llmfw.plugins.tokenizers.bpe import _TYPES, RegexSplitter

    assert set(PRE_TYPES.values()) == set(_TYPES)
    for pre_type in _TYPES.values():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            RegexSplitter(pre_type.regexes).split("It's 2024: naïve café, 日本語\n\n  x")


def test_regex_translation_follows_llama_cpp_collapsing():
    pattern, collapsed = translate_regex(r"[^\r\n\p{L}\p{N}]?\p{L}+|\s+(?!\S)|$")
    assert collapsed
    assert pattern == (r"[^\r\n\xd2A-Za-z\xd10-9]?[\xd2A-Za-z]+|[\t\n\x0b\x0c\r ]+(?![^\t\n\x0b\x0c\r ])|\Z")
    assert translate_regex("[0-9][0-9][0-9]") == ("[0-9][0-9][0-9]", False)
