"""Unigram (``tokenizer.ggml.model = "t5"``: T5, mT5, XLM-RoBERTa style), exactly as llama.cpp's ``llm_tokenizer_ugm``.

Tokenizing one text fragment, on its UTF-8 bytes:

1. **Normalization** (SentencePiece's): at each position, a user-defined token's text is kept as is (llama.cpp
   takes the longest path of its user-defined-token trie, whole token or not); else the longest prefix the
   ``tokenizer.ggml.precompiled_charsmap`` maps (an XOR-compressed compact double array, XCDA, plus
   NUL-terminated replacements) is replaced; else one UTF-8 character is copied (an invalid byte becomes U+FFFD).
   Spaces become U+2581; ``add_space_prefix`` puts one before the text, ``remove_extra_whitespaces`` drops
   runs of spaces and puts one before every word.
2. **Viterbi** over byte positions (as llama.cpp's trie walk finds them): every token (normal, user-defined — scored 0 —, unused) that matches at a
   position extends the best path there by its score (in double precision, like SentencePiece); a character no
   single token covers costs the unknown token's score (lowest normal score - 10). Consecutive unknown tokens of
   the best path merge into one.

Defaults as llama.cpp's for ``t5``: EOS 1, UNK 2, PAD 0, no BOS; add_eos on, add_bos off.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from llmfw.sdk import TokenAttr, Tokenizer, TokenizerDefaults, TokenizerError, Vocab, VocabError

SPACE = "\u2581"
_SPACE_BYTES = SPACE.encode()
_REPLACEMENT = "\ufffd".encode()
UNKNOWN_PENALTY = np.float32(10.0)
CHARSMAP_KEY = "tokenizer.ggml.precompiled_charsmap"
REMOVE_EXTRA_WS_KEY = "tokenizer.ggml.remove_extra_whitespaces"
_NORMAL, _USER, _UNUSED = int(TokenAttr.NORMAL), int(TokenAttr.USER_DEFINED), int(TokenAttr.UNUSED)


class _CharsMap:
    """SentencePiece's precompiled normalization map: longest-prefix replacement through an XCDA."""

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise VocabError(f"{CHARSMAP_KEY} is {len(blob)} bytes, too small for its size header")
        (xcda_size,) = struct.unpack_from("<I", blob, 0)
        if xcda_size + 4 >= len(blob):
            raise VocabError(f"{CHARSMAP_KEY}: its XCDA claims {xcda_size} bytes of a {len(blob)}-byte blob")
        self.xcda = np.frombuffer(blob, dtype="<u4", count=xcda_size // 4, offset=4).tolist()
        self.replacements = blob[4 + xcda_size:]

    def _node(self, index: int) -> int:
        if index >= len(self.xcda):
            raise TokenizerError(f"{CHARSMAP_KEY}: XCDA index {index} out of bounds ({len(self.xcda)} entries)")
        return int(self.xcda[index])

    def _base(self, index: int) -> int:
        node = self._node(index)
        return (node >> 10) << ((node & (1 << 9)) >> 6)

    def longest_match(self, data: bytes, start: int) -> tuple[int, bytes] | None:
        """(bytes matched, replacement) of the longest mapped prefix of ``data[start:]``, or None."""
        best: tuple[int, int] | None = None
        index = self._base(0)
        for pos in range(start, len(data)):
            c = data[pos]
            if c == 0:
                break
            index ^= c
            node = self._node(index)
            if node & ((1 << 31) | 0xFF) != c:  # LCHECK: not a child of the previous node
                break
            is_leaf = (node >> 8) & 1
            index ^= self._base(index)
            if is_leaf:
                best = (pos - start + 1, self._node(index) & ((1 << 31) - 1))
        if best is None:
            return None
        length, offset = best
        if offset >= len(self.replacements):
            raise TokenizerError(f"{CHARSMAP_KEY}: replacement offset {offset} out of bounds")
        end = self.replacements.find(b"\0", offset)
        if end < 0:
            raise TokenizerError(f"{CHARSMAP_KEY}: unterminated replacement at offset {offset}")
        return length, self.replacements[offset:end]


def _utf8_length(data: bytes, pos: int) -> int:
    """Bytes of the UTF-8 character at ``pos`` as llama.cpp's ``unicode_cpt_from_utf8`` accepts it; 0 if invalid."""
    first = data[pos]
    if first < 0x80:
        return 1
    for lead_mask, size in ((0x20, 2), (0x10, 3), (0x08, 4)):
        if not first & 0x40:
            return 0
        if not first & lead_mask:
            if pos + size - 1 >= len(data) or any(data[pos + k] & 0xC0 != 0x80 for k in range(1, size)):
                return 0
            return size
    return 0


def _trie_depth(prefixes: frozenset[bytes], data: bytes, start: int, longest: int) -> int:
    """How far the trie of ``prefixes`` follows ``data[start:]`` (llama.cpp's ``get_longest_prefix``)."""
    depth = 0
    while depth < longest and start + depth < len(data) and data[start:start + depth + 1] in prefixes:
        depth += 1
    return depth


def _prefixes(texts: list[bytes]) -> frozenset[bytes]:
    return frozenset(text[:k] for text in texts for k in range(1, len(text) + 1))


class UGMTokenizer(Tokenizer):
    """llama.cpp's UGM tokenizer; see the module docstring."""

    @classmethod
    def defaults(cls, pre: str) -> TokenizerDefaults:
        return TokenizerDefaults(eos_id=1, unk_id=2, pad_id=0, add_bos=False, add_eos=True)

    def __init__(self, vocab: Vocab):
        super().__init__(vocab)
        keys = vocab.tokenizer_metadata
        self.charsmap = _CharsMap(self._charsmap_bytes(keys.get(CHARSMAP_KEY))) if CHARSMAP_KEY in keys else None
        remove_ws = keys.get(REMOVE_EXTRA_WS_KEY, False)
        if not isinstance(remove_ws, (bool, np.bool_)):
            raise VocabError(f"{REMOVE_EXTRA_WS_KEY}: expected a bool, found {remove_ws!r}")
        self.remove_extra_whitespaces = bool(remove_ws)
        self._build_matchers(vocab)

    @staticmethod
    def _charsmap_bytes(value: Any) -> bytes:
        if isinstance(value, np.ndarray) and value.dtype in (np.int8, np.uint8):
            return value.astype(np.uint8).tobytes()
        raise VocabError(f"{CHARSMAP_KEY}: expected an array of int8 / uint8, found {type(value).__name__}")

    def _build_matchers(self, vocab: Vocab) -> None:
        self.piece_ids: dict[bytes, int] = {}
        user_texts: list[bytes] = []
        min_score = np.float32(np.finfo(np.float32).max)
        for token, (text, attr) in enumerate(zip(vocab.tokens, vocab.token_attrs)):
            if attr & _NORMAL:
                min_score = np.minimum(min_score, np.float32(vocab.scores[token]))
            if attr & (_NORMAL | _USER | _UNUSED):
                self.piece_ids[text.encode("utf-8", "surrogatepass")] = token  # a later duplicate wins, as in the trie
            if attr & _USER:
                user_texts.append(text.encode("utf-8", "surrogatepass"))
        self.piece_scores = {piece: 0.0 if vocab.token_attrs[t] & _USER else float(vocab.scores[t])
                             for piece, t in self.piece_ids.items()}
        # the longest piece per first byte bounds the candidates at a position (instead of a trie walk)
        self.longest_from = [0] * 256
        for piece in self.piece_ids:
            if piece and len(piece) > self.longest_from[piece[0]]:
                self.longest_from[piece[0]] = len(piece)
        self.user_prefixes = _prefixes(user_texts)
        self.longest_user = max(map(len, user_texts), default=0)
        self.unknown_score = float(np.float32(min_score - UNKNOWN_PENALTY))

    # ------------------------------------------------------------------------------------- normalization
    def _normalize_prefix(self, data: bytes, pos: int) -> tuple[bytes, int]:
        """(normalized bytes, input bytes consumed) at ``pos``."""
        depth = _trie_depth(self.user_prefixes, data, pos, self.longest_user)
        if depth:
            return data[pos:pos + depth], depth
        if self.charsmap is not None:
            match = self.charsmap.longest_match(data, pos)
            if match is not None:
                return match[1], match[0]
        size = _utf8_length(data, pos)
        return (data[pos:pos + size], size) if size else (_REPLACEMENT, 1)

    def normalize(self, text: str) -> bytes:
        data = text.encode("utf-8", "surrogatepass")
        space = _SPACE_BYTES  # llama.cpp's escape_whitespaces is on for UGM vocabularies
        prepend = self.vocab.add_space_prefix
        merge = self.remove_extra_whitespaces
        out = bytearray()
        prepended = in_word = False
        pos = 0
        while pos < len(data):
            normalized, consumed = self._normalize_prefix(data, pos)
            for c in normalized:
                if c != 0x20:
                    if not in_word:
                        in_word = True
                        if (prepend and not prepended) or merge:
                            out += space
                            prepended = True
                    out.append(c)
                else:
                    in_word = False
                    if not merge:
                        out += space
            pos += consumed
        return bytes(out)

    # ------------------------------------------------------------------------------------- viterbi
    def tokenize(self, text: str) -> list[int]:
        data = self.normalize(text)
        n = len(data)
        if n == 0:
            return []
        unk = self.vocab.unk_id
        best_score = [-float("inf")] * (n + 1)
        best_token: list[int | None] = [unk] * (n + 1)
        best_start = [0] * (n + 1)
        best_score[0] = 0.0
        pos = 0
        while pos < n:
            char_len = min(_lead_length(data[pos]), n - pos)
            base = best_score[pos]
            covered = False
            for end in range(pos + 1, min(n, pos + self.longest_from[data[pos]]) + 1):
                piece = data[pos:end]
                token = self.piece_ids.get(piece)
                if token is not None:
                    covered = covered or end - pos == char_len
                    score = base + self.piece_scores[piece]
                    if score > best_score[end]:
                        best_score[end], best_token[end], best_start[end] = score, token, pos
            if not covered:
                score = base + self.unknown_score
                if score > best_score[pos + char_len]:
                    best_score[pos + char_len], best_token[pos + char_len], best_start[pos + char_len] = \
                        score, unk, pos
            pos += char_len
        return self._backtrack(best_token, best_start, n)

    def _backtrack(self, best_token: list[int | None], best_start: list[int], n: int) -> list[int]:
        unk = self.vocab.unk_id
        ids: list[int] = []
        previous_unknown = False
        pos = n
        while True:
            token = best_token[pos]
            unknown = token == unk
            if not (previous_unknown and unknown):
                if token is None:
                    raise TokenizerError("the text needs the unknown token, but the UGM vocab has none")
                ids.append(token)
            if best_start[pos] == 0:
                break
            previous_unknown = unknown
            pos = best_start[pos]
        ids.reverse()
        return ids

    # ------------------------------------------------------------------------------------- pieces
    def normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode("utf-8", "surrogatepass")

    def byte_to_token(self, byte: int) -> int:
        for text in (f"<0x{byte:02X}>", chr(byte) if byte < 0x80 else None):
            token = self.vocab.token_to_id.get(text) if text is not None else None
            if token is not None:
                return token
        raise TokenizerError(f"the UGM vocab has no token for byte 0x{byte:02X}")


def _lead_length(first: int) -> int:
    """llama.cpp's ``unicode_len_utf8``: the length a lead byte announces (1 for a stray continuation byte)."""
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[first >> 4]
