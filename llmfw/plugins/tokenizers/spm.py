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

import heapq
import re
from itertools import repeat
from operator import add

from llmfw.sdk import Tokenizer, TokenizerDefaults, TokenizerError, Vocab

SPACE = "▁"
_SMALL_WORD = 256  # up to this many symbols a C-level rescan per merge beats a heap
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
        self._negated_score: dict[str, float] = dict(zip(vocab.tokens, (-vocab.scores.astype(float)).tolist()))
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
        symbols = self._merge_small(word) if len(word) <= _SMALL_WORD else self._merge_large(word)
        ids: list[int] = []
        for symbol in symbols:
            token = self.token_to_id.get(symbol)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(self._byte_tokens_of(symbol))
        return ids

    def _merge_small(self, word: str) -> list[str]:
        """Merge the highest-score adjacent pair (leftmost on ties) until none is left; ``min`` / ``index`` run in C."""
        symbols = list(word)
        get = self._negated_score.get
        costs = list(map(get, map(add, symbols[:-1], symbols[1:]), repeat(_NO_PAIR)))  # loops in C
        while costs:
            best = min(costs)
            if best == _NO_PAIR:
                break
            at = costs.index(best)
            symbols[at:at + 2] = [symbols[at] + symbols[at + 1]]
            del costs[at]
            if at > 0:
                costs[at - 1] = get(symbols[at - 1] + symbols[at], _NO_PAIR)
            if at < len(costs):
                costs[at] = get(symbols[at] + symbols[at + 1], _NO_PAIR)
        return symbols

    def _merge_large(self, word: str) -> list[str]:
        """llama.cpp's linked list + priority queue (highest score first, then leftmost)."""
        text = list(word)
        n = len(text)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length): best first

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                cost = self._negated_score.get(text[left] + text[right])
                if cost is not None:
                    heapq.heappush(heap, (cost, left, right, len(text[left]) + len(text[right])))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not text[left] or not text[right] or len(text[left]) + len(text[right]) != size:
                continue  # stale: a side grew or was merged away since the pair was queued
            text[left], text[right] = text[left] + text[right], ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        return [t for t in text if t]

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
