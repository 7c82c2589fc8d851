"""Grammar sources without model weights: parsing, clear errors with their place, input limits, the vocabulary
bridge (on the real models' vocabularies, read from the GGUF headers only) and SamplerParams / OpenAI request
fields turned into the grammar sampler's input."""
from __future__ import annotations

import json
import time

import pytest

from llmfw.core.errors import GrammarError, LLMFWError, SamplerError
from llmfw.core.grammar import (MAX_GRAMMAR_CHARS, MAX_SCHEMA_DEPTH, GrammarMatcher, GrammarSpec,
                                check_text_matches, gbnf_to_lark, grammar_tokenizer, json_depth, token_bytes)
from llmfw.core.response_format import constraint_from_request
from llmfw.core.sampling import SamplerParams


@pytest.fixture(scope="module")
def smollm2_vocab(shared_models):
    return shared_models.get("smollm2", vocab_only=True).vocab


@pytest.fixture(scope="module")
def gemma3_vocab(shared_models):
    return shared_models.get("gemma3", vocab_only=True).vocab


# -- errors with their place ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, line, column, words", [
    ('root ::= "a', 1, 12, "end of input"),
    ('root ::= "x"\nitem ::= [a-', 2, 13, "end of input"),
    ('root := "x"', 1, 6, "::="),
    ('root ::= "a" item', 1, 14, "item"),
    ('item ::= "a"\n', 1, 1, "root"),
])
def test_malformed_gbnf_names_line_and_column(text, line, column, words):
    with pytest.raises(GrammarError) as info:
        SamplerParams(grammar=text)
    assert (info.value.line, info.value.column) == (line, column)
    assert words in str(info.value) and f"line {line}, column {column}" in str(info.value)
    assert isinstance(info.value, LLMFWError)


def test_gbnf_error_found_by_the_engine_points_at_the_rule_line():
    with pytest.raises(GrammarError, match="invalid character class range") as info:
        GrammarSpec.from_grammar('root ::= x\nx ::= [z-a]').compile()
    assert info.value.line == 2


def test_malformed_lark_names_line_and_column():
    with pytest.raises(GrammarError, match="unknown name") as info:
        GrammarSpec.from_grammar('start: "a" foo\n').compile()
    assert (info.value.line, info.value.column) == (1, 8)


@pytest.mark.parametrize("pattern, words", [("[a-", "unclosed character class"), ("(abc", "unclosed group"),
                                            ("a{2,1}", "repetition count")])
def test_malformed_regex_says_why(pattern, words):
    with pytest.raises(GrammarError, match=words):
        SamplerParams(regex=pattern)


@pytest.mark.parametrize("schema, words", [
    ('{"type": ', "not valid JSON"),
    ('[1, 2]', "object"),
    ({"type": "foo"}, "Invalid type"),
    ({"type": "string", "pattern": "[a-"}, "unclosed character class"),
    ({"$ref": "#/$defs/missing"}, "does not exist"),
])
def test_malformed_schema_says_why(schema, words):
    with pytest.raises(GrammarError, match=words):
        SamplerParams(json_schema=schema)


def test_schema_syntax_error_has_line_and_column():
    with pytest.raises(GrammarError) as info:
        SamplerParams(json_schema='{\n  "type": "object",\n  "properties": {"a" 1}\n}')
    assert (info.value.line, info.value.column) == (3, 22)  # the "1" where ":" belongs


def test_unsatisfiable_schema_says_it_can_never_match():
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 3}},
              "required": ["a"]}
    with pytest.raises(GrammarError, match="can never match"):
        SamplerParams(json_schema=schema)


def test_only_one_constraint_at_a_time():
    with pytest.raises(GrammarError, match="one of"):
        SamplerParams(grammar='root ::= "a"', regex="a")


def test_bad_grammar_in_a_pipeline_names_the_key():
    from llmfw.core.errors import ConfigError
    from llmfw.core.pipeline import validate_config

    with pytest.raises(ConfigError, match=r"sampling.*line 1, column 12"):
        validate_config({"sampling": {"grammar": 'root ::= "a'}})


# -- limits: bounded time, no crash ------------------------------------------------------------------------------
def test_schema_nested_ten_thousand_levels_is_refused_quickly():
    schema: dict = {"type": "integer"}
    for _ in range(10_000):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    start = time.perf_counter()
    with pytest.raises(GrammarError, match="nested"):
        SamplerParams(json_schema=schema)
    text = '{"type": "array", "items": ' * 10_000 + "{}" + "}" * 10_000
    with pytest.raises(GrammarError, match="nested|limit"):
        SamplerParams(json_schema=text)
    assert json_depth(schema) > MAX_SCHEMA_DEPTH
    assert time.perf_counter() - start < 30  # generous: bounded, not a speed test


