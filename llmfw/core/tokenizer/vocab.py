"""Vocabulary: tokens, scores, types, special ids, and tokenize / token_to_piece / detokenize — llama.cpp's rules.

A :class:`Vocab` is built from a GGUF metadata dict (keys ``tokenizer.ggml.*``) by :meth:`Vocab.from_metadata`.
``tokenizer.ggml.model`` picks the :class:`Tokenizer` plugin from the ``tokenizers`` registry (``"llama"`` → SPM,
``"gpt2"`` → byte-level BPE); the core never imports a plugin module itself.

What the core does, exactly as llama.cpp's ``src/llama-vocab.cpp``:

* loading (:mod:`.vocab_loader`, :class:`~.vocab_loader.VocabLoader`): per-family defaults
  (from the plugin's :meth:`Tokenizer.defaults`), then the GGUF keys; special ids out of range are ignored with a
  warning; EOT / EOM / FIM ids and the end-of-generation set are completed from well-known token texts; control
  tokens whose text contains ``unused`` are marked unused;
* :meth:`Vocab.tokenize`: special-token partitioning first (longest special text first; control tokens only with
  ``parse_special``, user-defined tokens always; ``lstrip`` / ``rstrip`` attributes honoured), then every plain
  text fragment goes to the plugin; BOS / EOS added by the ``add_bos`` / ``add_eos`` flags (a prompt that already
  starts with BOS gets two, with a warning — llama.cpp does the same);
* :meth:`Vocab.token_to_piece` and :meth:`Vocab.detokenize` (``remove_special``, ``unparse_special``, the leading
  space removed after an SPM space prefix, the ``clean_spaces`` passes of BPE vocabularies);
* :class:`StreamingDetokenizer`: token by token, holding back incomplete UTF-8 sequences.

Special ids are ``int`` or ``None`` (absent) — never ``-1``.
"""
from __future__ import annotations

import bisect
import codecs
import logging
import os
import re
from abc import ABC, abstractmethod
from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import TokenizerError, VocabError
from .tokens import (ATTR_BYTE as _BYTE, ATTR_CONTROL as _CONTROL, ATTR_LSTRIP as _LSTRIP, ATTR_NORMAL as _NORMAL,
                     ATTR_RSTRIP as _RSTRIP, ATTR_UNUSED as _UNUSED, ATTR_USER as _USER, HIDDEN_ATTRS as _HIDDEN_ATTRS,
                     KEY_PREFIX as KEY_PREFIX, SPECIAL_ID_NAMES as SPECIAL_ID_NAMES,
                     SPECIAL_SPLIT_ATTRS as _SPECIAL_SPLIT_ATTRS, TokenAttr as TokenAttr,
                     TokenizerDefaults as TokenizerDefaults, TokenType as TokenType)
from .vocab_loader import VocabContents, VocabLoader

log = logging.getLogger(__name__)

_CLEAN_SPACE_BEFORE = frozenset(b"?!.,")


