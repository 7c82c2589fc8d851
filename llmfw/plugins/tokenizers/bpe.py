"""Byte-level BPE (``tokenizer.ggml.model = "gpt2"``), exactly as llama.cpp's ``llm_tokenizer_bpe``.

Three steps per text fragment:

1. **Pre-tokenization** by the regex list llama.cpp picks for ``tokenizer.ggml.pre``. Each regex splits every
   piece of the previous one further; text between matches becomes a piece too. llama.cpp does not run these
   regexes as written: it replaces every non-ASCII code point by one byte standing for its Unicode category
   (letter, number, punctuation, accent mark, symbol, other; non-ASCII whitespace becomes ``\\v``) and rewrites
   ``\\p{L}`` etc. into classes of those bytes plus their ASCII members (``\\p{S}`` lacks ``~`` there, for
   instance); regexes without ``\\p{..}`` run on the code points with non-ASCII whitespace mapped to ``\\v``.
   ``\\s`` is C's ``isspace`` (ASCII only) and ``$`` is the end of the piece. We do the same with Python's ``re``
   on the same collapsed strings, so the splits are llama.cpp's, quirks included. (llama.cpp's hand-written
   splitters for the GPT-2 and Llama-3 regexes behave like the regexes on the collapsed text.)
2. Each piece's UTF-8 bytes are mapped to the GPT-2 byte alphabet and merged pair by pair: always the adjacent
   pair with the lowest merge rank, the leftmost on ties (llama.cpp's priority queue order). With
   ``ignore_merges`` (llama3, tekken) a piece that is itself a token is taken whole.
3. A final symbol that is not a token falls back to its single bytes that are tokens.

Pieces repeat a lot in real text, so step 2-3 results are cached per piece; that is exact because a piece's ids
depend only on the piece.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter

import regex

from llmfw.plugins.tokenizers.merge import PairCosts, merge_pairs
from llmfw.sdk import Tokenizer, TokenizerDefaults, TokenizerError, Vocab, VocabError


# ----------------------------------------------------------------------------------------------- byte alphabet
def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable character table (llama.cpp's ``unicode_byte_to_utf8``)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR: list[str] = _bytes_to_unicode()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


_BYTE_ALPHABET = {b: c for b, c in enumerate(BYTE_TO_CHAR)}  # for str.translate on latin-1 decoded bytes


def byte_encode(text: str) -> str:
    """``text``'s UTF-8 bytes in the GPT-2 byte alphabet."""
    return text.encode("utf-8", "surrogatepass").decode("latin-1").translate(_BYTE_ALPHABET)


SPM_SPACE = "\u2581"  # what SPM-style vocabularies write for a space

# ----------------------------------------------------------------------------------------------- categories
_TRANSLATION_CACHE_LIMIT = 1 << 16


class _LazyTranslation(dict[int, int]):
    """A ``str.translate`` table filled on first use of each code point (ASCII maps to itself)."""

    def __init__(self, rule: Callable[[str], int]) -> None:
        super().__init__((c, c) for c in range(128))
        self._rule = rule

    def __missing__(self, codepoint: int) -> int:
        value = self._rule(chr(codepoint))
        if len(self) < _TRANSLATION_CACHE_LIMIT:  # text with every code point must not grow it without bound
            self[codepoint] = value
        return value


# llama.cpp's table comes from scripts/gen-unicode-data.py, which classifies with the `regex` module like this.
_CATEGORY_TESTS = tuple((regex.compile(pattern), byte) for pattern, byte in (
    (r"\p{N}", 0xD1), (r"\p{L}", 0xD2), (r"\p{P}", 0xD3), (r"\p{M}", 0xD4), (r"\p{S}", 0xD5)))
_WHITESPACE = regex.compile(r"\s")
_VT = 0x0B  # what llama.cpp turns non-ASCII whitespace into


def _collapse_rule(char: str) -> int:
    if _WHITESPACE.match(char):
        return _VT
    for pattern, byte in _CATEGORY_TESTS:
        if pattern.match(char):
            return byte
    return 0xD0  # separators that are not whitespace, controls, unassigned ...


def _whitespace_rule(char: str) -> int:
    return _VT if _WHITESPACE.match(char) else ord(char)


COLLAPSE = _LazyTranslation(_collapse_rule)  # for regexes that use \p{..}
WIDE = _LazyTranslation(_whitespace_rule)  # for the others

