"""Property tests for the two places where llmfw computes llama.cpp's result differently from llama.cpp:

* BPE pre-tokenization: llama.cpp runs hand-written splitters for the GPT-2 and Llama-3 regexes
  (``unicode_regex_split_custom_gpt2`` / ``_llama3``); llmfw runs the regexes on category-collapsed text. The
  oracles below are literal ports of llama.cpp's splitters, on the same code point classes.
* SPM: llama.cpp merges over the whole text fragment; llmfw cuts it into words and caches per word. The oracle
  merges the whole fragment at once.
"""
from __future__ import annotations

import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pytest

from llmfw.core.gguf import open_gguf
from llmfw.core.vocab import Vocab
from llmfw.plugins.tokenizers.bpe import _GPT2, _LLAMA3, RegexSplitter

_LETTER, _NUMBER, _SPACE = regex.compile(r"\p{L}"), regex.compile(r"\p{N}"), regex.compile(r"\s")


class _Flags:
    """llama.cpp's unicode_cpt_flags for one position (out of range: all false)."""

    def __init__(self, char: str | None):
        self.defined = char is not None
        self.letter = bool(char and _LETTER.match(char))
        self.number = bool(char and _NUMBER.match(char))
        self.space = bool(char and _SPACE.match(char))


class _Splitter:
    """Shared state of llama.cpp's custom splitters: positions, flags, and `_add_token`."""

    def __init__(self, text: str):
        self.text, self.n, self.prev_end, self.pieces = text, len(text), 0, []

    def cpt(self, pos: int) -> str | None:
        return self.text[pos] if 0 <= pos < self.n else None

    def flags(self, pos: int) -> _Flags:
        return _Flags(self.cpt(pos))

    def add(self, end: int) -> int:
        length = end - self.prev_end
        if length > 0:
            self.pieces.append(self.text[self.prev_end:end])
        self.prev_end = end
        return length

    def contraction(self, pos: int, lower) -> int:
        """Length of a 's 't 're 've 'm 'll 'd at pos (0 if none)."""
        if self.cpt(pos) == "'" and pos + 1 < self.n:
            nxt = lower(self.cpt(pos + 1))
            if nxt in ("s", "t", "m", "d"):
                return 2
            if pos + 2 < self.n and nxt + lower(self.cpt(pos + 2)) in ("re", "ve", "ll"):
                return 3
        return 0

    def whitespace(self, pos: int) -> int:
        """llama.cpp's tail: \\s+(?!\\S) | \\s+ | one character; returns the new position."""
        count = 0
        while self.flags(pos + count).space:
            count += 1
        if count > 1 and self.cpt(pos + count) is not None:
            pos += count - 1
        elif count > 0:
            pos += count
        else:
            pos += 1
        self.add(pos)
        return pos


def llama_cpp_split_gpt2(text: str) -> list[str]:
    s = _Splitter(text)
    pos = 0
    while pos < s.n:
        cpt, flags = s.cpt(pos), s.flags(pos)
        if length := s.contraction(pos, lambda c: c):
            pos += s.add(pos + length)
            continue
        flags2 = s.flags(pos + 1) if cpt == " " else flags
        for test in (lambda f: f.letter, lambda f: f.number,
                     lambda f: not (f.space or f.letter or f.number) and f.defined):
            if test(flags2):
                pos += cpt == " "
                while test(flags2):
                    pos += 1
                    flags2 = s.flags(pos)
                s.add(pos)
                break
        else:
            pos = s.whitespace(pos)
    return s.pieces


