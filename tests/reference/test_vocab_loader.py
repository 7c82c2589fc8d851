"""VocabLoader parses and checks the tokenizer.ggml.* keys; Vocab holds the result and only tokenizes with it."""
from __future__ import annotations

import dataclasses

import pytest

from llmfw.core.errors import VocabError
from llmfw.core.gguf import open_gguf
from llmfw.core.vocab import SPECIAL_ID_NAMES, Vocab
from llmfw.core.vocab_loader import VocabLoader


@pytest.fixture(scope="module")
def gemma3_metadata(gemma3_path):
    with open_gguf(gemma3_path) as gguf:
        return dict(gguf.metadata)


def test_the_loader_reads_what_the_vocab_is_made_of(gemma3_metadata) -> None:
    contents = VocabLoader(gemma3_metadata).contents()
    assert contents.model == "llama" and len(contents.tokens) == 262144
    assert contents.flags.add_bos and not contents.flags.add_eos
    assert set(contents.special_ids) == set(SPECIAL_ID_NAMES)
    assert contents.special_ids["bos_id"] == 2 and contents.special_ids["eot_id"] == contents.token_to_id["<end_of_turn>"]
    assert contents.token_to_id["<end_of_turn>"] in contents.eog_ids
    vocab = Vocab(contents)
    assert vocab.bos_id == 2 and vocab.eog_ids == contents.eog_ids
    assert vocab.tokenize("Hello world") == Vocab.from_metadata(gemma3_metadata).tokenize("Hello world")


def test_the_vocab_tokenizes_with_the_contents_it_is_given(gemma3_metadata) -> None:
    contents = VocabLoader(gemma3_metadata).contents()
    with_bos = Vocab(contents).tokenize("Hello")
    without = Vocab(dataclasses.replace(contents, flags=dataclasses.replace(contents.flags, add_bos=False)))
    assert with_bos == [2, *without.tokenize("Hello")]


def test_the_loader_names_a_bad_key(gemma3_metadata) -> None:
    bad = dict(gemma3_metadata, **{"tokenizer.ggml.add_bos_token": "yes"})
    with pytest.raises(VocabError, match="tokenizer.ggml.add_bos_token: expected a bool, found str 'yes'"):
        VocabLoader(bad).contents()
