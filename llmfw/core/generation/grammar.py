"""Constrained decoding on llguidance: grammar sources, their compilation, the vocabulary bridge and the matcher.

* :class:`GrammarSpec` is what the ``grammar`` sampler is given: a GBNF grammar (llama.cpp's syntax, converted
  to Lark by llguidance's converter), a Lark grammar (llguidance's dialect: it starts with ``%llguidance`` or has
  a ``start:`` rule), a regular expression, or a JSON schema (``{}`` / ``True`` = any JSON value,
  ``{"type": "object"}`` = any JSON object). :meth:`GrammarSpec.compile` checks it and returns llguidance's
  grammar; every failure is a :class:`GrammarError` with the line and column when the source has one.
* Input is bounded before it reaches the engine: sources over :data:`MAX_GRAMMAR_CHARS`, JSON nested deeper than
  :data:`MAX_SCHEMA_DEPTH` and GBNF nested deeper than Python's recursion limit are refused (a deeply nested
  schema *object* would overflow the native stack when handed over as a dict, so schemas always cross as text).
* JSON output keeps whitespace bounded: where JSON allows whitespace the schema grammar allows llama.cpp's
  ``space`` rule only (nothing, one space, or one or two newlines and up to 20 spaces / tabs), so an output's
  length is bounded by its schema, not by the model's appetite for spaces.
* :func:`grammar_tokenizer` bridges a :class:`~llmfw.core.tokenizer.vocab.Vocab` to llguidance: each token as the exact
  bytes it produces (the tokenizer's own ``normal_piece``: byte-level BPE's byte map, SPM's ``▁`` and
  ``<0xNN>`` byte fallback), control / unknown tokens marked special (llguidance's ``0xFF`` prefix, as llama.cpp
  does), every end-of-generation token an EOS. It is built once per vocab and kept in ``vocab.derived``.
* :class:`GrammarMatcher` wraps one ``LLMatcher``: the allowed-token mask as a boolean array, consuming tokens,
  and the time spent computing masks (for ``llmfw bench``).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..errors import GrammarError
from .schema_closed import closed_schema

if TYPE_CHECKING:
    from ..tokenizer.vocab import Vocab

#: the longest grammar / schema / regex source accepted, in characters
MAX_GRAMMAR_CHARS = 256 * 1024
#: the deepest nesting of arrays / objects accepted in a JSON schema
MAX_SCHEMA_DEPTH = 128
#: where JSON allows whitespace: llama.cpp's json-schema-to-grammar ``space`` rule (bounded)
JSON_WHITESPACE = r"(\x20|\n{1,2}[ \t]{0,20})?"
#: any JSON object (``--json``, ``response_format: {"type": "json_object"}``)
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}

GrammarKind = Literal["gbnf", "lark", "regex", "json_schema"]
_VOCAB_CACHE_KEY = "grammar_tokenizer"
_SPECIAL_PREFIX = b"\xff"  # llguidance's marker of a special token


def _llguidance() -> Any:
    import llguidance

    return llguidance


# ---------------------------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: its kind and its source text (for a JSON schema: the schema as JSON text)."""

    kind: GrammarKind
    text: str

    @classmethod
    def from_grammar(cls, text: str) -> "GrammarSpec":
        """GBNF or Lark, told apart as llguidance does (Lark has ``%llguidance`` or a ``start:`` rule)."""
        from llguidance.gbnf_to_lark import is_lark_syntax

        _check_text(text, "grammar")
        return cls("lark" if is_lark_syntax(text) else "gbnf", text)

    @classmethod
    def from_regex(cls, pattern: str) -> "GrammarSpec":
        _check_text(pattern, "regex")
        return cls("regex", pattern)

    @classmethod
    def from_json_schema(cls, schema: str | dict[str, Any] | bool) -> "GrammarSpec":
        """A schema given as JSON text, a mapping, or ``True`` (any JSON value)."""
        return cls("json_schema", schema_text(schema))

    def compile(self) -> str:
        """llguidance's grammar for this source; a :class:`GrammarError` if it is invalid or unsatisfiable."""
        if self.kind == "json_schema":
            try:
                grammar = _llguidance().LLMatcher.grammar_from_json_schema(
                    self.text, defaults={"whitespace_pattern": JSON_WHITESPACE})
            except ValueError as exc:
                raise GrammarError(f"invalid JSON schema: {exc}") from None
            return _validated(grammar, self)
        if self.kind == "regex":
            return _validated(_llguidance().LLMatcher.grammar_from_regex(self.text), self)
        lark = self.text if self.kind == "lark" else gbnf_to_lark(self.text)
        return _validated(_llguidance().LLMatcher.grammar_from_lark(lark), self, lark)

    def describe(self) -> str:
        """``kind: first line...`` for logs and ``--verbose``."""
        lines = self.text.strip().splitlines() or [""]
        more = "..." if len(lines) > 1 or len(lines[0]) > 60 else ""
        return f"{self.kind}: {lines[0][:60]}{more}"


