"""What a vocabulary is made of, below both the loader that reads it and the :class:`~.vocab.Vocab` that uses it:
token types and attribute bits, the special-id names, a tokenizer family's defaults.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, IntFlag

import numpy as np

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


ATTR_OF_TYPE = {
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.BYTE: TokenAttr.BYTE,
}
ATTR_BY_TYPE = np.array([int(ATTR_OF_TYPE.get(TokenType(t), TokenAttr.UNDEFINED)) for t in range(len(TokenType))],
                         dtype=np.int64)  # token type -> attribute bits (unknown types: UNDEFINED)
# plain ints for the hot paths
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL, ATTR_USER, ATTR_BYTE = (int(a) for a in (
    TokenAttr.UNKNOWN, TokenAttr.UNUSED, TokenAttr.NORMAL, TokenAttr.CONTROL, TokenAttr.USER_DEFINED, TokenAttr.BYTE))
ATTR_LSTRIP, ATTR_RSTRIP = int(TokenAttr.LSTRIP), int(TokenAttr.RSTRIP)
SPECIAL_SPLIT_ATTRS = ATTR_CONTROL | ATTR_USER | ATTR_UNKNOWN  # what tokenizer_st_partition may split out
HIDDEN_ATTRS = ATTR_UNKNOWN | ATTR_CONTROL  # rendered only with special=True

#: the special-id attributes of a :class:`Vocab` (``bos_id`` ...), each an id or None
SPECIAL_ID_NAMES = ("bos_id", "eos_id", "eot_id", "eom_id", "unk_id", "sep_id", "pad_id", "mask_id", "fim_pre_id",
                    "fim_suf_id", "fim_mid_id", "fim_pad_id", "fim_rep_id", "fim_sep_id")


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
