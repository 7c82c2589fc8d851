"""Vocab + tokenizers against llama.cpp's reference outputs (tests/data/reference), on the two real models."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from llmfw.core.errors import TokenizerError, VocabError
from llmfw.core.gguf import open_gguf
from llmfw.core.plugins import registry
from llmfw.core.vocab import StreamingDetokenizer, TokenAttr, Vocab
from llmfw.plugins.tokenizers.merge import merge_large, merge_small

FLAG_COMBINATIONS = [(True, True), (True, False), (False, True), (False, False)]


def _flag_key(add_special: bool, parse_special: bool) -> str:
    return f"add_special={add_special},parse_special={parse_special}"


@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_path):
    with open_gguf(smollm2_path) as gguf:
        return gguf.metadata


@pytest.fixture(scope="module")
def gemma3_metadata(gemma3_path):
    with open_gguf(gemma3_path) as gguf:
        return gguf.metadata


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2_metadata) -> Vocab:
    return Vocab.from_metadata(smollm2_metadata)


@pytest.fixture(scope="module")
def gemma3_vocab(gemma3_metadata) -> Vocab:
    return Vocab.from_metadata(gemma3_metadata)


@pytest.fixture(params=["smollm2", "gemma3"])
def model_case(request, smollm2_vocab, gemma3_vocab, smollm2_ref, gemma3_ref):
    """(vocab, reference file) for each real model."""
    if request.param == "smollm2":
        return smollm2_vocab, smollm2_ref
    return gemma3_vocab, gemma3_ref


# ---------------------------------------------------------------------------------------------- exactness
def test_reference_tokenize_cases_all_flag_combinations(model_case):
    vocab, ref = model_case
    assert vocab.n_vocab == ref["n_vocab"]
    mismatches = []
    for case in ref["tokenize"]:
        for add_special, parse_special in FLAG_COMBINATIONS:
            expected = case[_flag_key(add_special, parse_special)]
            got = vocab.tokenize(case["text"], add_special=add_special, parse_special=parse_special)
            if got != expected:
                mismatches.append((case["text"], add_special, parse_special, got, expected))
    assert not mismatches, mismatches[:3]
    assert len(ref["tokenize"]) == 30


def test_reference_prompt_ids(model_case):
    vocab, ref = model_case
    for record in ref["prompts"]:
        assert vocab.tokenize(record["prompt"], add_special=True, parse_special=True) == record["prompt_ids"]


def test_detokenize_matches_llama_cpp_continuations(model_case):
    """`continuation_text` is llama.cpp's rendering of the generated tokens."""
    vocab, ref = model_case
    for record in ref["prompts"]:
        continuation = record["sequence"][len(record["prompt_ids"]):]
        assert vocab.detokenize(continuation) == record["continuation_text"]


def test_round_trip(model_case):
    """Both vocabularies round-trip every reference text (neither cleans spaces, both can encode any byte)."""
    vocab, ref = model_case
    for case in ref["tokenize"]:
        text = case["text"]
        for add_special, parse_special in FLAG_COMBINATIONS:
            ids = vocab.tokenize(text, add_special, parse_special)
            assert vocab.detokenize(ids, remove_special=True, unparse_special=parse_special) == text


# ---------------------------------------------------------------------------------------------- loading
def test_special_ids_and_flags(smollm2_vocab, gemma3_vocab):
    smol = smollm2_vocab
    assert (smol.model, smol.pre, smol.bos_id, smol.eos_id, smol.unk_id, smol.pad_id) == ("gpt2", "smollm", 1, 2, 0, 2)
    assert (smol.add_bos, smol.add_eos, smol.add_space_prefix) == (False, False, False)
    assert smol.tokens[smol.eot_id] == "<|im_end|>"
    assert smol.nl_id == smol.token_to_id["Ċ"]
    assert {smol.tokens[t] for t in smol.eog_ids} == {"<|endoftext|>", "<|im_end|>", "<reponame>"}
    gemma = gemma3_vocab
    assert (gemma.model, gemma.bos_id, gemma.eos_id, gemma.unk_id, gemma.pad_id) == ("llama", 2, 1, 3, 0)
    assert (gemma.add_bos, gemma.add_eos, gemma.add_space_prefix) == (True, False, False)
    assert gemma.tokens[gemma.eot_id] == "<end_of_turn>"
    assert gemma.tokens[gemma.nl_id] == "<0x0A>"
    assert gemma.is_eog(gemma.eos_id) and gemma.is_eog(gemma.eot_id) and not gemma.is_eog(gemma.bos_id)
    # llama.cpp marks control tokens named "unused" as unused, and "</s>" (an EOG text) as control
    assert gemma.is_unused(gemma.token_to_id["<unused0>"])
    assert gemma.is_control(gemma.token_to_id["</s>"])
    assert gemma.is_user_defined(gemma.token_to_id["  "])
    assert isinstance(gemma.scores, np.ndarray) and gemma.scores.dtype == np.float32