def llama_cpp_split_llama3(text: str) -> list[str]:
    s = _Splitter(text)
    pos = 0
    while pos < s.n:
        cpt, flags = s.cpt(pos), s.flags(pos)
        if length := s.contraction(pos, str.lower):
            pos += s.add(pos + length)
            continue
        if not (cpt in "\r\n" or flags.number) and (flags.letter or s.flags(pos + 1).letter):
            pos += 1
            while s.flags(pos).letter:
                pos += 1
            s.add(pos)
            continue
        if flags.number:
            start = pos
            while s.flags(pos).number:
                pos += 1
                if pos - start >= 3:
                    s.add(pos)
                    start = pos
            s.add(pos)
            continue
        flags2 = s.flags(pos + 1) if cpt == " " else flags
        if not (flags2.space or flags2.letter or flags2.number) and flags.defined:
            pos += cpt == " "
            while not (flags2.space or flags2.letter or flags2.number) and flags2.defined:
                pos += 1
                flags2 = s.flags(pos)
            while s.cpt(pos) in ("\r", "\n"):
                pos += 1
            s.add(pos)
            continue
        count, last_newline_end = 0, 0
        while s.flags(pos + count).space:
            if s.cpt(pos + count) in ("\r", "\n"):
                last_newline_end = pos + count + 1
            count += 1
        if last_newline_end:
            pos = last_newline_end
            s.add(pos)
            continue
        pos = s.whitespace(pos)
    return s.pieces


# letters, digits, marks, symbols, punctuation, contractions, all kinds of whitespace, controls, unassigned
_ALPHABET = list("aZs'tTrRevEVlLdDmM 0123456789.,!?-_$+<=>^~|`(){}[]\\/\t\n\r\x0b\x0c") + [
    "é", "ж", "Ж", "日", "ﬀ", "٣", "²", "Ⅻ", "\u0301", "\u0903", "€", "©", "😀", "🏽", "¡", "«", "\u00a0", "\u3000",
    "\u2028", "\u0085", "\u1680", "\x00", "\x1f", "\u200b", "\ue000", "\u0378", "\ufffd", "'s", "'LL", " 's", "  ",
]
_texts = st.lists(st.sampled_from(_ALPHABET), max_size=40).map("".join)


@settings(max_examples=400, deadline=None)
@given(_texts)
def test_gpt2_regex_split_equals_llama_cpp_custom_splitter(text):
    assert RegexSplitter((_GPT2,)).split(text) == llama_cpp_split_gpt2(text)


@settings(max_examples=400, deadline=None)
@given(_texts)
def test_llama3_regex_split_equals_llama_cpp_custom_splitter(text):
    assert RegexSplitter((_LLAMA3,)).split(text) == llama_cpp_split_llama3(text)


def test_oracles_themselves():
    assert llama_cpp_split_gpt2("Hello  world's 1234") == ["Hello", " ", " world", "'s", " 1234"]
    assert llama_cpp_split_llama3("a \n\n b 12345 I'M") == ["a", " \n\n", " b", " ", "123", "45", " I", "'M"]


@pytest.fixture(scope="module")
def gemma_spm(gemma3_path):
    with open_gguf(gemma3_path) as gguf:
        return Vocab.from_metadata(gguf.metadata).tokenizer


_SPM_ALPHABET = ["a", "b", "th", "e", " ", "  ", ">", "</", "▁", "ж", "ні", "😀", ".", "\u0301", "x", "<h1>", "ing"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(_SPM_ALPHABET), max_size=30).map("".join))
def test_spm_word_cache_equals_whole_fragment_merge(gemma_spm, text):
    whole = gemma_spm.encode_word(text.replace(" ", "▁"))  # llama.cpp: one merge run over the fragment
    gemma_spm.clear_cache()
    assert gemma_spm.tokenize(text) == whole
    assert gemma_spm.tokenize(text) == whole  # and from the cache


def test_spm_token_spanning_a_cut_stays_whole(gemma_spm):
    """Gemma-3 has the piece ">▁</": the text must not be cut between ">" and "▁" where it occurs."""
    text = "<b>bold> </b>"
    assert gemma_spm.tokenize(text) == gemma_spm.encode_word(text.replace(" ", "▁"))
    assert gemma_spm.vocab.token_to_id[">▁</"] in gemma_spm.tokenize(text)
