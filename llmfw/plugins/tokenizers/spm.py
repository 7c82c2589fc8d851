"""SentencePiece-style BPE (``tokenizer.ggml.model = "llama"``), exactly as llama.cpp's ``llm_tokenizer_spm``.

llama.cpp replaces spaces by ``▁`` (U+2581), splits the fragment into UTF-8 characters and repeatedly merges the
adjacent pair whose concatenation is a vocabulary token with the highest score (the leftmost pair on ties). A
final symbol that is not a token is emitted as its bytes (``<0xNN>`` tokens). The vocab adds the leading space
(``add_space_prefix``) and splits out user-defined pieces (Gemma's runs of spaces, tabs and newlines) before text
gets here.

llama.cpp runs this over the whole fragment. We cut the fragment into words first, where that provably changes
nothing, and cache each word's ids: a merge only ever joins two adjacent symbols into a vocabulary token, so a
cut point that no token occurrence in the text spans can never be crossed, and merges on either side do not
influence each other (they commute; the tie order inside each side is kept). We cut before a ``▁`` that follows
a non-``▁`` character; a token containing such a pair (Gemma-3 has one: ``>▁</``) is located in the text and no
cut is made inside its occurrences.
"""
from __future__ import annotations

import re

from llmfw.plugins.tokenizers.merge import PairCosts, merge_pairs
from llmfw.sdk import Tokenizer, TokenizerDefaults, TokenizerError, Vocab

SPACE = "▁"
_NO_PAIR = float("inf")
_CUT = re.compile(f"(?<=[^{SPACE}]){SPACE}")  # a ▁ that follows a non-▁ character: we cut before it
_CUT_SPLIT = re.compile(f"(?<=[^{SPACE}])(?={SPACE})").split


class SPMTokenizer(Tokenizer):
    """llama.cpp's SPM tokenizer; see the module docstring."""

    space_prefix_after_special = True

    @classmethod
    def defaults(cls, pre: str) -> TokenizerDefaults:
        return TokenizerDefaults(bos_id=1, eos_id=2, unk_id=0, add_bos=True, add_space_prefix=True)

    def __init__(self, vocab: Vocab):
        super().__init__(vocab)
        self.token_to_id = vocab.token_to_id
        # text -> -score: a merge is only possible into a token, and the best merge is then the smallest value
        negated_score: dict[str, float] = dict(zip(vocab.tokens, (-vocab.scores.astype(float)).tolist()))
        self.pair_costs = PairCosts(negated_score, joined=True, none=_NO_PAIR)
        spanning = [t for t in vocab.tokens if SPACE in t[1:] and _CUT.search(t)]
        self._spanning = re.compile("|".join(re.escape(t) for t in sorted(spanning, key=len, reverse=True))) \
            if spanning else None
        self._byte_tokens = [self._find_byte_token(b) for b in range(256)]

    # -------------------------------------------------------------------------------------------- encode
    def tokenize(self, text: str) -> list[int]:
        return self.encode_words(self._words(text.replace(" ", SPACE)))

    def _words(self, text: str) -> list[str]:
        if self._spanning is None or self._spanning.search(text) is None:
            return _CUT_SPLIT(text)
        # rare: a token spanning a cut occurs here; keep its occurrences (overlapping ones too) in one word
        blocked: set[int] = set()
        pos = 0
        while (match := self._spanning.search(text, pos)) is not None:
            blocked.update(range(match.start() + 1, match.end()))
            pos = match.start() + 1
        bounds = [0, *(m.start() for m in _CUT.finditer(text) if m.start() not in blocked), len(text)]
        return [text[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]

    def encode_word(self, word: str) -> list[int]:
        symbols = merge_pairs(word, self.pair_costs)
        ids: list[int] = []
        for symbol in symbols:
            token = self.token_to_id.get(symbol)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(self._byte_tokens_of(symbol))
        return ids

    # -------------------------------------------------------------------------------------------- bytes
    def _find_byte_token(self, byte: int) -> int | None:
        token = self.token_to_id.get(f"<0x{byte:02X}>")
        if token is None and byte < 0x80:  # llama.cpp falls back to the byte itself as a token text
            token = self.token_to_id.get(chr(byte))
        return token

    def _byte_tokens_of(self, symbol: str) -> list[int]:
        ids = []
        for byte in symbol.encode("utf-8", "surrogatepass"):
            token = self._byte_tokens[byte]
            if token is None:
                raise TokenizerError(f"cannot encode {symbol!r}: it is not a token and the vocab has no byte "
                                     f"token <0x{byte:02X}> to fall back to")
            ids.append(token)
        return ids

    def byte_to_token(self, byte: int) -> int:
        token = self._byte_tokens[byte]
        if token is None:
            raise TokenizerError(f"the SPM vocab has no byte token <0x{byte:02X}>")
        return token

    def normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode("utf-8", "surrogatepass")

    def newline_id(self) -> int | None:
        return self._byte_tokens[0x0A]