# The classes llama.cpp substitutes for \p{..} on collapsed text (its k_ucat_cpt byte + k_ucat_map ASCII members).
_CATEGORY_CLASS = {
    "N": r"\xd10-9",
    "L": r"\xd2A-Za-z",
    "P": r"\xd3\x21-\x23\x25-\x2a\x2c-\x2f\x3a-\x3b\x3f-\x40\x5b-\x5d\x5f\x7b\x7d",
    "M": r"\xd4",
    "S": r"\xd5\x24\x2b\x3c-\x3e\x5e\x60\x7c",
}
for _sub in ("Lu", "Ll", "Lt", "Lm", "Lo"):  # llama.cpp maps every letter subcategory to "letter"
    _CATEGORY_CLASS[_sub] = _CATEGORY_CLASS["L"]
_SPACE_CLASS = r"\t\n\x0b\x0c\r "  # std::regex \s in the C locale


def translate_regex(expr: str) -> tuple[str, bool]:
    """A llama.cpp pre-tokenizer regex as a Python ``re`` pattern; and whether it runs on collapsed text."""
    collapsed = "\\p{" in expr
    out: list[str] = []
    inside = False  # within [...]
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "\\" and i + 1 < len(expr):
            nxt = expr[i + 1]
            if nxt == "p" and expr.startswith("{", i + 2):
                end = expr.index("}", i)
                try:
                    members = _CATEGORY_CLASS[expr[i + 3:end]]
                except KeyError:
                    raise VocabError(f"pre-tokenizer regex uses unsupported category {expr[i:end + 1]!r}") from None
                out.append(members if inside else f"[{members}]")
                i = end + 1
                continue
            if nxt in "sd":
                members = _SPACE_CLASS if nxt == "s" else "0-9"
                out.append(members if inside else f"[{members}]")
            elif nxt == "S":
                if inside:
                    raise VocabError(f"pre-tokenizer regex {expr!r}: \\S inside a class is not supported")
                out.append(f"[^{_SPACE_CLASS}]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "(" and not inside and not expr.startswith("?", i + 1):
            c = "(?:"  # no capture groups: RegexSplitter captures the whole match (no regex here uses backrefs)
        elif c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            c = r"\Z"  # ECMAScript $ without multiline: only the end of the piece (Python's $ also before "\n")
        out.append(c)
        i += 1
    return "".join(out), collapsed


# ----------------------------------------------------------------------------------------------- pre-tokenizers
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_UPPER_THEN_LOWER = r"((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_UPPER_RUN = r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?" + _UPPER_THEN_LOWER + r"|[^\r\n\p{L}\p{N}]?" + _UPPER_RUN
           + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?" + _UPPER_THEN_LOWER + _CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?" + _UPPER_RUN
          + _CONTRACTIONS + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # 一-龥, ࠀ-一, 가-퟿
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"  # ASCII, full-width, quotes, 　、。
_DEEPSEEK_LETTERS = (  # upper/lower/title-case letters; escaped, as some of them change under NFC
    "\\s?["
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-"
    "\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-"
    "\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-"
    "\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc"
    "\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-"
    "\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-"
    "\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-"
    "\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-"
    "\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-"
    "\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
    "\U000118df\U0001e900-\U0001e943"
    "]+"
)


_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s{1}")
_ASCII_PUNCT_WORD = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"  # \" is " to the regex
_KANA_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"  # 一-龥, hiragana, katakana
_DEEPSEEK3 = (_ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
_SPARK = _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"
_CASED_WORDS = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS
                + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?")
_YOUTU = ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
          "\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _KANA_CJK,
          _CASED_WORDS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"  # … 。 ， 、 । ۔ ،
_CHATGLM4 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
               r"|\s*[\r\n]|\s+(?!\S)|\s+")
_CHAMELEON = ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", r"\p{N}",
              r"[\p{P}!-/:-@\[-`{-~]", _GPT2)
_GRANITE_MULTI = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTRACTIONS
                  + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTRACTIONS
                  + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BAILING = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]|\s+(?!\S)|\s+")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_MINICPM5 = (r"\p{N}{1,3}",
             _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LINES = "[^\\n]+|[\\n]+"


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer type: its regexes and the vocab flags it sets."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    add_sep: bool = False
    #: BPE's default BOS / EOS id 11 (chatglm / glm4 clear the BOS default)
    default_bos: bool = True
    #: pieces in the GPT-2 byte alphabet (False: SPM-style BPE on raw UTF-8 with <0xNN> byte tokens, Gemma 4)
    byte_encode: bool = True
    #: spaces become U+2581 before splitting (llama.cpp's escape_whitespaces, SPM-style BPE)
    escape_whitespace: bool = False
    #: a piece of newlines only that is a token is taken whole (llama.cpp's Gemma 4 fix)
    newline_pieces_whole: bool = False


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_DEEPSEEK3_TYPE = PreTokenizer((r"\p{N}{1,3}", _KANA_CJK, _DEEPSEEK3), clean_spaces=False)
_TYPES = {
    "default": _DEFAULT,
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama3-regex": PreTokenizer((_LLAMA3,)),  # dbrx, smaug-bpe: same regex, no flags
    "deepseek-llm": PreTokenizer(("[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, "\\s+$", _CJK, r"\p{N}+"),
                                 clean_spaces=False),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), clean_spaces=False),
    "deepseek-v3": _DEEPSEEK3_TYPE,
    "spark2_5": PreTokenizer((r"\p{N}{1,3}", _KANA_CJK, _SPARK, r"\p{N}"), clean_spaces=False),
    "youtu": PreTokenizer(_YOUTU, clean_spaces=False, ignore_merges=True),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "starcoder": PreTokenizer((r"\p{N}", _GPT2)),
    "starcoder-noclean": PreTokenizer((r"\p{N}", _GPT2), clean_spaces=False),
    "gpt2": PreTokenizer((_GPT2,)),
    "gpt2-noclean": PreTokenizer((_GPT2,), clean_spaces=False),
    "gpt2-sep": PreTokenizer((_GPT2,), add_sep=True),
    "jais2": PreTokenizer((_JAIS2,)),
    "gemma4": PreTokenizer((_LINES,), byte_encode=False, escape_whitespace=True, newline_pieces_whole=True,
                           add_bos=True),
    "sarvam-moe": PreTokenizer((_LINES,), clean_spaces=False, byte_encode=False, escape_whitespace=True),
    "qwen2": PreTokenizer((_QWEN2,), clean_spaces=False),
    "qwen2-clean": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,), clean_spaces=False),
    "bloom": PreTokenizer((_BLOOM,)),
    "poro": PreTokenizer((_BLOOM,), clean_spaces=False),
    "viking": PreTokenizer((_BLOOM, r"\p{N}"), clean_spaces=False),
    "chatglm4": PreTokenizer((_CHATGLM4,), default_bos=False),
    "glm4": PreTokenizer((_CHATGLM4,), default_bos=False, ignore_merges=True),
    "tekken": PreTokenizer((_TEKKEN,), clean_spaces=False, ignore_merges=True, add_bos=True),
    "exaone-moe": PreTokenizer((_EXAONE_MOE,)),
    "chameleon": PreTokenizer(_CHAMELEON, clean_spaces=False, add_bos=True),
    "gpt4o": PreTokenizer((_GPT4O,), clean_spaces=False),
    "granite-multi": PreTokenizer((_GRANITE_MULTI,), clean_spaces=False, ignore_merges=True),
    "bailingmoe": PreTokenizer((_BAILING,), clean_spaces=False),
    "seed-coder": PreTokenizer((_SEED_CODER,), clean_spaces=False),
    "ufakzeka": PreTokenizer((_UFAKZEKA,), clean_spaces=False),
    "grok-2": PreTokenizer((_QWEN2,), clean_spaces=False),
    "laguna": PreTokenizer((_LINES, _QWEN2), clean_spaces=False),
    "minicpm5": PreTokenizer(_MINICPM5, ignore_merges=True),
}
#: ``tokenizer.ggml.pre`` value -> pre-tokenizer type, as llama.cpp's ``llama_vocab::impl::load`` maps them.
#: Not supported (llama.cpp runs hand-written splitters or other tokenizer sessions for them): kimi-k2, afmoe,
#: tiny_aya, cohere2moe, superbpe, whitespace.
PRE_TYPES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe"), "llama3-regex"),
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), "deepseek-v3"),
    "spark2_5": "spark2_5",
    "youtu": "youtu",
    "falcon": "falcon",
    **dict.fromkeys(("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"), "starcoder"),
    **dict.fromkeys(("smollm", "command-r"), "starcoder-noclean"),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4"), "gpt2"),
    **dict.fromkeys(("jina-v1-en", "jina-v2-code", "roberta-bpe"), "gpt2-sep"),
    "jais-2": "jais2",
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m"), "gemma4"),
    "sarvam-moe": "sarvam-moe",
    **dict.fromkeys(("trillion", "granite-docling"), "gpt2-noclean"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open"), "qwen2"),
    "qwen35": "qwen35",
    **dict.fromkeys(("stablelm2", "megrez"), "qwen2-clean"),
    "bloom": "bloom",
    "gpt3-finnish": "bloom",
    "poro-chat": "poro",
    "viking": "viking",
    "chatglm-bpe": "chatglm4",
    **dict.fromkeys(("glm4", "glm5"), "glm4"),
    "tekken": "tekken",
    "exaone-moe": "exaone-moe",
    "chameleon": "chameleon",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o"),
    "granite-embed-multi-97m": "granite-multi",
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe"),
    "seed-coder": "seed-coder",
    "ufakzeka": "ufakzeka",
    "grok-2": "grok-2",
    "laguna": "laguna",
    "minicpm5": "minicpm5",
}