def test_grammar_of_100_kb_is_handled_in_bounded_time():
    chain = "root ::= r0\n" + "\n".join(f'r{i} ::= "tok{i}" [a-z]* | r{i + 1}' for i in range(3000)) + \
        '\nr3000 ::= "end"\n'
    alternatives = "root ::= " + " | ".join(f'"word{i}"' for i in range(12_000))
    assert len(chain) > 100_000 and len(alternatives) > 100_000
    start = time.perf_counter()
    try:
        GrammarSpec.from_grammar(chain).compile()
    except GrammarError as exc:
        assert "too big" in str(exc)
    assert GrammarSpec.from_grammar(alternatives).compile()
    assert time.perf_counter() - start < 60


def test_oversized_and_deeply_nested_grammars_are_refused():
    with pytest.raises(GrammarError, match="limit"):
        SamplerParams(grammar='root ::= "' + "a" * MAX_GRAMMAR_CHARS + '"')
    with pytest.raises(GrammarError, match="nested too deeply"):
        SamplerParams(grammar="root ::= " + "(" * 5000 + '"a"' + ")" * 5000)
    with pytest.raises(GrammarError, match="nested"):
        SamplerParams(grammar="start: " + "(" * 5000 + '"a"' + ")" * 5000)


# -- the GBNF converter ----------------------------------------------------------------------------------------
def test_linear_terminality_gives_the_converters_own_output():
    from llguidance.gbnf_to_lark import gbnf_to_lark as reference

    grammar = "root ::= a b\na ::= [a-z]+ | c\nc ::= \"(\" a \")\"\nb ::= d*\nd ::= [0-9]\ne ::= e \"x\"\n"
    assert gbnf_to_lark(grammar) == reference(grammar)


# -- the vocabulary bridge -------------------------------------------------------------------------------------
def test_byte_level_bpe_tokens_are_their_bytes(smollm2_vocab):
    pieces = token_bytes(smollm2_vocab)
    space_the = smollm2_vocab.tokenize(" the", add_special=False)
    assert len(space_the) == 1 and pieces[space_the[0]] == b" the"
    assert pieces[smollm2_vocab.eos_id].startswith(b"\xff")  # control tokens are special
    newline = smollm2_vocab.tokenize("\n", add_special=False)
    assert pieces[newline[0]] == b"\n"


def test_spm_pieces_and_byte_fallback(gemma3_vocab):
    pieces = token_bytes(gemma3_vocab)
    word = gemma3_vocab.tokenize(" hello", add_special=False)
    assert b"".join(pieces[t] for t in word) == b" hello"  # SPM's \u2581 is a space
    byte_tokens = [t for t in range(gemma3_vocab.n_vocab) if gemma3_vocab.is_byte(t)]
    assert byte_tokens and all(len(pieces[t]) == 1 for t in byte_tokens)
    assert pieces[gemma3_vocab.text_to_token("<0x41>")] == b"A"
    assert pieces[gemma3_vocab.text_to_token("<end_of_turn>")] == b"\xff<end_of_turn>"


def test_the_bridge_is_built_once_per_vocab(smollm2_vocab):
    first = grammar_tokenizer(smollm2_vocab)
    assert grammar_tokenizer(smollm2_vocab) is first
    assert first.vocab_size >= smollm2_vocab.n_vocab


def test_matcher_masks_follow_the_grammar(smollm2_vocab):
    spec = GrammarSpec.from_grammar('root ::= "yes" | "no"')
    matcher = GrammarMatcher(spec, smollm2_vocab)
    allowed = matcher.allowed()
    assert allowed.dtype == bool and allowed.size == smollm2_vocab.n_vocab
    yes = smollm2_vocab.tokenize("yes", add_special=False)
    assert allowed[yes[0]] and not any(allowed[t] for t in smollm2_vocab.eog_ids)
    for t in yes:
        matcher.consume(t)
    assert matcher.is_accepting and matcher.is_stopped
    with pytest.raises(GrammarError):
        matcher.reset() or matcher.consume(smollm2_vocab.tokenize("maybe", add_special=False)[0])


def test_end_of_generation_only_where_the_grammar_may_end(smollm2_vocab):
    matcher = GrammarMatcher(GrammarSpec.from_regex("[0-9]+"), smollm2_vocab)
    assert not matcher.allowed()[sorted(smollm2_vocab.eog_ids)].any()
    matcher.consume(smollm2_vocab.tokenize("7", add_special=False)[0])
    assert matcher.allowed()[sorted(smollm2_vocab.eog_ids)].all() and not matcher.is_stopped


def test_json_whitespace_is_bounded(smollm2_vocab):
    spec = GrammarSpec.from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert check_text_matches(spec, smollm2_vocab, '{"a": 1}')
    assert check_text_matches(spec, smollm2_vocab, '{\n  "a": 1\n}')
    assert not check_text_matches(spec, smollm2_vocab, '{' + " " * 40 + '"a": 1}')
    assert not check_text_matches(spec, smollm2_vocab, '{\n\n\n"a": 1}')


