"""Vocabulary: tokens, scores, types, special ids, and tokenize / token_to_piece / detokenize — llama.cpp's rules.

A :class:`Vocab` is built from a GGUF metadata dict (keys ``tokenizer.ggml.*``) by :meth:`Vocab.from_metadata`.
``tokenizer.ggml.model`` picks the :class:`Tokenizer` plugin from the ``tokenizers`` registry (``"llama"`` → SPM,
``"gpt2"`` → byte-level BPE); the core never imports a plugin module itself.

What the core does, exactly as llama.cpp's ``src/llama-vocab.cpp``:

* loading: per-family defaults (from the plugin's :meth:`Tokenizer.defaults`), then the GGUF keys; special ids
  out of range are ignored with a warning; EOT / EOM / FIM ids and the end-of-generation set are completed from
  well-known token texts; control tokens whose text contains ``unused`` are marked unused;
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
from dataclasses import dataclass, fields
from enum import IntEnum, IntFlag
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .errors import PluginError, TokenizerError, VocabError

log = logging.getLogger(__name__)

KEY_PREFIX = "tokenizer.ggml."


class TokenType(IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(IntFlag):
    """Per-token attribute bits (llama.cpp's ``llama_token_attr``)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


_ATTR_OF_TYPE = {
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.BYTE: TokenAttr.BYTE,
}
_ATTR_BY_TYPE = np.array([int(_ATTR_OF_TYPE.get(TokenType(t), TokenAttr.UNDEFINED)) for t in range(len(TokenType))],
                         dtype=np.int64)  # token type -> attribute bits (unknown types: UNDEFINED)
# plain ints for the hot paths
_UNKNOWN, _UNUSED, _NORMAL, _CONTROL, _USER, _BYTE = (int(a) for a in (
    TokenAttr.UNKNOWN, TokenAttr.UNUSED, TokenAttr.NORMAL, TokenAttr.CONTROL, TokenAttr.USER_DEFINED, TokenAttr.BYTE))
_LSTRIP, _RSTRIP = int(TokenAttr.LSTRIP), int(TokenAttr.RSTRIP)
_SPECIAL_SPLIT_ATTRS = _CONTROL | _USER | _UNKNOWN  # what tokenizer_st_partition may split out
_HIDDEN_ATTRS = _UNKNOWN | _CONTROL  # rendered only with special=True

# Well-known texts llama.cpp uses to find ids the converter did not write (in llama.cpp's order; the first text
# present wins — llama.cpp walks a hash map, whose order is unspecified).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre_id": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                   "<|code_prefix|>", "<|prefix|>"),
    "fim_suf_id": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                   "<|code_suffix|>", "<|suffix|>"),
    "fim_mid_id": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                   "<|code_middle|>", "<|middle|>"),
    "fim_pad_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep_id": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: user-defined

# GGUF key (without the prefix) -> Vocab attribute; later keys of the same attribute are the deprecated aliases
_SPECIAL_ID_KEYS = (
    ("bos_token_id", "bos_id"), ("eos_token_id", "eos_id"), ("eot_token_id", "eot_id"),
    ("eom_token_id", "eom_id"), ("unknown_token_id", "unk_id"), ("seperator_token_id", "sep_id"),
    ("padding_token_id", "pad_id"), ("mask_token_id", "mask_id"),
    ("fim_pre_token_id", "fim_pre_id"), ("fim_suf_token_id", "fim_suf_id"), ("fim_mid_token_id", "fim_mid_id"),
    ("fim_pad_token_id", "fim_pad_id"), ("fim_rep_token_id", "fim_rep_id"), ("fim_sep_token_id", "fim_sep_id"),
    ("prefix_token_id", "fim_pre_id"), ("suffix_token_id", "fim_suf_id"), ("middle_token_id", "fim_mid_id"),
)
SPECIAL_ID_NAMES = tuple(dict.fromkeys(attr for _, attr in _SPECIAL_ID_KEYS))

_CLEAN_SPACE_BEFORE = frozenset(b"?!.,")


@dataclass
class TokenizerDefaults:
    """What a tokenizer family sets before the GGUF keys are read (llama.cpp's per-vocab-type defaults).

    Special ids that fall outside the vocabulary are dropped (with a warning) when the vocab is built.
    """

    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    sep_id: int | None = None
    pad_id: int | None = None
    mask_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_sep: bool = False
    add_space_prefix: bool = False
    #: detokenize removes spaces before ``?!.,`` and some contractions (llama.cpp's ``clean_spaces``)
    clean_spaces: bool = False


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