def pre_tokenizer_for(pre: str) -> PreTokenizer:
    """The pre-tokenizer for a ``tokenizer.ggml.pre`` value; unknown or missing -> ``default`` with a warning."""
    name = PRE_TYPES.get(pre)
    if name is None:
        what = "missing pre-tokenizer type" if not pre else f"unknown pre-tokenizer type {pre!r}"
        message = (f"{what}, using 'default' (llama.cpp's fallback); tokenization may differ from the model's "
                   f"own. Known: {', '.join(sorted(PRE_TYPES))}")
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        name = "default"
    return _TYPES[name]


class RegexSplitter:
    """Splits text into pre-tokenizer pieces the way llama.cpp's ``unicode_regex_split`` does: each regex splits
    every piece of the previous step into its matches and the text between them."""

    def __init__(self, regexes: tuple[str, ...]):
        self._steps: list[tuple[re.Pattern[str], bool]] = []
        for expr in regexes:
            pattern, collapsed = translate_regex(expr)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # "possible nested set" on a literal '['
                # one capture group around everything: re.split then returns gaps and matches alternately
                self._steps.append((re.compile(f"({pattern})"), collapsed))
        self._needs_collapsed = any(c for _, c in self._steps)
        self._needs_wide = not all(c for _, c in self._steps)

    def split(self, text: str) -> list[str]:
        collapsed = text.translate(COLLAPSE) if self._needs_collapsed else text
        wide = text.translate(WIDE) if self._needs_wide else text
        spans = [(0, len(text))]
        for pattern, use_collapsed in self._steps:
            subject = collapsed if use_collapsed else wide
            split = pattern.split
            new_spans: list[tuple[int, int]] = []
            add = new_spans.append
            for start, end in spans:
                pos = start
                # the collapsed and wide strings have the same length as the text, so lengths give positions
                for part in split(subject[start:end] if end - start < len(subject) else subject):
                    if part:  # empty gaps (and empty matches, which llama.cpp turns into no tokens) vanish
                        add((pos, pos + len(part)))
                        pos += len(part)
            spans = new_spans
        return [text[s:e] for s, e in spans]