def test_tokenizer_plugins_come_from_the_registry(smollm2_vocab, gemma3_vocab):
    assert type(smollm2_vocab.tokenizer) is registry("tokenizers").get("gpt2")
    assert type(gemma3_vocab.tokenizer) is registry("tokenizers").get("llama")


def test_from_file_reads_only_the_vocab(smollm2_path, smollm2_vocab):
    vocab = Vocab.from_file(smollm2_path)
    assert vocab.tokens == smollm2_vocab.tokens
    assert vocab.tokenize("Hello world") == smollm2_vocab.tokenize("Hello world")


def test_unknown_tokenizer_model_lists_known_ones(smollm2_metadata):
    metadata = dict(smollm2_metadata, **{"tokenizer.ggml.model": "nonesuch"})
    with pytest.raises(VocabError, match=r"unknown tokenizer.ggml.model 'nonesuch'.*gpt2.*llama"):
        Vocab.from_metadata(metadata)


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model is missing"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is missing"),
    ({"tokenizer.ggml.tokens": "abc"}, "expected an array of strings, found str"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a"]}, "duplicate token in vocabulary: 'a' has ids 0 and 2"),
    ({"tokenizer.ggml.token_type": np.ones(5, dtype=np.int32)}, "expected at least 49152 values"),
    ({"tokenizer.ggml.add_bos_token": 1}, "expected a bool, found int"),
    ({"tokenizer.ggml.merges": None}, "merges is missing"),
    ({"tokenizer.ggml.bos_token_id": "1"}, "expected an integer token id"),
])
def test_malformed_vocab_metadata_raises_vocab_error(smollm2_metadata, change, message):
    metadata = dict(smollm2_metadata)
    for key, value in change.items():
        if value is None:
            del metadata[key]
        else:
            metadata[key] = value
    with pytest.raises(VocabError, match=message):
        Vocab.from_metadata(metadata)


def test_out_of_range_special_id_in_file_is_ignored(smollm2_metadata, caplog):
    metadata = dict(smollm2_metadata, **{"tokenizer.ggml.eos_token_id": 10**9})
    with caplog.at_level(logging.WARNING, logger="llmfw.core.vocab"):
        vocab = Vocab.from_metadata(metadata)
    assert vocab.eos_id == 11  # llama.cpp's BPE default stays
    assert "bad special token" in caplog.text


def test_add_bos_without_bos_id_is_an_error(gemma3_metadata):
    metadata = dict(gemma3_metadata, **{"tokenizer.ggml.bos_token_id": 10**9})
    metadata["tokenizer.ggml.tokens"] = metadata["tokenizer.ggml.tokens"][:1]  # the default id 1 is gone too
    metadata["tokenizer.ggml.scores"] = metadata["tokenizer.ggml.scores"][:1]
    metadata["tokenizer.ggml.token_type"] = metadata["tokenizer.ggml.token_type"][:1]
    with pytest.raises(VocabError, match="add_bos is true, but the vocab has no bos_id"):
        Vocab.from_metadata(metadata)


# ---------------------------------------------------------------------------------------------- tokenize rules
def test_user_defined_tokens_split_even_without_parse_special(gemma3_vocab):
    vocab = gemma3_vocab
    ids = vocab.tokenize("a  b\t\tc<h1>", add_special=False, parse_special=False)
    assert [vocab.tokens[t] for t in ids] == ["a", "  ", "b", "\t\t", "c", "<h1>"]
    # control tokens only with parse_special
    assert vocab.token_to_id["<start_of_turn>"] not in vocab.tokenize("<start_of_turn>", False, False)
    assert vocab.tokenize("<start_of_turn>", False, True) == [vocab.token_to_id["<start_of_turn>"]]


def test_longest_special_token_wins(gemma3_vocab):
    vocab = gemma3_vocab
    ids = vocab.tokenize("x\n\n\ny", add_special=False)
    assert [vocab.tokens[t] for t in ids] == ["x", "\n\n\n", "y"]


def test_double_bos_is_kept_with_a_warning(gemma3_vocab, caplog):
    with caplog.at_level(logging.WARNING, logger="llmfw.core.vocab"):
        ids = gemma3_vocab.tokenize("<bos>hi", add_special=True, parse_special=True)
    assert ids[:2] == [gemma3_vocab.bos_id, gemma3_vocab.bos_id]
    assert "2 BOS tokens" in caplog.text