class Tokenizer(ABC):
    """A tokenizer plugin: turns one plain-text fragment into token ids for one :class:`Vocab`.

    Contract:

    * ``__init__(vocab)`` receives the fully loaded :class:`Vocab` (tokens, ``token_to_id``, scores, merges, ``pre``)
      and may precompute whatever it needs; it raises :class:`VocabError` if the vocab lacks something it needs.
    * :meth:`tokenize` gets one fragment of plain text — special tokens were already split out by the vocab, BOS /
      EOS are added by the vocab — and returns ids, deterministically and exactly like llama.cpp's tokenizer of the
      same family. Text that cannot be encoded raises :class:`TokenizerError`.
    * :meth:`normal_piece` renders the stored text of a NORMAL token as bytes (SPM: ``▁`` → space; byte-level BPE:
      the GPT-2 byte alphabet back to bytes); :meth:`byte_to_token` maps a raw byte to its token.
    * :meth:`defaults` gives the family's defaults (special ids, add_bos, ...) before the GGUF keys override them.
    * ``space_prefix_after_special``: the SPM rule — when the vocab's ``add_space_prefix`` is set, a fragment that
      starts the text or follows a special token gets a leading space.

    Register a subclass under its ``tokenizer.ggml.model`` name through the ``register_tokenizers`` hook.
    """

    space_prefix_after_special: bool = False
    #: with ``add_special``, BOS before and SEP after the ids whatever add_bos / add_eos say (llama.cpp's WPM)
    wraps_with_bos_and_sep: bool = False
    #: bound on memoised words, so adversarial text cannot grow the memo without limit
    word_cache_limit: int = 1 << 18

    def __init__(self, vocab: "Vocab"):
        self.vocab = vocab
        self._word_cache: dict[str, list[int]] = {}

    def encode_words(self, words: Iterable[str]) -> list[int]:
        """Ids of ``words`` encoded one by one with :meth:`encode_word`, memoised: natural text repeats its
        words, so tokenizers that can split text into independent words (BPE after pre-tokenization, SPM
        between cuts no piece spans) skip most of the merging work."""
        output: list[int] = []
        cache = self._word_cache
        for word in words:
            ids = cache.get(word)
            if ids is None:
                ids = self.encode_word(word)
                if len(cache) >= self.word_cache_limit:
                    cache.clear()
                cache[word] = ids
            output.extend(ids)
        return output

    def encode_word(self, word: str) -> list[int]:
        """Ids of one word, for :meth:`encode_words` (tokenizers that do not split into words need not define it)."""
        raise NotImplementedError(f"{type(self).__name__} does not encode word by word")

    @classmethod
    def defaults(cls, pre: str) -> TokenizerDefaults:
        """The family's defaults for the ``tokenizer.ggml.pre`` value ``pre`` (may be empty)."""
        return TokenizerDefaults()

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Ids for one fragment of plain text (no special-token parsing, no BOS / EOS)."""

    @abstractmethod
    def normal_piece(self, text: str) -> bytes:
        """The bytes a NORMAL token with stored text ``text`` stands for."""

    @abstractmethod
    def byte_to_token(self, byte: int) -> int:
        """The token of one raw byte; :class:`TokenizerError` if the vocab has none."""

    def clear_cache(self) -> None:
        """Forget memoised results (benchmarks measure a cold start)."""
        self._word_cache.clear()

    def newline_id(self) -> int | None:
        """The token llama.cpp records as the newline token (``token_nl``)."""
        ids = self.tokenize("\n")
        return ids[0] if ids else None


class Vocab:
    """A model's vocabulary and the llama.cpp-exact tokenize / detokenize built on it. See the module docstring.

    Built by :class:`.vocab_loader.VocabLoader` (``Vocab.from_metadata`` / ``Vocab.from_file``), which
    parses and checks the GGUF keys; the vocab holds the result and tokenizes / detokenizes with it.
    """

    n_vocab: int
    tokens: list[str]
    token_to_id: dict[str, int]
    scores: np.ndarray  # float32 [n_vocab]
    token_types: np.ndarray  # int32 [n_vocab]
    #: :class:`TokenAttr` bits per token
    token_attrs: list[int]
    merges: list[str] | None
    #: ``tokenizer.ggml.model`` / ``.pre``
    model: str
    pre: str
    add_bos: bool
    add_eos: bool
    add_sep: bool
    add_space_prefix: bool
    clean_spaces: bool
    normalizer_lowercase: bool
    normalizer_strip_accents: bool
    # the special ids (SPECIAL_ID_NAMES): an id, or None when the vocabulary has none
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    sep_id: int | None
    pad_id: int | None
    mask_id: int | None
    fim_pre_id: int | None
    fim_suf_id: int | None
    fim_mid_id: int | None
    fim_pad_id: int | None
    fim_rep_id: int | None
    fim_sep_id: int | None
    nl_id: int | None
    eog_ids: frozenset[int]
    tokenizer: "Tokenizer"

    # ------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> "Vocab":
        """Build the vocab from GGUF metadata (string arrays as ``list[str]``, numeric arrays as arrays/lists)."""
        return cls(VocabLoader(metadata).contents())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "Vocab":
        """Only the vocabulary of a GGUF model file (reads the header, never the tensor data)."""
        from ..format.gguf import open_gguf

        with open_gguf(path) as gguf:
            return cls.from_metadata(gguf.metadata)

    def __init__(self, contents: VocabContents):
        tokenizer_class = contents.tokenizer_class
        if not (isinstance(tokenizer_class, type) and issubclass(tokenizer_class, Tokenizer)):
            raise VocabError(f"tokenizer plugin for {contents.model!r} is {tokenizer_class!r}, "
                             "not a llmfw.core.tokenizer.vocab.Tokenizer subclass")
        self.model, self.pre = contents.model, contents.pre
        self.tokenizer_metadata: dict[str, Any] = contents.tokenizer_metadata
        self.tokens, self.token_to_id, self.n_vocab = contents.tokens, contents.token_to_id, len(contents.tokens)
        self.scores, self.token_types, self.token_attrs = contents.scores, contents.token_types, contents.token_attrs
        self.merges = contents.merges
        flags = contents.flags
        self.add_space_prefix, self.add_bos, self.add_eos = flags.add_space_prefix, flags.add_bos, flags.add_eos
        self.add_sep, self.clean_spaces = flags.add_sep, flags.clean_spaces
        self.normalizer_lowercase = flags.normalizer_lowercase
        self.normalizer_strip_accents = flags.normalizer_strip_accents
        for name in SPECIAL_ID_NAMES:  # each declared above as ``int | None``
            setattr(self, name, contents.special_ids.get(name))
        self.eog_ids = contents.eog_ids
        self._special_split_order = self._special_tokens_longest_first()
        self._piece_cache: list[bytes | None] = [None] * self.n_vocab
        self._special_matchers: dict[bool, _SpecialMatcher | None] = {}
        self.derived: dict[str, Any] = {}  # things built once from this vocab (the grammar engine's tokenizer)
        self.tokenizer = tokenizer_class(self)
        self.nl_id = self.tokenizer.newline_id()


    def _special_tokens_longest_first(self) -> list[int]:
        # llama.cpp sorts by byte length only (std::sort, unstable); ties here go by id, which is deterministic.
        special = np.flatnonzero(np.asarray(self.token_attrs) & _SPECIAL_SPLIT_ATTRS).tolist()
        return sorted(special, key=lambda t: (-len(self.tokens[t].encode("utf-8", "surrogatepass")), t))

    # ------------------------------------------------------------------------------------------- queries
    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, EOM, FIM pad/rep/sep and the well-known end texts)."""
        return token in self.eog_ids

    def _attr(self, token: int) -> int:
        self._check_id(token)
        return self.token_attrs[token]

    def is_control(self, token: int) -> bool:
        return bool(self._attr(token) & _CONTROL)

    def is_user_defined(self, token: int) -> bool:
        return bool(self._attr(token) & _USER)

    def is_byte(self, token: int) -> bool:
        return bool(self._attr(token) & _BYTE)

    def is_unused(self, token: int) -> bool:
        return bool(self._attr(token) & _UNUSED)

    def text_to_token(self, text: str) -> int | None:
        return self.token_to_id.get(text)

    def _check_id(self, token: Any) -> int:
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise TokenizerError(f"token id must be an integer, found {type(token).__name__} {token!r}")
        if not 0 <= token < self.n_vocab:
            raise TokenizerError(f"token id {int(token)} is out of range: the vocab has {self.n_vocab} tokens "
                                 f"(valid ids 0..{self.n_vocab - 1})")
        return int(token)

    def __repr__(self) -> str:
        return f"Vocab(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab})"

    # ------------------------------------------------------------------------------------------- tokenize
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids for ``text``, exactly as llama.cpp's ``llama_tokenize``.

        ``add_special`` adds BOS / EOS as the vocab's ``add_bos`` / ``add_eos`` say; ``parse_special`` lets control
        tokens written in the text (``<|im_start|>``) become their ids — user-defined tokens are split out always.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"tokenize expects a str, found {type(text).__name__}")
        if add_special and self.tokenizer.wraps_with_bos_and_sep:
            return self._wrap_bos_sep(self.tokenize(text, add_special=False, parse_special=parse_special))
        output: list[int] = []
        if add_special and self.add_bos:
            output.append(self.bos_id)  # type: ignore[arg-type]  # checked at load
        prefix_space = self.tokenizer.space_prefix_after_special and self.add_space_prefix
        tokenize_fragment = self.tokenizer.tokenize
        prev_special = True  # the start of the text counts as "after a special token"
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                output.append(fragment)
                prev_special = True
                continue
            if prefix_space and prev_special:
                fragment = " " + fragment
            output.extend(tokenize_fragment(fragment))
            prev_special = False
        if add_special and self.add_bos and len(output) >= 2 and output[1] == self.bos_id:
            log.warning("tokenize: added a BOS token to the prompt as the model specifies, but the prompt also "
                        "starts with a BOS token; the result starts with 2 BOS tokens")
        if add_special and self.add_eos:
            output.append(self.eos_id)  # type: ignore[arg-type]
            if len(output) >= 2 and output[-2] == self.eos_id:
                log.warning("tokenize: added an EOS token, but the prompt also ends with one; it now ends with 2")
        return output

    def _wrap_bos_sep(self, ids: list[int]) -> list[int]:
        if self.bos_id is None or self.sep_id is None:
            raise TokenizerError(f"the {self.model!r} tokenizer adds BOS and SEP, but the vocab lacks "
                                 f"{'BOS' if self.bos_id is None else 'SEP'}")
        return [self.bos_id, *ids, self.sep_id]

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's ``tokenizer_st_partition``: special tokens split out, as fragments in text order.

        llama.cpp takes the special tokens longest first and splits every remaining text fragment at the token's
        occurrences, leftmost first (stripping whitespace next to tokens with the lstrip / rstrip attributes).
        Equivalently, we keep the claimed spans sorted and claim, token by token, every occurrence that lies
        entirely in unclaimed text, left to right — only touching the places where the token occurs.
        """
        if not text:
            return []
        candidates = self._special_tokens_in(text, parse_special)
        if not candidates:
            return [text]
        starts: list[int] = []  # claimed spans, sorted: [starts[i], ends[i]) holds token ids[i]
        ends: list[int] = []
        ids: list[int] = []
        for token in candidates:
            self._claim_occurrences(text, token, starts, ends, ids)
        fragments: list[str | int] = []
        previous_end = 0
        for start, end, token in zip(starts, ends, ids):
            if start > previous_end:
                fragments.append(text[previous_end:start])
            fragments.append(token)
            previous_end = end
        if previous_end < len(text):
            fragments.append(text[previous_end:])
        return fragments

    def _claim_occurrences(self, text: str, token: int, starts: list[int], ends: list[int], ids: list[int]) -> None:
        special, attr = self.tokens[token], self.token_attrs[token]
        size = len(special)
        pos = text.find(special)
        while pos >= 0:
            i = bisect.bisect_right(starts, pos)
            gap_start = ends[i - 1] if i else 0
            gap_end = starts[i] if i < len(starts) else len(text)
            if pos < gap_start or pos + size > gap_end:  # overlaps a claimed span: not in any text fragment
                pos = text.find(special, pos + 1)
                continue
            claim_start, claim_end = pos, pos + size
            if attr & _LSTRIP:
                while claim_start > gap_start and text[claim_start - 1] in _C_SPACE:
                    claim_start -= 1
            if attr & _RSTRIP:
                while claim_end < gap_end and text[claim_end] in _C_SPACE:
                    claim_end += 1
            starts.insert(i, claim_start)
            ends.insert(i, claim_end)
            ids.insert(i, token)
            pos = text.find(special, claim_end)  # llama.cpp goes on in the rest of the fragment

    def _special_tokens_in(self, text: str, parse_special: bool) -> list[int]:
        """The special tokens that occur in ``text``, in llama.cpp's processing order (longest first).

        A trie regex finds, left to right, the longest special text at each match start. Every occurrence of a
        special text starts either at such a match (then it is a prefix of the match) or inside one (then it is a
        prefix of the match's rest, or starts with that rest and is confirmed by a substring search), so nothing
        is missed, and the exact partition only has to consider the few tokens that occur.
        """
        matcher = self._special_matcher(parse_special)
        if matcher is None:
            return []
        found: set[str] = set()
        maybe: set[str] = set()  # special texts that would run past the end of a match: confirmed below
        for match in set(matcher.pattern.findall(text)):
            found.update(matcher.prefixes_of(match))
            for k in range(1, len(match)):
                rest = match[k:]
                found.update(matcher.prefixes_of(rest))
                maybe.update(matcher.extending(rest))
        found.update(t for t in maybe - found if t in text)
        if not found:
            return []
        ids = {self.token_to_id[t] for t in found}
        return [t for t in self._special_split_order if t in ids]

    def _special_matcher(self, parse_special: bool) -> "_SpecialMatcher | None":
        if parse_special not in self._special_matchers:
            allowed = _SPECIAL_SPLIT_ATTRS if parse_special else _USER
            texts = [self.tokens[t] for t in self._special_split_order
                     if self.token_attrs[t] & allowed and (parse_special or not self.token_attrs[t] & _HIDDEN_ATTRS)]
            self._special_matchers[parse_special] = _SpecialMatcher(texts) if texts else None
        return self._special_matchers[parse_special]

    # ------------------------------------------------------------------------------------------- pieces
    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (llama.cpp's ``llama_token_to_piece`` with ``lstrip=0``).

        Control and unknown tokens render as ``b""`` unless ``special``; byte tokens give their byte, which may be
        part of a multi-byte UTF-8 character.
        """
        return self._piece(self._check_id(token), special)

    def all_pieces(self, special: bool = True) -> list[bytes]:
        """``token_to_piece(t, special)`` for every id, in one call (for samplers that scan the whole vocab)."""
        cache = self._piece_cache
        pieces: list[bytes] = []
        for token, piece in enumerate(cache):
            if piece is None:
                piece = cache[token] = self._render_piece(token)
            pieces.append(piece)
        if special:
            return pieces
        return [b"" if attr & _HIDDEN_ATTRS else piece for attr, piece in zip(self.token_attrs, pieces)]

    def _piece(self, token: int, special: bool) -> bytes:
        if not special and self.token_attrs[token] & _HIDDEN_ATTRS:
            return b""
        piece = self._piece_cache[token]
        if piece is None:
            piece = self._piece_cache[token] = self._render_piece(token)
        return piece

    def _render_piece(self, token: int) -> bytes:
        attr = self.token_attrs[token]
        text = self.tokens[token]
        if attr & (_HIDDEN_ATTRS | _USER):
            return text.encode("utf-8", "surrogatepass")
        if attr & _NORMAL:
            return self.tokenizer.normal_piece(text)
        if attr & _BYTE:
            return bytes((self.token_to_byte(token),))
        return b""  # unused / undefined tokens render as nothing, like llama.cpp

    def token_to_byte(self, token: int) -> int:
        """The byte a ``<0xNN>`` byte token stands for."""
        text = self.tokens[self._check_id(token)]
        try:
            return int(text[3:5], 16)
        except ValueError:
            raise TokenizerError(f"token {token} {text!r} is marked as a byte token but is not of the form <0xNN>") \
                from None

    def detokenize(self, tokens: Iterable[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text for ``tokens``, as llama.cpp's ``llama_detokenize`` (invalid UTF-8 becomes U+FFFD)."""
        return self.detokenize_bytes(tokens, remove_special, unparse_special).decode("utf-8", "replace")

    def detokenize_bytes(self, tokens: Iterable[int], remove_special: bool = False,
                         unparse_special: bool = False) -> bytes:
        """Like :meth:`detokenize`, but the raw bytes."""
        ids = [self._check_id(t) for t in tokens]
        remove_space = self.add_space_prefix  # the space an SPM prefix added before the first word
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        pieces = [self._piece(t, unparse_special) for t in ids]
        if remove_space and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]  # lstrip=1 on the first token only
        text = b"".join(pieces)
        return _clean_spaces(text) if self.clean_spaces else text


class _SpecialMatcher:
    """Finds special-token texts in text: a regex over their trie (longest text first at each position, without
    trying thousands of alternatives one by one) plus prefix queries."""

    def __init__(self, texts: list[str]):
        self.texts = frozenset(texts)
        self._sorted = sorted(self.texts)
        self.pattern = re.compile(_trie_regex(self._sorted))

    def prefixes_of(self, text: str) -> list[str]:
        """The special texts that are prefixes of ``text``."""
        return [text[:end] for end in range(1, len(text) + 1) if text[:end] in self.texts]

    def extending(self, prefix: str) -> list[str]:
        """The special texts that start with ``prefix`` and are longer than it."""
        i = bisect.bisect_right(self._sorted, prefix)
        out = []
        while i < len(self._sorted) and self._sorted[i].startswith(prefix):
            out.append(self._sorted[i])
            i += 1
        return out


def _trie_regex(texts: list[str]) -> str:
    """A regex matching any of ``texts`` (sorted), preferring the longest at each position."""
    trie: dict[str, Any] = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = True  # end of a text

    def emit(node: dict[str, Any]) -> str:
        branches = []
        for char in sorted(k for k in node if k):
            chain, child = re.escape(char), node[char]
            while len(child) == 1 and "" not in child:  # a path without branches: one literal
                (next_char, child), = child.items()
                chain += re.escape(next_char)
            branches.append(chain + emit(child))
        if not branches:
            return ""
        if "" in node:  # this node ends a text: try the longer ones first
            branches.append("")
        return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"

    return emit(trie)


_C_SPACE = frozenset(" \t\n\v\f\r")  # C isspace(): what lstrip / rstrip remove


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's three ``clean_spaces`` passes over the detokenized bytes."""
    if not text:
        return text
    # 1: " ?", " !", " .", " ,"  -> drop the space
    out = bytearray(text[:1])
    for i in range(1, len(text)):
        if text[i - 1] == 0x20 and text[i] in _CLEAN_SPACE_BEFORE:
            out.pop()
        out.append(text[i])
    # 2: a single apostrophe between spaces: " ' " -> "'"
    src, out = bytearray(out), bytearray(out[:1])
    i, n = 1, len(src)
    while i < n:
        x = src[i]
        if x == 0x27 and i + 1 < n and src[i - 1] == 0x20 and src[i + 1] == 0x20:
            out.pop()
            out.append(x)
            src[i + 1] = 0  # llama.cpp overwrites the dropped space with NUL, which the next test then sees
            i += 2
            continue
        out.append(x)
        i += 1
    # 3: contractions " 's", " 'm", " 're", " 've" -> drop the space
    src, out = bytearray(out), bytearray(out[:1])  # (read only from here on)
    n = len(src)
    for i in range(1, n):
        x = src[i]
        if src[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = src[i + 1]
            if x1 in b"sm":
                out.pop()
            elif i + 2 < n and (x1, src[i + 2]) in ((0x72, 0x65), (0x76, 0x65)):  # 're, 've
                out.pop()
        out.append(x)
    return bytes(out)


class StreamingDetokenizer:
    """Token-by-token text for generation: :meth:`feed` returns the newly complete text, holding back a UTF-8
    character whose bytes are split across tokens (byte tokens, emoji, CJK); :meth:`flush` returns what is left
    (an incomplete sequence becomes U+FFFD).

    ``special`` renders control tokens (llama.cpp's ``special`` flag of ``token_to_piece``).
    """

    def __init__(self, vocab: Vocab, special: bool = False):
        self.vocab = vocab
        self.special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token: int) -> str:
        return self._decoder.decode(self.vocab.token_to_piece(token, self.special))

    def flush(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text

    @property
    def pending(self) -> bytes:
        """Bytes held back because they do not yet form a complete UTF-8 character."""
        return self._decoder.getstate()[0]