def grammar_spec(grammar: str | None = None, json_schema: str | dict[str, Any] | bool | None = None,
                 regex: str | None = None) -> GrammarSpec | None:
    """The one constraint given (None when none is); more than one is an error."""
    given = [name for name, value in (("grammar", grammar), ("json_schema", json_schema), ("regex", regex))
             if value is not None]
    if len(given) > 1:
        raise GrammarError(f"give one of grammar, json_schema and regex, not {' and '.join(given)}")
    if grammar is not None:
        return GrammarSpec.from_grammar(grammar)
    if regex is not None:
        return GrammarSpec.from_regex(regex)
    if json_schema is not None:
        return GrammarSpec.from_json_schema(json_schema)
    return None


def _check_text(text: Any, what: str) -> None:
    if not isinstance(text, str):
        raise GrammarError(f"the {what} must be text, got {type(text).__name__}")
    if not text.strip():
        raise GrammarError(f"the {what} is empty")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the {what} is {len(text):,} characters long; the limit is {MAX_GRAMMAR_CHARS:,}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GrammarError(f"the {what} is not valid Unicode text (a lone surrogate at character {exc.start})",
                           *line_and_column(text, exc.start)) from None


def schema_text(schema: str | dict[str, Any] | bool) -> str:
    """A JSON schema as compact JSON text, checked for size and nesting (never handed over as a deep dict)."""
    if schema is True:
        return "{}"  # the schema every JSON value matches
    if schema is False:
        raise GrammarError("the JSON schema false can never match: no value satisfies it")
    if isinstance(schema, str):
        _check_text(schema, "JSON schema")
        try:
            value = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc.msg}", exc.lineno, exc.colno) from None
        except RecursionError:
            raise GrammarError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep") from None
    elif isinstance(schema, dict):
        value = schema
    else:
        raise GrammarError(f"a JSON schema is an object (or true), got {type(schema).__name__}")
    if isinstance(value, bool):
        return schema_text(value)
    if not isinstance(value, dict):
        raise GrammarError(f"a JSON schema is an object (or true), got a JSON {type(value).__name__}")
    depth = json_depth(value)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the JSON schema is nested {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    value = closed_schema(value)  # llama.cpp's reading: listed properties and no others
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"the JSON schema cannot be written as JSON: {exc}") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the JSON schema is {len(text):,} characters long; the limit is {MAX_GRAMMAR_CHARS:,}")
    return text