def test_spm_space_prefix_after_special_tokens(gemma3_metadata):
    """add_space_prefix: a leading space before the first text fragment and after each special token."""
    vocab = Vocab.from_metadata(dict(gemma3_metadata, **{"tokenizer.ggml.add_space_prefix": True}))
    bos, turn = vocab.bos_id, vocab.token_to_id["<start_of_turn>"]
    ids = vocab.tokenize("Hello<start_of_turn>world", add_special=True, parse_special=True)
    assert ids == [bos, vocab.token_to_id["▁Hello"], turn, vocab.token_to_id["▁world"]]
    # ... and detokenize removes the one it added in front of the first token only
    assert vocab.detokenize(ids[1:]) == "Hello world"
    assert vocab.detokenize(ids, remove_special=True, unparse_special=True) == " Hello<start_of_turn> world"


def test_spm_byte_fallback(gemma3_vocab):
    vocab = gemma3_vocab
    text = "\U000f0000"  # a private-use character: no piece for it, so its four UTF-8 bytes
    ids = vocab.tokenize(text, add_special=False)
    assert [vocab.tokens[t] for t in ids] == ["<0xF3>", "<0xB0>", "<0x80>", "<0x80>"]
    assert all(vocab.is_byte(t) for t in ids)
    assert vocab.detokenize(ids) == text


def test_bpe_long_piece_uses_the_same_merges(smollm2_vocab):
    """Pieces longer than the small-word path go through the priority queue: same result as repeated words."""
    vocab = smollm2_vocab
    long_word = "a" * 300
    short_ids = vocab.tokenize("a" * 20, add_special=False)
    long_ids = vocab.tokenize(long_word, add_special=False)
    assert vocab.detokenize(long_ids) == long_word
    costs = vocab.tokenizer.pair_costs
    assert merge_large(long_word, costs) == merge_small(long_word, costs)
    assert merge_large("a" * 20, costs) == merge_small("a" * 20, costs)
    assert vocab.detokenize(short_ids) == "a" * 20


def test_spm_long_word_uses_the_same_merges(gemma3_vocab):
    tokenizer = gemma3_vocab.tokenizer
    word = "▁" + "abracadabra" * 30
    assert merge_large(word, tokenizer.pair_costs) == merge_small(word, tokenizer.pair_costs)


def test_tokenize_rejects_non_text(smollm2_vocab):
    with pytest.raises(TokenizerError, match="expects a str"):
        smollm2_vocab.tokenize(b"bytes")


def test_empty_text(smollm2_vocab, gemma3_vocab):
    assert smollm2_vocab.tokenize("") == []
    assert gemma3_vocab.tokenize("") == [gemma3_vocab.bos_id]
    assert gemma3_vocab.tokenize("", add_special=False) == []


# ---------------------------------------------------------------------------------------------- pieces
def test_token_to_piece_rules(smollm2_vocab, gemma3_vocab):
    smol, gemma = smollm2_vocab, gemma3_vocab
    im_start = smol.token_to_id["<|im_start|>"]
    assert smol.token_to_piece(im_start) == b""  # control: hidden unless special
    assert smol.token_to_piece(im_start, special=True) == b"<|im_start|>"
    assert smol.token_to_piece(smol.token_to_id["Ġworld"]) == b" world"  # GPT-2 byte alphabet decoded
    assert gemma.token_to_piece(gemma.token_to_id["▁world"]) == b" world"  # SPM: ▁ -> space
    assert gemma.token_to_piece(gemma.token_to_id["<0x0A>"]) == b"\n"  # byte token
    assert gemma.token_to_piece(gemma.token_to_id["<h1>"]) == b"<h1>"  # user-defined: shown always
    assert gemma.token_to_piece(gemma.token_to_id["<unused0>"], special=True) == b"<unused0>"


@pytest.mark.parametrize("bad", [-1, 49152, 10**12, 1.5, "3", True])
def test_out_of_range_ids_raise_tokenizer_error(smollm2_vocab, bad):
    with pytest.raises(TokenizerError):
        smollm2_vocab.token_to_piece(bad)
    with pytest.raises(TokenizerError):
        smollm2_vocab.detokenize([1, bad])


def test_detokenize_remove_and_unparse_special(gemma3_vocab):
    vocab = gemma3_vocab
    ids = vocab.tokenize("<start_of_turn>user\nhi", add_special=True, parse_special=True)
    assert ids[0] == vocab.bos_id
    assert vocab.detokenize(ids) == "user\nhi"
    assert vocab.detokenize(ids, unparse_special=True) == "<bos><start_of_turn>user\nhi"
    assert vocab.detokenize(ids, remove_special=True, unparse_special=True) == "<start_of_turn>user\nhi"
    # numpy ids work too
    assert vocab.detokenize(np.array(ids)) == "user\nhi"


