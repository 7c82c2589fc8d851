"""Reading a vocabulary from GGUF metadata: :class:`VocabLoader` parses and checks the ``tokenizer.ggml.*`` keys
(llama.cpp's ``llama_vocab::impl::load``) into :class:`VocabContents`, from which :class:`.vocab.Vocab`
is built; the ``Vocab`` itself only tokenizes and detokenizes.

What loading does, exactly as llama.cpp: per-family defaults (the tokenizer plugin's
:meth:`~llmfw.core.tokenizer.vocab.Tokenizer.defaults`), then the GGUF keys; special ids out of range are ignored with a
warning; EOT / EOM / FIM ids and the end-of-generation set are completed from well-known token texts; control tokens
whose text contains ``unused`` are marked unused; a few families get llama.cpp's lstrip / rstrip attributes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Mapping, Protocol, Sequence, cast

import numpy as np

from ..errors import PluginError, VocabError
from .tokens import (ATTR_BY_TYPE, ATTR_CONTROL, ATTR_LSTRIP, ATTR_NORMAL, ATTR_RSTRIP, ATTR_UNUSED, ATTR_USER,
                     KEY_PREFIX, SPECIAL_ID_NAMES, SPECIAL_SPLIT_ATTRS, TokenizerDefaults, TokenType)

log = logging.getLogger(__name__)

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
assert set(SPECIAL_ID_NAMES) == {attr for _, attr in _SPECIAL_ID_KEYS}


def _as_list(value: Any, key: str, kind: str) -> Sequence[Any] | np.ndarray:
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


@dataclass(frozen=True)
class VocabFlags:
    """The vocabulary's boolean settings (GGUF keys over the tokenizer family's defaults)."""

    add_space_prefix: bool
    add_bos: bool
    add_eos: bool
    add_sep: bool
    #: detokenize removes spaces before ``?!.,`` and some contractions (llama.cpp's ``clean_spaces``)
    clean_spaces: bool
    normalizer_lowercase: bool
    normalizer_strip_accents: bool


class TokenizerFamily(Protocol):
    """What loading reads of a tokenizer plugin class (the class itself, one module up, is checked by the Vocab)."""

    def defaults(self, pre: str) -> TokenizerDefaults: ...


@dataclass
class VocabContents:
    """Everything a :class:`~llmfw.core.tokenizer.vocab.Vocab` is made of, read and checked by :class:`VocabLoader`."""

    model: str
    pre: str
    #: the registered plugin class; :class:`~llmfw.core.tokenizer.vocab.Vocab` checks it is a ``Tokenizer``
    tokenizer_class: TokenizerFamily
    #: every tokenizer.ggml.* key, for plugins with keys of their own (UGM's precompiled_charsmap ...)
    tokenizer_metadata: dict[str, Any]
    tokens: list[str]
    token_to_id: dict[str, int]
    scores: np.ndarray
    token_types: np.ndarray
    token_attrs: list[int]
    merges: list[str] | None
    flags: VocabFlags
    #: each name of :data:`~llmfw.core.tokenizer.vocab.SPECIAL_ID_NAMES` → its id or None
    special_ids: dict[str, int | None]
    eog_ids: frozenset[int]


class VocabLoader:
    """Parses GGUF metadata into :class:`VocabContents`: ``Vocab(VocabLoader(metadata).contents())`` is the vocab."""

    def __init__(self, metadata: Mapping[str, Any]):
        self.metadata = metadata
        self.special_ids: dict[str, int | None] = {}
        self.eog_ids: frozenset[int] = frozenset()

    def contents(self) -> VocabContents:
        metadata = self.metadata
        model = self._read_model_name(metadata)
        tokenizer_class = self._tokenizer_class(model)
        pre = metadata.get(KEY_PREFIX + "pre", "")
        if not isinstance(pre, str):
            raise VocabError(f"{KEY_PREFIX}pre: expected a string, found {type(pre).__name__} {pre!r}")
        self.pre = pre
        defaults = tokenizer_class.defaults(pre)
        self._read_tokens(metadata)
        merges = self._read_merges(metadata)
        self._read_flags(metadata, defaults)
        self._read_special_ids(metadata, defaults)
        self._detect_special_tokens_by_text()
        self._apply_model_specific_attrs(metadata)
        return VocabContents(
            model=model, pre=pre, tokenizer_class=tokenizer_class,
            tokenizer_metadata={k: v for k, v in metadata.items() if k.startswith(KEY_PREFIX)},
            tokens=self.tokens, token_to_id=self.token_to_id, scores=self.scores, token_types=self.token_types,
            token_attrs=self.token_attrs, merges=merges, flags=self.flags, special_ids=dict(self.special_ids),
            eog_ids=self.eog_ids)

    @staticmethod
    def _read_model_name(metadata: Mapping[str, Any]) -> str:
        model = metadata.get(KEY_PREFIX + "model")
        if model is None:
            raise VocabError(f"{KEY_PREFIX}model is missing: the file has no tokenizer")
        if not isinstance(model, str):
            raise VocabError(f"{KEY_PREFIX}model: expected a string, found {type(model).__name__} {model!r}")
        return model

    @staticmethod
    def _tokenizer_class(model: str) -> TokenizerFamily:
        from ..plugins import registry  # the registry imports plugin modules lazily, by name

        tokenizers = registry("tokenizers")
        if model not in tokenizers:
            known = ", ".join(tokenizers.names()) or "(none)"
            raise VocabError(f"unknown {KEY_PREFIX}model {model!r}; known tokenizers: {known}")
        try:
            cls = tokenizers.get(model)
        except PluginError as exc:
            raise VocabError(f"tokenizer plugin for {model!r} failed to load: {exc}") from exc
        if not (isinstance(cls, type) and callable(getattr(cls, "defaults", None))):
            raise VocabError(f"tokenizer plugin for {model!r} is {cls!r}, "
                             "not a llmfw.core.tokenizer.vocab.Tokenizer subclass")
        return cast(TokenizerFamily, cls)  # a class with ``defaults``: the Vocab checks the rest

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
        self.tokens = tokens
        self.token_to_id = token_to_id
        self.n_vocab = n
        self.scores = self._read_numeric(metadata, "scores", n, np.float32, 0.0)
        self.token_types = self._read_numeric(metadata, "token_type", n, np.int32, TokenType.NORMAL)
        in_range = (self.token_types >= 0) & (self.token_types < len(ATTR_BY_TYPE))
        self.token_attrs = np.where(in_range, ATTR_BY_TYPE[np.where(in_range, self.token_types, 0)],
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

        lowercase = flag("normalizer.lowercase", True)
        self.flags = VocabFlags(
            add_space_prefix=flag("add_space_prefix", defaults.add_space_prefix),
            add_bos=flag("add_bos_token", defaults.add_bos), add_eos=flag("add_eos_token", defaults.add_eos),
            add_sep=flag("add_sep_token", defaults.add_sep), clean_spaces=defaults.clean_spaces,
            # BertNormalizer options (llama.cpp reads them for every vocab type; WPM uses them)
            normalizer_lowercase=lowercase, normalizer_strip_accents=flag("normalizer.strip_accents", lowercase))

    def _read_special_ids(self, metadata: Mapping[str, Any], defaults: TokenizerDefaults) -> None:
        default_ids = {f.name: getattr(defaults, f.name) for f in fields(defaults) if f.name.endswith("_id")}
        for name in SPECIAL_ID_NAMES:
            value = default_ids.get(name)
            if value is not None and not 0 <= value < self.n_vocab:
                log.warning("vocab: default special token %s = %d out of vocab range, disabling", name, value)
                value = None
            self.special_ids[name] = value
        for key_name, attr in _SPECIAL_ID_KEYS:
            key = KEY_PREFIX + key_name
            if key not in metadata:
                continue
            new_id = _as_index(metadata[key], key)
            if 0 <= new_id < self.n_vocab:
                self.special_ids[attr] = new_id
            else:
                log.warning("vocab: bad special token %s = %d (vocab has %d tokens), keeping %s",
                            key, new_id, self.n_vocab, self.special_ids[attr])
        for flag_name, id_name in (("add_bos", "bos_id"), ("add_eos", "eos_id"), ("add_sep", "sep_id")):
            if getattr(self.flags, flag_name) and self.special_ids[id_name] is None:
                raise VocabError(f"{flag_name} is true, but the vocab has no {id_name} "
                                 f"({KEY_PREFIX}{flag_name}_token / the matching *_token_id key)")

    def _force_control(self, token: int) -> None:
        if not self.token_attrs[token] & ATTR_CONTROL:
            # llama.cpp warns; it is a converter quirk of many models (Gemma-3's "</s>"), so only log it
            log.info("vocab: control-looking token %d %r was not control-type; overriding its type",
                        token, self.tokens[token])
            self.token_attrs[token] |= ATTR_CONTROL

    def _detect_special_tokens_by_text(self) -> None:
        """llama.cpp's text-based detection of EOT / EOM / FIM ids, unused tokens and the end-of-generation set."""
        token_to_id = self.token_to_id
        for name, texts in (("eot_id", _EOT_TEXTS), ("eom_id", _EOM_TEXTS), *_FIM_TEXTS.items()):
            if self.special_ids[name] is not None:
                continue
            for text in texts:
                token = token_to_id.get(text)
                if token is not None:
                    self.special_ids[name] = token
                    self._force_control(token)
                    break
        for token in np.flatnonzero(np.asarray(self.token_attrs) & ATTR_CONTROL).tolist():
            if "unused" in self.tokens[token]:
                self.token_attrs[token] |= ATTR_UNUSED
        eog = {t for t in (self.special_ids[n] for n in ("fim_pad_id", "fim_rep_id", "fim_sep_id")) if t is not None}
        for text in _EOG_TEXTS:
            token = token_to_id.get(text)
            if token is not None:
                eog.add(token)
                self._force_control(token)
        for text in _ALWAYS_RENDERED:
            token = token_to_id.get(text)
            if token is not None:
                self.token_attrs[token] = ATTR_USER
        for token in (self.special_ids[n] for n in ("eos_id", "eot_id", "eom_id")):
            if token is not None:
                eog.add(token)
        self._apply_eog_workarounds(eog)
        self.eog_ids = frozenset(eog)

    def _apply_eog_workarounds(self, eog: set[int]) -> None:
        texts = {self.tokens[t]: t for t in eog}
        # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                                   or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            self.token_attrs[texts["<|end|>"]] = ATTR_USER
        # gemma4 / paddleocr: "</s>" is text there
        if "<|tool_response>" in texts and "</s>" in texts:
            eog.discard(texts["</s>"])
            self.token_attrs[texts["</s>"]] = ATTR_NORMAL

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
                set_attr("<mask>", ATTR_LSTRIP, True)
        elif "phi-3" in name or "phi3" in name:
            for token, attr in enumerate(self.token_attrs):
                if attr & SPECIAL_SPLIT_ATTRS:
                    self.token_attrs[token] = attr | ATTR_RSTRIP
            set_attr("</s>", ATTR_RSTRIP, True)
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                set_attr(text, ATTR_RSTRIP, False)
        elif "modern-bert" in name and "[MASK]" in self.token_to_id:
            set_attr("[MASK]", ATTR_LSTRIP, True)