def _as_list(value: Any, key: str, kind: str) -> Sequence[Any]:
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise VocabError(f"{key}: expected a one-dimensional array of {kind}, found shape {value.shape}")
        return value
    if isinstance(value, (list, tuple)):
        return value
    raise VocabError(f"{key}: expected an array of {kind}, found {type(value).__name__}")


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise VocabError(f"{key}: expected a bool, found {type(value).__name__} {value!r}")


def _as_index(value: Any, key: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise VocabError(f"{key}: expected an integer token id, found {type(value).__name__} {value!r}")
    return int(value)


class Vocab:
    """A model's vocabulary and the llama.cpp-exact tokenize / detokenize built on it. See the module docstring.

    Attributes: ``n_vocab``, ``tokens`` (list[str]), ``scores`` (float32 array), ``token_types`` (int32 array),
    ``token_attrs`` (list[int] of :class:`TokenAttr` bits), ``token_to_id``, ``merges`` (list[str] or None),
    ``model`` and ``pre`` (``tokenizer.ggml.model`` / ``.pre``), the flags ``add_bos``, ``add_eos``, ``add_sep``,
    ``add_space_prefix``, ``clean_spaces``, the special ids ``bos_id``, ``eos_id``, ``eot_id``, ``eom_id``,
    ``unk_id``, ``sep_id``, ``pad_id``, ``mask_id``, ``nl_id``, ``fim_pre_id``, ``fim_suf_id``, ``fim_mid_id``,
    ``fim_pad_id``, ``fim_rep_id``, ``fim_sep_id`` (each ``int`` or ``None``), ``eog_ids`` and ``tokenizer``.
    """

    # ------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> "Vocab":
        """Build the vocab from GGUF metadata (string arrays as ``list[str]``, numeric arrays as arrays/lists)."""
        return cls(metadata)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "Vocab":
        """Only the vocabulary of a GGUF model file (reads the header, never the tensor data)."""
        from .gguf import open_gguf

        with open_gguf(path) as gguf:
            return cls(gguf.metadata)

    def __init__(self, metadata: Mapping[str, Any]):
        self.model = self._read_model_name(metadata)
        tokenizer_class = self._tokenizer_class(self.model)
        pre = metadata.get(KEY_PREFIX + "pre", "")
        if not isinstance(pre, str):
            raise VocabError(f"{KEY_PREFIX}pre: expected a string, found {type(pre).__name__} {pre!r}")
        self.pre: str = pre
        #: every tokenizer.ggml.* key, for plugins with keys of their own (UGM's precompiled_charsmap ...)
        self.tokenizer_metadata: dict[str, Any] = {k: v for k, v in metadata.items() if k.startswith(KEY_PREFIX)}
        defaults = tokenizer_class.defaults(pre)
        self._read_tokens(metadata)
        self.merges: list[str] | None = self._read_merges(metadata)
        self._read_flags(metadata, defaults)
        self._read_special_ids(metadata, defaults)
        self._detect_special_tokens_by_text()
        self._apply_model_specific_attrs(metadata)
        self._special_split_order = self._special_tokens_longest_first()
        self._piece_cache: list[bytes | None] = [None] * self.n_vocab
        self._special_matchers: dict[bool, _SpecialMatcher | None] = {}
        self.derived: dict[str, Any] = {}  # things built once from this vocab (the grammar engine's tokenizer)
        self.tokenizer: Tokenizer = tokenizer_class(self)
        self.nl_id: int | None = self.tokenizer.newline_id()

    @staticmethod
    def _read_model_name(metadata: Mapping[str, Any]) -> str:
        model = metadata.get(KEY_PREFIX + "model")
        if model is None:
            raise VocabError(f"{KEY_PREFIX}model is missing: the file has no tokenizer")
        if not isinstance(model, str):
            raise VocabError(f"{KEY_PREFIX}model: expected a string, found {type(model).__name__} {model!r}")
        return model

    @staticmethod
    def _tokenizer_class(model: str) -> type[Tokenizer]:
        from .plugins import registry  # the registry imports plugin modules lazily, by name

        tokenizers = registry("tokenizers")
        if model not in tokenizers:
            known = ", ".join(tokenizers.names()) or "(none)"
            raise VocabError(f"unknown {KEY_PREFIX}model {model!r}; known tokenizers: {known}")
        try:
            cls = tokenizers.get(model)
        except PluginError as exc:
            raise VocabError(f"tokenizer plugin for {model!r} failed to load: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Tokenizer)):
            raise VocabError(f"tokenizer plugin for {model!r} is {cls!r}, not a llmfw.core.vocab.Tokenizer subclass")
        return cls

    def _read_tokens(self, metadata: Mapping[str, Any]) -> None:
        key = KEY_PREFIX + "tokens"
        if key not in metadata:
            raise VocabError(f"{key} is missing: cannot find the tokenizer vocabulary")
        raw = _as_list(metadata[key], key, "strings")
        n = len(raw)
        if n == 0:
            raise VocabError(f"{key} is empty")
        tokens = list(raw)
        if set(map(type, tokens)) != {str}:
            bad = next(i for i, word in enumerate(tokens) if not isinstance(word, str))
            raise VocabError(f"{key}[{bad}]: expected a string, found {type(tokens[bad]).__name__}")
        token_to_id = dict(zip(tokens, range(n)))
        if len(token_to_id) != n or "" in token_to_id:  # rare: rebuild one by one to name the culprit
            token_to_id = self._checked_token_index(tokens)
        self.tokens: list[str] = tokens
        self.token_to_id: dict[str, int] = token_to_id
        self.n_vocab: int = n
        self.scores: np.ndarray = self._read_numeric(metadata, "scores", n, np.float32, 0.0)
        self.token_types: np.ndarray = self._read_numeric(metadata, "token_type", n, np.int32, TokenType.NORMAL)
        in_range = (self.token_types >= 0) & (self.token_types < len(_ATTR_BY_TYPE))
        self.token_attrs: list[int] = np.where(in_range, _ATTR_BY_TYPE[np.where(in_range, self.token_types, 0)],
                                               0).tolist()

    @staticmethod
    def _checked_token_index(tokens: list[str]) -> dict[str, int]:
        token_to_id: dict[str, int] = {}
        for i, word in enumerate(tokens):
            if not word:  # llama.cpp renames empty tokens so that they can never match text
                log.warning("vocab: empty token at index %d", i)
                word = tokens[i] = f"[EMPTY_{i}]"
            if word in token_to_id:
                raise VocabError(f"duplicate token in vocabulary: {word!r} has ids {token_to_id[word]} and {i}")
            token_to_id[word] = i
        return token_to_id

    @staticmethod
    def _read_numeric(metadata: Mapping[str, Any], name: str, n: int, dtype: type, default: Any) -> np.ndarray:
        key = KEY_PREFIX + name
        if key not in metadata:
            return np.full(n, default, dtype=dtype)
        values = _as_list(metadata[key], key, "numbers")
        if len(values) < n:
            raise VocabError(f"{key}: expected at least {n} values (one per token), found {len(values)}")
        try:
            array = np.asarray(values[:n])
        except (TypeError, ValueError) as exc:
            raise VocabError(f"{key}: expected numbers: {exc}") from None
        if array.dtype.kind not in "iuf" or (np.dtype(dtype).kind in "iu" and array.dtype.kind == "f"):
            raise VocabError(f"{key}: expected {np.dtype(dtype).name} values, found {array.dtype}")
        return array.astype(dtype, copy=True)

    @staticmethod
    def _read_merges(metadata: Mapping[str, Any]) -> list[str] | None:
        key = KEY_PREFIX + "merges"
        if key not in metadata:
            return None
        merges = list(_as_list(metadata[key], key, "strings"))
        if merges and set(map(type, merges)) != {str}:
            bad = next(i for i, item in enumerate(merges) if not isinstance(item, str))
            raise VocabError(f"{key}[{bad}]: expected a string, found {type(merges[bad]).__name__}")
        return merges

    def _read_flags(self, metadata: Mapping[str, Any], defaults: TokenizerDefaults) -> None:
        def flag(name: str, default: bool) -> bool:
            key = KEY_PREFIX + name
            return _as_bool(metadata[key], key) if key in metadata else default

        self.add_space_prefix: bool = flag("add_space_prefix", defaults.add_space_prefix)
        self.add_bos: bool = flag("add_bos_token", defaults.add_bos)
        self.add_eos: bool = flag("add_eos_token", defaults.add_eos)
        self.add_sep: bool = flag("add_sep_token", defaults.add_sep)
        self.clean_spaces: bool = defaults.clean_spaces
        # BertNormalizer options (llama.cpp reads them for every vocab type; WPM uses them)
        self.normalizer_lowercase: bool = flag("normalizer.lowercase", True)
        self.normalizer_strip_accents: bool = flag("normalizer.strip_accents", self.normalizer_lowercase)

    def _read_special_ids(self, metadata: Mapping[str, Any], defaults: TokenizerDefaults) -> None:
        default_ids = {f.name: getattr(defaults, f.name) for f in fields(defaults) if f.name.endswith("_id")}
        for name in SPECIAL_ID_NAMES:
            value = default_ids.get(name)
            if value is not None and not 0 <= value < self.n_vocab:
                log.warning("vocab: default special token %s = %d out of vocab range, disabling", name, value)
                value = None
            setattr(self, name, value)
        for key_name, attr in _SPECIAL_ID_KEYS:
            key = KEY_PREFIX + key_name
            if key not in metadata:
                continue
            new_id = _as_index(metadata[key], key)
            if 0 <= new_id < self.n_vocab:
                setattr(self, attr, new_id)
            else:
                log.warning("vocab: bad special token %s = %d (vocab has %d tokens), keeping %s",
                            key, new_id, self.n_vocab, getattr(self, attr))
        for flag_name, id_name in (("add_bos", "bos_id"), ("add_eos", "eos_id"), ("add_sep", "sep_id")):
            if getattr(self, flag_name) and getattr(self, id_name) is None:
                raise VocabError(f"{flag_name} is true, but the vocab has no {id_name} "
                                 f"({KEY_PREFIX}{flag_name}_token / the matching *_token_id key)")

    def _force_control(self, token: int) -> None:
        if not self.token_attrs[token] & _CONTROL:
            # llama.cpp warns; it is a converter quirk of many models (Gemma-3's "</s>"), so only log it
            log.info("vocab: control-looking token %d %r was not control-type; overriding its type",
                        token, self.tokens[token])
            self.token_attrs[token] |= _CONTROL

    def _detect_special_tokens_by_text(self) -> None:
        """llama.cpp's text-based detection of EOT / EOM / FIM ids, unused tokens and the end-of-generation set."""
        token_to_id = self.token_to_id
        for name, texts in (("eot_id", _EOT_TEXTS), ("eom_id", _EOM_TEXTS), *_FIM_TEXTS.items()):
            if getattr(self, name) is not None:
                continue
            for text in texts:
                token = token_to_id.get(text)
                if token is not None:
                    setattr(self, name, token)
                    self._force_control(token)
                    break
        for token in np.flatnonzero(np.asarray(self.token_attrs) & _CONTROL).tolist():
            if "unused" in self.tokens[token]:
                self.token_attrs[token] |= _UNUSED
        eog = {t for t in (self.fim_pad_id, self.fim_rep_id, self.fim_sep_id) if t is not None}
        for text in _EOG_TEXTS:
            token = token_to_id.get(text)
            if token is not None:
                eog.add(token)
                self._force_control(token)
        for text in _ALWAYS_RENDERED:
            token = token_to_id.get(text)
            if token is not None:
                self.token_attrs[token] = _USER
        for token in (self.eos_id, self.eot_id, self.eom_id):
            if token is not None:
                eog.add(token)
        self._apply_eog_workarounds(eog)
        self.eog_ids: frozenset[int] = frozenset(eog)

    def _apply_eog_workarounds(self, eog: set[int]) -> None:
        texts = {self.tokens[t]: t for t in eog}
        # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                                   or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            self.token_attrs[texts["<|end|>"]] = _USER
        # gemma4 / paddleocr: "</s>" is text there
        if "<|tool_response>" in texts and "</s>" in texts:
            eog.discard(texts["</s>"])
            self.token_attrs[texts["</s>"]] = _NORMAL

    def _apply_model_specific_attrs(self, metadata: Mapping[str, Any]) -> None:
        """llama.cpp sets lstrip / rstrip for a few model families, recognised by name (GGUF has no such keys)."""
        name = str(metadata.get("general.name", "")).lower()
        arch = str(metadata.get("general.architecture", ""))

        def set_attr(text: str, bit: int, value: bool) -> None:
            token = self.token_to_id.get(text)
            if token is None:
                raise VocabError(f"vocab: {name or arch}: expected token {text!r} is missing")
            self.token_attrs[token] = self.token_attrs[token] | bit if value else self.token_attrs[token] & ~bit

        if any(s in self.pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
                any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            if "<mask>" in self.token_to_id:
                set_attr("<mask>", _LSTRIP, True)
        elif "phi-3" in name or "phi3" in name:
            for token, attr in enumerate(self.token_attrs):
                if attr & _SPECIAL_SPLIT_ATTRS:
                    self.token_attrs[token] = attr | _RSTRIP
            set_attr("</s>", _RSTRIP, True)
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                set_attr(text, _RSTRIP, False)
        elif "modern-bert" in name and "[MASK]" in self.token_to_id:
            set_attr("[MASK]", _LSTRIP, True)

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

    def is_normal(self, token: int) -> bool:
        return bool(self._attr(token) & _NORMAL)

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
        for token, piece in enumerate(cache):
            if piece is None:
                cache[token] = self._render_piece(token)
        if special:
            return list(cache)
        return [b"" if attr & _HIDDEN_ATTRS else piece for attr, piece in zip(self.token_attrs, cache)]

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
    trie: dict = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = True  # end of a text

    def emit(node: dict) -> str:
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
    src, out = bytes(out), bytearray(out[:1])
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