# ----------------------------------------------------------------------------------------------- the tokenizer
_NO_RANK = 1 << 62


class BPETokenizer(Tokenizer):
    """llama.cpp's byte-level BPE tokenizer; see the module docstring."""

    @classmethod
    def pre_tokenizer(cls, pre: str, warn: bool = True) -> PreTokenizer:
        """The pre-tokenizer for the file's ``tokenizer.ggml.pre`` value ``pre``."""
        return pre_tokenizer_for(pre) if warn or pre in PRE_TYPES else _DEFAULT

    @classmethod
    def defaults(cls, pre: str) -> TokenizerDefaults:
        pre_tok = cls.pre_tokenizer(pre, warn=False)
        bos_eos = 11 if pre_tok.default_bos else None
        return TokenizerDefaults(bos_id=bos_eos, eos_id=11, add_bos=pre_tok.add_bos, add_sep=pre_tok.add_sep,
                                 clean_spaces=pre_tok.clean_spaces)

    def __init__(self, vocab: Vocab):
        super().__init__(vocab)
        if vocab.merges is None:
            raise VocabError("tokenizer.ggml.merges is missing: a BPE vocabulary needs its merges")
        self.pre = self.pre_tokenizer(vocab.pre)
        self.splitter = RegexSplitter(self.pre.regexes)
        self.ranks = self._build_ranks(vocab.merges)
        self.pair_costs = PairCosts(self.ranks, joined=False, none=_NO_RANK)
        self.token_to_id = vocab.token_to_id
        self._encode = byte_encode if self.pre.byte_encode else str

    @staticmethod
    def _build_ranks(merges: list[str]) -> dict[tuple[str, str], int]:
        """(left, right) -> rank. llama.cpp splits "left right" at the first space after the first character (a
        merge without one becomes ("", "")), and the first rank of a repeated pair wins (std::map::emplace)."""
        # the common case loops in C (map): split at the first space, which is llama.cpp's cut unless a merge
        # starts with a space (empty left part) or has none (one part)
        pairs = list(map(tuple, map(str.split, merges, repeat(" "), repeat(1))))
        if min(map(len, pairs), default=2) == 2 and all(map(itemgetter(0), pairs)):
            # built from the end, so that the first rank of a repeated pair is the one that stays
            return dict(zip(reversed(pairs), range(len(pairs) - 1, -1, -1)))  # type: ignore[arg-type]
        ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            cut = merge.find(" ", 1)
            ranks.setdefault((merge[:cut], merge[cut + 1:]) if cut >= 0 else ("", ""), rank)
        return ranks

    def tokenize(self, text: str) -> list[int]:
        if self.pre.escape_whitespace:
            text = text.replace(" ", SPM_SPACE)
        return self.encode_words(self.splitter.split(text))

    def encode_word(self, word: str) -> list[int]:
        encoded = self._encode(word)
        if self.pre.ignore_merges or (self.pre.newline_pieces_whole and not word.strip("\n")):
            token = self.token_to_id.get(encoded)
            if token is not None:
                return [token]
        symbols = merge_pairs(encoded, self.pair_costs)
        return self._symbols_to_ids(symbols)

    def _symbols_to_ids(self, symbols: list[str]) -> list[int]:
        token_to_id = self.token_to_id
        ids: list[int] = []
        for symbol in symbols:
            token = token_to_id.get(symbol)
            if token is not None:
                ids.append(token)
                continue
            # llama.cpp falls back to the symbol's single UTF-8 bytes that happen to be tokens (<0xNN> tokens
            # without the byte alphabet)
            for byte in symbol.encode("utf-8", "surrogatepass"):
                token = token_to_id.get(self._single_byte_text(byte))
                if token is not None:
                    ids.append(token)
        return ids

    def _single_byte_text(self, byte: int) -> str:
        if not self.pre.byte_encode:
            return f"<0x{byte:02X}>"
        return chr(byte) if byte < 0x80 else chr(0xDC00 + byte)

    def normal_piece(self, text: str) -> bytes:
        if self.pre.escape_whitespace:
            return text.replace(SPM_SPACE, " ").encode("utf-8", "surrogatepass")
        try:
            return bytes([CHAR_TO_BYTE[c] for c in text])
        except KeyError:
            pass
        out = bytearray()
        for c in text:  # llama.cpp's llama_decode_text keeps unknown characters in a visible marker
            byte = CHAR_TO_BYTE.get(c)
            if byte is not None:
                out.append(byte)
            else:
                utf8 = c.encode("utf-8", "surrogatepass")
                out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8", "surrogatepass") + b"]"
        return bytes(out)

    def byte_to_token(self, byte: int) -> int:
        text = BYTE_TO_CHAR[byte] if self.pre.byte_encode else f"<0x{byte:02X}>"
        token = self.token_to_id.get(text)
        if token is None:
            raise TokenizerError(f"the BPE vocab has no token for byte 0x{byte:02X} ({text!r})")
        return token


class Gemma4Tokenizer(BPETokenizer):
    """``tokenizer.ggml.model = "gemma4"``: llama.cpp's SPM-style BPE (spaces as U+2581, raw UTF-8 merges, <0xNN>
    byte fallback), whatever ``tokenizer.ggml.pre`` says; llama.cpp also always adds BOS for it."""

    @classmethod
    def pre_tokenizer(cls, pre: str, warn: bool = True) -> PreTokenizer:
        return _TYPES["gemma4"]

    @classmethod
    def defaults(cls, pre: str) -> TokenizerDefaults:
        return dataclasses.replace(super().defaults(pre), bos_id=None, eos_id=None)

    def __init__(self, vocab: Vocab):
        super().__init__(vocab)
        if vocab.bos_id is not None:
            vocab.add_bos = True  # llama.cpp overrides add_bos_token = false for Gemma 4 (its PR 21500)