def json_depth(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """Nesting depth of lists / dicts, counted without recursion; stops counting past ``limit``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest


# ---------------------------------------------------------------------------------------------------------------
# GBNF → Lark, with errors placed in the GBNF source
# ---------------------------------------------------------------------------------------------------------------
def gbnf_to_lark(text: str) -> str:
    """llguidance's GBNF converter, with its rule-terminality fixpoint computed in linear time first (its own
    loop takes one pass per link of a chain of rules: quadratic, minutes for a long generated grammar)."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, GrammarParser, resolve

    try:
        rules = GrammarParser().parse(text)
        _mark_terminal_rules(rules)
        resolve(rules)
    except GbnfToLarkError as exc:
        line, column = line_and_column(text, exc.pos.pos)
        raise GrammarError(f"GBNF: {str(exc).split(' at line ')[0]}", line, column) from None
    except RecursionError:
        raise GrammarError("GBNF: the grammar is nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - the converter raises bare Exceptions for unknown / missing / duplicate rules
        raise _placed_gbnf_error(text, str(exc)) from None
    return _render_lark(sorted(rules.values(), key=lambda r: r.order))


def _render_lark(rules: list[Any]) -> str:
    """The rules as Lark text, laid out as llguidance's ``gbnf_to_lark`` lays them out."""
    out = ["%llguidance {}\n\n"]
    after_block = True
    for rule in rules:
        text = str(rule)
        if not after_block and "\n" in text:
            out.append("\n")
        out.append(text + "\n")
        after_block = "\n" in text
        if after_block:
            out.append("\n")
    return "".join(out)


def _mark_terminal_rules(rules: dict[str, Any]) -> None:
    """Set ``rule_is_terminal`` to the converter's fixpoint (a rule other than the root is terminal when every
    rule it refers to is), propagated backwards from the rules that refer to none: linear time."""
    from llguidance.gbnf_to_lark import RuleRefNode

    refs: dict[str, set[str]] = {}
    for name, rule in rules.items():
        found, stack = set(), [rule.alternatives]
        while stack:
            node = stack.pop()
            if isinstance(node, RuleRefNode):
                found.add(node.name)
            stack.extend(node.children())
        refs[name] = found
    users: dict[str, list[str]] = {name: [] for name in rules}
    for name, targets in refs.items():
        for target in targets:
            if target in users:
                users[target].append(name)
    waiting = {name: len(targets) for name, targets in refs.items()}
    ready = [name for name, count in waiting.items() if count == 0 and name != "root"]
    while ready:
        name = ready.pop()
        rules[name].rule_is_terminal = True
        for user in users[name]:
            waiting[user] -= 1
            if waiting[user] == 0 and user != "root" and refs[user] <= rules.keys():
                ready.append(user)


def _placed_gbnf_error(text: str, message: str) -> GrammarError:
    """The converter's message, with the place of the rule it names."""
    missing = re.match(r"Rule '([^']+)' not found", message)
    if missing:
        hit = re.search(rf"(?<![\w-]){re.escape(missing.group(1))}(?![\w-])(?!\s*::=)", text)
        if hit:
            return GrammarError(f"GBNF: rule '{missing.group(1)}' is used but never defined",
                                *line_and_column(text, hit.start()))
    if message.startswith("No 'root' rule"):
        return GrammarError("GBNF: the grammar has no 'root' rule (where generation starts)", 1, 1)
    return GrammarError(f"GBNF: {message}")


def line_and_column(text: str, offset: int) -> tuple[int, int]:
    """1-based line and column of a character offset."""
    offset = max(0, min(offset, len(text)))
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


_ENGINE_PLACE = re.compile(r"^(?:at )?(\d+)\((\d+)\):\s*")


def _validated(grammar: str, spec: GrammarSpec, lark: str | None = None) -> str:
    """Run llguidance's checks; its first error becomes a GrammarError (placed in the source when it can be)."""
    try:
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    except RecursionError:
        raise GrammarError(f"the {spec.kind} is nested too deeply") from None
    if not is_error:
        return grammar
    message = messages[0] if messages else "invalid grammar"
    first = message.strip().splitlines()[0] if message.strip() else message
    line = column = None
    place = _ENGINE_PLACE.match(first)
    if place:
        line, column = int(place.group(1)), int(place.group(2))
        first = first[place.end():]
    reason = _regex_reason(message)
    if reason:
        first = f"{first.rstrip(': ')}: {reason}" if spec.kind != "regex" else reason
    if spec.kind == "regex":
        line = column = None  # the engine places it in its own one-line wrapper, not in the pattern
    elif spec.kind == "gbnf" and line is not None and lark is not None:
        line, column = _gbnf_line_of_lark_line(spec.text, lark, line), None
    if "nsatisfiable" in message:
        raise GrammarError(f"the {_KIND_NAMES[spec.kind]} can never match: {first}", line, column)
    raise GrammarError(f"invalid {_KIND_NAMES[spec.kind]}: {first}", line, column)


_KIND_NAMES = {"gbnf": "GBNF grammar", "lark": "Lark grammar", "regex": "regex", "json_schema": "JSON schema"}


def _regex_reason(message: str) -> str | None:
    reason = re.search(r"^error: (.+)$", message, re.MULTILINE)
    return f"{reason.group(1)}" if reason else None


def _gbnf_line_of_lark_line(gbnf: str, lark: str, lark_line: int) -> int | None:
    """The GBNF line defining the rule that the converted grammar's line ``lark_line`` belongs to."""
    lines = lark.splitlines()
    for index in range(min(lark_line, len(lines)) - 1, -1, -1):
        rule = re.match(r"^([A-Za-z_][\w]*)\s*:", lines[index])
        if rule:
            wanted = rule.group(1).lower()
            for number, text in enumerate(gbnf.splitlines(), 1):
                defined = re.match(r"^\s*([\w-]+)\s*::=", text)
                if defined and _lark_name(defined.group(1)) == wanted:
                    return number
            return None
    return None


def _lark_name(gbnf_name: str) -> str:
    if gbnf_name == "root":
        return "start"
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", gbnf_name.replace("-", "_")).lower()


# ---------------------------------------------------------------------------------------------------------------
# the vocabulary bridge
# ---------------------------------------------------------------------------------------------------------------
class _VocabTokenizer:
    """What llguidance's TokenizerWrapper reads: the token bytes, EOS / BOS and a tokenize callback."""

    def __init__(self, vocab: Vocab):
        self._vocab = vocab
        self.tokens = token_bytes(vocab)
        self.eos_token_id = _first_eog(vocab)
        self.bos_token_id = vocab.bos_id
        self.special_token_ids = [t for t, piece in enumerate(self.tokens) if piece.startswith(_SPECIAL_PREFIX)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return list(self._vocab.tokenize(text, add_special=False, parse_special=False))


def _first_eog(vocab: Vocab) -> int:
    for candidate in (vocab.eot_id, vocab.eos_id):
        if candidate is not None:
            return int(candidate)
    if vocab.eog_ids:
        return int(min(vocab.eog_ids))
    raise GrammarError("the model's vocabulary has no end-of-generation token, so a grammar could never end")


def token_bytes(vocab: Vocab) -> list[bytes]:
    """Every token as the bytes it produces; control and unknown tokens as ``0xFF`` + their text (special)."""
    from ..tokenizer.vocab import TokenAttr

    pieces = vocab.all_pieces(special=True)
    attrs = np.asarray(vocab.token_attrs, dtype=np.int64)
    hidden = (attrs & int(TokenAttr.CONTROL | TokenAttr.UNKNOWN)) != 0
    user = (attrs & int(TokenAttr.USER_DEFINED)) != 0
    return [_SPECIAL_PREFIX + piece if piece and (hidden[t] or user[t] and _looks_like_control(piece)) else piece
            for t, piece in enumerate(pieces)]


def _looks_like_control(piece: bytes) -> bool:
    # like llama.cpp's llguidance bridge: a user-defined token written <like_this> is special too
    return len(piece) > 2 and piece.startswith(b"<") and piece.endswith(b">")


def grammar_tokenizer(vocab: Vocab) -> Any:
    """The llguidance tokenizer for ``vocab``: built on first use (it takes a while for a large
    vocabulary), then kept in ``vocab.derived``."""
    cache = getattr(vocab, "derived", None)
    if cache is not None and _VOCAB_CACHE_KEY in cache:
        return cache[_VOCAB_CACHE_KEY]
    llg = _llguidance()
    wrapper = llg.TokenizerWrapper(_VocabTokenizer(vocab))
    tokenizer = llg.LLTokenizer(wrapper, n_vocab=vocab.n_vocab, eos_token=sorted(int(t) for t in vocab.eog_ids)
                                or None)
    if cache is not None:
        cache[_VOCAB_CACHE_KEY] = tokenizer
    return tokenizer


# ---------------------------------------------------------------------------------------------------------------
# the matcher
# ---------------------------------------------------------------------------------------------------------------
class GrammarMatcher:
    """One grammar's state over a generation: which tokens may come next, and the tokens consumed so far."""

    def __init__(self, spec: GrammarSpec, vocab: Vocab, compiled: str | None = None):
        self.spec = spec
        self.vocab = vocab
        self.tokenizer = grammar_tokenizer(vocab)
        start = time.perf_counter()
        llg = _llguidance()
        self._matcher = llg.LLMatcher(self.tokenizer, compiled or spec.compile(), log_level=0,
                                      limits=llg.LLParserLimits(verbose_errors=False))
        self.compile_s = time.perf_counter() - start
        self.n_consumed = 0
        self._raise_if_error()
        self.mask_s = 0.0
        self.n_masks = 0
        if not self.allowed().any() and not self._matcher.is_accepting():
            raise GrammarError(f"the {_KIND_NAMES[spec.kind]} can never match: no token of this model can start it")

    def _raise_if_error(self) -> None:
        if not self._matcher.is_error():
            return
        message = self._matcher.get_error().strip().split("<state>")[0].strip().splitlines()
        reason = message[0] if message else "error"
        if self.n_consumed == 0 and reason.startswith("NoExtension"):
            raise GrammarError(f"the {_KIND_NAMES[self.spec.kind]} can never match: no text satisfies it")
        raise GrammarError(f"{_KIND_NAMES[self.spec.kind]}: {reason}")

    def allowed(self) -> np.ndarray:
        """A boolean array over the vocabulary: True for every token the grammar accepts next (end-of-generation
        tokens only where the grammar may end)."""
        start = time.perf_counter()
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:self.vocab.n_vocab].view(np.bool_)
        self.mask_s += time.perf_counter() - start
        self.n_masks += 1
        self._raise_if_error()
        return mask

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            message = self._matcher.get_error().strip() or "token not allowed"
            raise GrammarError(f"token {int(token)} does not fit the {_KIND_NAMES[self.spec.kind]}: {message}")
        self.n_consumed += 1

    def reset(self) -> None:
        self._matcher.reset()
        self.n_consumed = 0

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete match (the grammar may end here)."""
        return bool(self._matcher.is_accepting())

    @property
    def is_stopped(self) -> bool:
        """Nothing can follow: the grammar is complete (or ended with an end-of-generation token)."""
        return bool(self._matcher.is_stopped())

    @property
    def mask_ms_per_token(self) -> float:
        return 1000.0 * self.mask_s / self.n_masks if self.n_masks else 0.0


def check_text_matches(spec: GrammarSpec, vocab: Vocab, text: str) -> bool:
    """True when ``text`` is a complete match of ``spec`` (a fresh matcher fed the text's tokens)."""
    matcher = _llguidance().LLMatcher(grammar_tokenizer(vocab), spec.compile(), log_level=0)
    tokens = grammar_tokenizer(vocab).tokenize_str(text)
    return bool(matcher.consume_tokens(tokens) and matcher.is_accepting())



# ---------------------------------------------------------------------------------------------------------------
# sources named by a file (YAML pipelines)
# ---------------------------------------------------------------------------------------------------------------
GRAMMAR_FILE_SUFFIXES = (".gbnf", ".lark", ".ebnf", ".txt")


def constraint_file(key: str, value: Any) -> str | None:
    """The file a pipeline's ``sampling.grammar`` / ``sampling.json_schema`` value names, or None when the value
    is the grammar / schema itself: a schema text starts with ``{`` (a mapping is inline anyway); a grammar is
    a file when it is one line without ``:`` that ends in a grammar suffix or names an existing file."""
    if not isinstance(value, str) or "\n" in value.strip() or not value.strip():
        return None
    text = value.strip()
    if key == "json_schema":
        return None if text.startswith("{") or text in ("true", "false") else text
    if key == "grammar" and ":" not in text and not text.startswith("%"):  # GBNF has "::=", Lark "name:"
        return text if text.endswith(GRAMMAR_FILE_SUFFIXES) or len(text) < 4096 and _is_file(text) else None
    return None


def _is_file(text: str) -> bool:
    from pathlib import Path

    try:
        return Path(text).expanduser().is_file()
    except OSError:
        return False


def read_constraint_file(path: Any, what: str) -> str:
    """A grammar / schema file's text; GrammarError when it cannot be read or is too large."""
    from pathlib import Path

    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        if size > MAX_GRAMMAR_CHARS * 4:
            raise GrammarError(f"{what} file {path} is {size:,} bytes; the limit is {MAX_GRAMMAR_CHARS:,} characters")
        return str(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise GrammarError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise GrammarError(f"the {what} file {path} is not UTF-8 text") from None


__all__ = ["ANY_JSON_OBJECT", "GRAMMAR_FILE_SUFFIXES", "GrammarMatcher", "GrammarSpec", "JSON_WHITESPACE",
           "MAX_GRAMMAR_CHARS", "MAX_SCHEMA_DEPTH", "check_text_matches", "constraint_file", "gbnf_to_lark",
           "grammar_spec", "grammar_tokenizer", "json_depth", "line_and_column", "read_constraint_file",
           "schema_text", "token_bytes"]