# -- SamplerParams and the chain -------------------------------------------------------------------------------
def test_sampler_params_accept_each_input_kind():
    assert SamplerParams(grammar='root ::= "a"').grammar_spec().kind == "gbnf"
    assert SamplerParams(grammar='start: "a" | "b"').grammar_spec().kind == "lark"
    assert SamplerParams(regex="[a-z]+").grammar_spec().kind == "regex"
    assert SamplerParams(json_schema={"type": "object"}).grammar_spec().kind == "json_schema"
    assert SamplerParams(json_schema='{"type": "array"}').grammar_spec().kind == "json_schema"
    assert SamplerParams(json_schema=True).grammar_spec().text == "{}"  # any JSON value
    with pytest.raises(GrammarError, match="never match"):
        SamplerParams(json_schema=False)
    assert SamplerParams().grammar_spec() is None


def test_grammar_sampler_needs_a_vocabulary():
    from llmfw.core.sampling import SamplerChain

    with pytest.raises(SamplerError, match="vocabulary"):
        SamplerChain.from_params(SamplerParams(grammar='root ::= "a"'))


def test_grammar_goes_first_in_the_chain(smollm2_vocab):
    from llmfw.core.sampling import SamplerChain

    chain = SamplerChain.from_params(SamplerParams(regex="a+", logit_bias={5: 1.0}), vocab=smollm2_vocab)
    assert chain.names[:2] == ["grammar", "logit_bias"]


# -- OpenAI request fields ---------------------------------------------------------------------------------------
def test_response_format_json_object_and_schema():
    assert constraint_from_request({}) == {}
    assert constraint_from_request({"response_format": {"type": "text"}}) == {}
    assert constraint_from_request({"response_format": {"type": "json_object"}}) == {"json_schema": {"type": "object"}}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}}
    assert constraint_from_request(body) == {"json_schema": schema}
    assert constraint_from_request({"json_schema": schema}) == {"json_schema": schema}
    assert constraint_from_request({"grammar": 'root ::= "a"'}) == {"grammar": 'root ::= "a"'}
    assert SamplerParams(**constraint_from_request(body)).grammar_spec().kind == "json_schema"


@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "must be an object"),
    ({"response_format": {"type": "json_schema"}}, "needs a"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "Invalid type"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "only one"),
    ({"grammar": 'root ::= "a'}, "line 1, column 12"),
    ({"grammar": 5}, "must be a string"),
])
def test_bad_request_constraints_raise_grammar_error(body, words):
    with pytest.raises(GrammarError, match=words):
        constraint_from_request(json.loads(json.dumps(body)))


def test_random_sources_give_grammar_errors_only():
    """A seeded fuzz over GBNF / Lark / regex / schema fragments: every failure is a GrammarError."""
    import random

    rng = random.Random(0)
    alphabet = list('root::= "ab|()[]*+?{}0-9\\\n^x-') + ["::=", "root", '"', "[^", "\\x", "\\u12", "{2,",
                                                           "%llguidance", "start:", "/", "\ud800"]
    prefixes = ['{"type":', '{"$ref":"#"}', '{"anyOf":[{"$ref":"#"}]}', '{"type":"string","pattern":"',
                '{"enum":[]}', '{"type":"array","minItems":5,"maxItems":2}', '{"properties":{"a":']
    for kind in ("grammar", "regex", "json_schema"):
        for _ in range(150):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
            if kind == "json_schema":
                text = rng.choice(prefixes) + text
            try:
                SamplerParams(**{kind: text})
            except GrammarError as exc:
                assert str(exc) and "Traceback" not in str(exc)


def test_grammar_sampler_keeps_exactly_the_allowed_candidates(smollm2_vocab):
    """In vocabulary order (first in the chain) and after reordering or truncation alike."""
    import numpy as np

    from llmfw.core.sampling import Candidates, SamplerEnv, build_sampler

    sampler = build_sampler("grammar", SamplerParams(regex="(yes|no)"), SamplerEnv(vocab=smollm2_vocab))
    allowed = set(np.flatnonzero(sampler.matcher.allowed()).tolist())
    rng = np.random.default_rng(1)
    logits = rng.normal(size=smollm2_vocab.n_vocab).astype(np.float32)
    in_order = Candidates.from_logits(logits)
    sampler.apply(in_order)
    assert set(in_order.ids.tolist()) == allowed and np.array_equal(in_order.logits, logits[in_order.ids])
    shuffled = Candidates.from_logits(logits)
    shuffled.take(rng.permutation(shuffled.size)[:30_000])
    kept_before = set(shuffled.ids.tolist())
    sampler.apply(shuffled)
    assert set(shuffled.ids.tolist()) == allowed & kept_before