def test_bpe_clean_spaces_like_llama_cpp(smollm2_metadata):
    """The 'gpt-2' pre-tokenizer type sets clean_spaces: detokenize drops spaces before ?!., and 's 'm 're 've."""
    vocab = Vocab.from_metadata(dict(smollm2_metadata, **{"tokenizer.ggml.pre": "gpt-2"}))
    assert vocab.clean_spaces
    text = "Hello , world ! It 's ok . I 'm sure ? Yes ' no ' we 'll see"
    assert vocab.detokenize(vocab.tokenize(text)) == "Hello, world! It's ok. I'm sure? Yes'no'we 'll see"
    # llama.cpp overwrites the space it drops after " ' " with NUL, so a second apostrophe right after keeps its space
    assert vocab.detokenize(vocab.tokenize("a ' ' b")) == "a'' b"


# ---------------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("text", ["😀🦙👍🏽", "日本語のテキスト", "Привіт, як справи?", "emoji🙂text🙂"])
def test_streaming_detokenizer_holds_back_split_utf8(smollm2_vocab, gemma3_vocab, text):
    for vocab in (smollm2_vocab, gemma3_vocab):
        stream = StreamingDetokenizer(vocab)
        outputs = [stream.feed(t) for t in vocab.tokenize(text, add_special=False)]
        assert "".join(outputs) + stream.flush() == text
        assert all("\ufffd" not in piece for piece in outputs)


def test_streaming_detokenizer_pending_bytes(smollm2_vocab):
    vocab = smollm2_vocab
    ids = vocab.tokenize("😀", add_special=False)  # 4 UTF-8 bytes over 3 byte-level tokens
    assert len(ids) > 1
    stream = StreamingDetokenizer(vocab)
    assert stream.feed(ids[0]) == ""
    assert stream.pending == vocab.token_to_piece(ids[0])
    assert "".join(stream.feed(t) for t in ids[1:]) == "😀"
    assert stream.pending == b""
    stream.feed(ids[0])
    assert stream.flush() == "\ufffd"  # an incomplete character at the end becomes U+FFFD


def test_token_attrs_are_flags(gemma3_vocab):
    attr = gemma3_vocab.token_attrs[gemma3_vocab.token_to_id["<unused0>"]]
    assert attr & TokenAttr.CONTROL and attr & TokenAttr.UNUSED


def test_lstrip_rstrip_attributes_eat_whitespace_next_to_the_token(smollm2_metadata):
    """llama.cpp sets these per model family (phi-3, jina ...); the partition then drops the adjacent spaces."""
    vocab = Vocab.from_metadata(smollm2_metadata)
    im_end = vocab.token_to_id["<|im_end|>"]
    plain = vocab.tokenize("a \t<|im_end|> \n b", add_special=False, parse_special=True)
    vocab.token_attrs[im_end] |= TokenAttr.LSTRIP | TokenAttr.RSTRIP
    stripped = vocab.tokenize("a \t<|im_end|> \n b", add_special=False, parse_special=True)
    assert stripped == [vocab.token_to_id["a"], im_end, vocab.token_to_id["b"]]
    assert len(plain) > len(stripped)
    assert vocab.tokenize("<|im_end|>  <|im_end|>", add_special=False, parse_special=True) == [im_end, im_end]


def test_load_model_vocab_only_gives_this_vocab(smollm2_path, smollm2_ref):
    import llmfw

    model = llmfw.load_model(smollm2_path, vocab_only=True)
    assert isinstance(model.vocab, Vocab)
    record = smollm2_ref["prompts"][2]
    assert model.vocab.tokenize(record["prompt"], add_special=True, parse_special=True) == record["prompt_ids"]


def test_all_pieces_equals_token_to_piece(gemma3_vocab):
    vocab = gemma3_vocab
    for special in (True, False):
        pieces = vocab.all_pieces(special)
        assert len(pieces) == vocab.n_vocab
        for token in (0, 2, 106, 107, 138, 248, 1000, 9259, vocab.n_vocab - 1):
            assert pieces[token] == vocab.token_to_piece(token, special)


def test_bpe_merge_ranks_cut_where_llama_cpp_cuts_and_keep_the_first_rank():
    """Plain merges split at their one space; a merge starting with a space is cut at the first space after its
    first character, one without a space becomes ("", ""), and a repeated pair keeps its first rank."""
    from llmfw.plugins.tokenizers.bpe import BPETokenizer

    assert BPETokenizer._build_ranks(["a b", "c d", "a b", "e  f"]) == {("a", "b"): 0, ("c", "d"): 1, ("e", " f"): 3}
    assert BPETokenizer._build_ranks(["a b", " c d", "e", "a b"]) == {("a", "b"): 0, (" c", "d"): 1, ("", ""): 2}
