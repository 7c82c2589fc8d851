"""WordPiece (``tokenizer.ggml.model = "bert"``), exactly as llama.cpp's ``llm_tokenizer_wpm``.

llama.cpp's BERT converter stores word-initial pieces with a leading U+2581 (``"▁hello"``) and continuation
pieces bare (``"##llo"`` becomes ``"llo"``). Tokenizing one text fragment:

1. **Basic tokenization** (BERT's ``BasicTokenizer``, as llama.cpp does it): code points are mapped to their NFD
   *first* code point when accents are stripped, whitespace ends a word, NUL / U+FFFD / control characters vanish,
   accent marks vanish when stripping, letters are lowercased when ``lowercase``, and every punctuation mark, ASCII
   symbol and CJK ideograph is a word of its own.
2. **WordPiece**: each word gets the U+2581 prefix and is cut greedily into the longest vocabulary pieces, left to
   right; a word with a position no piece covers becomes the unknown token.

With ``add_special`` llama.cpp wraps the ids in BOS (``[CLS]``) and SEP (``[SEP]``), whatever the add_* flags say.
The vocab reads the normalizer keys ``tokenizer.ggml.normalizer.lowercase`` / ``.strip_accents`` (true by default,
BERT uncased; strip_accents follows lowercase when absent).
"""
from __future__ import annotations

import unicodedata
from llmfw.sdk import Tokenizer, TokenizerDefaults, TokenizerError, Vocab

WORD_PREFIX = "\u2581"  # the phantom space llama.cpp puts before every word

# llama.cpp's table_whitespace (Unicode White_Space), not Python's str.isspace
_WHITESPACE = frozenset(map(chr, [*range(0x09, 0x0E), *range(0x2000, 0x200B), 0x20, 0x85, 0xA0, 0x1680, 0x2028,
                                  0x2029, 0x202F, 0x205F, 0x3000]))
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B920, 0x2CEAF),  # 0x2B820 in Unicode, 0x2B920 in Hugging Face's code (llama.cpp follows it)
               (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_cjk(code: int) -> bool:
    return any(low <= code <= high for low, high in _CJK_RANGES)


class WPMTokenizer(Tokenizer):
    """llama.cpp's WPM tokenizer; see the module docstring."""

    wraps_with_bos_and_sep = True

    @classmethod
    def defaults(cls, pre: str) -> TokenizerDefaults:
        return TokenizerDefaults(bos_id=101, unk_id=100, sep_id=102, pad_id=0, mask_id=103, add_bos=True,
                                 add_sep=True, clean_spaces=True)

    def __init__(self, vocab: Vocab):
        super().__init__(vocab)
        self.lowercase = vocab.normalizer_lowercase
        self.strip_accents = vocab.normalizer_strip_accents
        self.token_to_id = vocab.token_to_id
        self.max_piece_chars = max((len(t) for t in vocab.tokens), default=1)
        self._char_cache: dict[str, tuple[str, bool]] = {}

    # ------------------------------------------------------------------------------------- basic tokenizer
    def _classify(self, char: str) -> tuple[str, bool]:
        """(what the character becomes — "" when dropped, " " when it ends a word —, stands alone as a word)."""
        cached = self._char_cache.get(char)
        if cached is not None:
            return cached
        result = self._classify_uncached(char)
        if len(self._char_cache) < self.word_cache_limit:
            self._char_cache[char] = result
        return result

    def _classify_uncached(self, char: str) -> tuple[str, bool]:
        if self.strip_accents:
            char = unicodedata.normalize("NFD", char)[:1] or char
        if char in _WHITESPACE:
            return " ", False
        category = unicodedata.category(char)
        if char in ("\0", "\ufffd") or category in ("Cc", "Cf", "Co", "Cs"):
            return "", False
        if self.strip_accents and category[0] == "M":
            return "", False
        alone = category[0] == "P" or (ord(char) < 0x7F and category[0] == "S") or _is_cjk(ord(char))
        if self.lowercase:
            char = char.lower()[:1] or char  # Unicode's simple lowercase mapping: one code point
        return char, alone

    def words(self, text: str) -> list[str]:
        """The words of the basic tokenizer, in order."""
        words: list[str] = []
        current: list[str] = []
        for char in text:
            mapped, alone = self._classify(char)
            if mapped == " " or alone:
                if current:
                    words.append("".join(current))
                    current = []
                if alone:
                    words.append(mapped)
            elif mapped:
                current.append(mapped)
        if current:
            words.append("".join(current))
        return words

    # ------------------------------------------------------------------------------------- wordpiece
    def tokenize(self, text: str) -> list[int]:
        return self.encode_words(self.words(text))

    def encode_word(self, word: str) -> list[int]:
        piece_text = WORD_PREFIX + word
        ids: list[int] = []
        i, n = 0, len(piece_text)
        while i < n:
            for j in range(min(n, i + self.max_piece_chars), i, -1):
                token = self.token_to_id.get(piece_text[i:j])
                if token is not None:
                    ids.append(token)
                    i = j
                    break
            else:  # no piece starts here: the whole word is unknown
                return [self._unknown()]
        return ids

    def _unknown(self) -> int:
        if self.vocab.unk_id is None:
            raise TokenizerError("a word has no WordPiece cover and the vocab has no unknown token")
        return self.vocab.unk_id

    def normal_piece(self, text: str) -> bytes:
        return text.replace(WORD_PREFIX, " ").encode("utf-8", "surrogatepass")

    def byte_to_token(self, byte: int) -> int:
        from .bpe import BYTE_TO_CHAR  # llama.cpp maps WPM bytes through the GPT-2 alphabet, as for BPE

        token = self.token_to_id.get(BYTE_TO_CHAR[byte])
        if token is None:
            raise TokenizerError(f"the WPM vocab has no token for byte 0x{byte:02X}")
        return token

    def newline_id(self) -> int | None:
        return self.vocab.pad_id  # llama.cpp's linefeed_id for WPM
