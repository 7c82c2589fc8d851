"""The grammar sampler on the real models: llama.cpp's own GBNF grammars and a dozen JSON schemas, sampled at
temperature 1 with fixed seeds; every output is re-checked by something other than the code under test
(``json.loads`` + ``jsonschema``, small parsers written here, and a fresh llguidance matcher).

To stay fast, the sampled outputs of one grammar are produced together: one context holding a sequence per
seed, one batched decode per step (the engine's multi-sequence batches), each sequence with its own sampler
chain. End-to-end runs through :func:`llmfw.generate` check the same path users take.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import regex

from llmfw.core.batch import Batch
from llmfw.core.errors import GrammarError
from llmfw.core.generate import GenerationStats, generate
from llmfw.core.grammar import GrammarSpec, check_text_matches, grammar_tokenizer
from llmfw.core.sampling import SamplerChain, SamplerParams

GRAMMARS = Path(__file__).parents[1] / "data" / "grammars"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2(shared_models):
    return shared_models.get("smollm2")


@pytest.fixture(scope="module")
def gemma3(shared_models):
    return shared_models.get("gemma3")


def sample_together(model, prompt: str, params: list[SamplerParams], max_tokens: int = MAX_TOKENS):
    """One output per SamplerParams, decoded as parallel sequences of one context.

    Returns [(text, stop_reason)], stop_reason "eog" (an end-of-generation token, or the grammar completed)
    or "max_tokens"."""
    chains = [SamplerChain.from_params(p, model=model) for p in params]
    prompt_ids = model.vocab.tokenize(prompt, add_special=True, parse_special=True)
    n = len(chains)
    ctx = model.new_context(n_ctx=n * (len(prompt_ids) + max_tokens + 1), n_seq_max=n,
                            n_batch=max(len(prompt_ids), n), n_ubatch=max(len(prompt_ids), n))
    try:
        assert ctx.decode(Batch(prompt_ids, seq_id=[list(range(n))] * len(prompt_ids))) == 0
        logits = {i: ctx.get_logits_ith(-1) for i in range(n)}
        tokens: list[list[int]] = [[] for _ in range(n)]
        reasons = ["max_tokens"] * n
        for _ in range(max_tokens):
            step = []
            for i, row in logits.items():
                token = chains[i].sample(row)
                if model.vocab.is_eog(token):
                    reasons[i] = "eog"
                    continue
                tokens[i].append(token)
                if chains[i].done():
                    reasons[i] = "eog"
                    continue
                step.append((i, token))
            if not step:
                break
            assert ctx.decode(Batch([t for _, t in step], seq_id=[i for i, _ in step], logits=True)) == 0
            logits = {i: ctx.get_logits_ith(row) for row, (i, _) in enumerate(step)}
        return [(model.vocab.detokenize(t), r) for t, r in zip(tokens, reasons)]
    finally:
        ctx.close()


def seeds(n: int, **kw) -> list[SamplerParams]:
    return [SamplerParams(temp=1.0, seed=1000 + s, **kw) for s in range(n)]


# ------------------------------------------------------------------------------------------------------------
# llama.cpp's grammars: 20 outputs each, every complete one accepted, every cut one a valid prefix
# ------------------------------------------------------------------------------------------------------------
LIST_RE = re.compile(r"(- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n)+")
#: arithmetic.gbnf as a recursive pattern of the ``regex`` package (an independent parser of the same language)
ARITHMETIC_RE = regex.compile(
    r"(?(DEFINE)(?<ws>[ \t\n]*)"
    r"(?<term>[a-z][a-z0-9_]*(?&ws)|[0-9]+(?&ws)|\((?&ws)(?&expr)\)(?&ws))"
    r"(?<expr>(?&term)(?:[-+*/](?&term))*))"
    r"(?:(?&expr)=(?&ws)(?&term)\n)+")


def arithmetic_ok(text: str) -> bool:
    return ARITHMETIC_RE.fullmatch(text) is not None


def is_prefix(spec: GrammarSpec, vocab, text: str) -> bool:
    """A fresh llguidance matcher takes every byte of ``text`` (a cut output is a valid prefix)."""
    import llguidance

    matcher = llguidance.LLMatcher(grammar_tokenizer(vocab), spec.compile(), log_level=0)
    return matcher.consume_tokens(grammar_tokenizer(vocab).tokenize_str(text)) and not matcher.is_error()


def json_value_ok(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


INDEPENDENT_CHECKS = {
    "json.gbnf": lambda t: json_value_ok(t) and t.lstrip()[:1] == "{",
    "json_arr.gbnf": lambda t: json_value_ok(t) and t.startswith("[\n"),
    "list.gbnf": lambda t: LIST_RE.fullmatch(t) is not None,
    "arithmetic.gbnf": arithmetic_ok,
}
PROMPTS = {
    "json.gbnf": "A JSON object describing a cat:\n",
    "json_arr.gbnf": "A JSON array of three fruits:\n",
    "list.gbnf": "A shopping list:\n",
    "arithmetic.gbnf": "Some arithmetic, one equation per line:\n",
}


@pytest.mark.parametrize("name", sorted(p.name for p in GRAMMARS.glob("*.gbnf")))
def test_llama_cpp_grammar_parses(name):
    grammar = (GRAMMARS / name).read_text(encoding="utf-8")
    params = SamplerParams(grammar=grammar)
    assert params.grammar_spec().kind == "gbnf"
    assert params.compiled_grammar()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(INDEPENDENT_CHECKS))
def test_llama_cpp_grammar_outputs_are_accepted(smollm2, name):
    grammar = (GRAMMARS / name).read_text(encoding="utf-8")
    spec = GrammarSpec.from_grammar(grammar)
    outputs = sample_together(smollm2, PROMPTS[name], seeds(20, grammar=grammar), max_tokens=24)
    complete = [text for text, reason in outputs if reason == "eog"]
    for text, reason in outputs:
        assert text, "the grammar allows no empty output, so every sequence produced something"
        if reason == "eog":
            assert INDEPENDENT_CHECKS[name](text), (name, text)
            assert check_text_matches(spec, smollm2.vocab, text), (name, text)
        else:
            assert is_prefix(spec, smollm2.vocab, text), (name, text)
    assert len(set(text for text, _ in outputs)) > 10, "temperature 1 with 20 seeds gives varied outputs"
    if name in ("json.gbnf", "json_arr.gbnf"):
        assert complete, "some JSON outputs finish within the token budget"


# ------------------------------------------------------------------------------------------------------------
# twelve JSON schemas, three seeds, both models: every output parses and validates
# ------------------------------------------------------------------------------------------------------------
SHORT = {"type": "string", "maxLength": 12}
SCHEMAS: dict[str, dict] = {
    "object_required": {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0,
                        "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -9,
              "maximum": 9}}, "required": ["kind", "x"], "additionalProperties": False},
    "integer_range": {"type": "integer", "minimum": 10, "maximum": 99},
    "number_range": {"type": "object", "properties": {"t": {"type": "number", "minimum": -1.5,
                     "exclusiveMaximum": 2.5}}, "required": ["t"], "additionalProperties": False},
    "string_pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                       "required": ["code"], "additionalProperties": False},
    "array_bounds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
                     "maxItems": 4},
    "boolean_null": {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
                     "required": ["ok", "note"], "additionalProperties": False},
    "ref_defs": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                 "maximum": 9}}, "required": ["x"], "additionalProperties": False}},
                 "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
                 "required": ["a", "b"], "additionalProperties": False},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"enum": ["none", "many"]}]},
    "nested_array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2,
                                "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                "maximum": 5}}, "required": ["id"], "additionalProperties": False}}},
                                "required": ["items"], "additionalProperties": False},
    "optional_properties": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2]}},
                            "required": ["a"], "additionalProperties": False},
}
N_SEEDS = 3


def _check_schema_outputs(model) -> None:
    """Every schema x every seed as one batch of parallel sequences; each output must parse and validate."""
    names = sorted(SCHEMAS)
    params = [p for name in names for p in seeds(N_SEEDS, json_schema=SCHEMAS[name])]
    outputs = sample_together(model, _prompt(model), params)
    failures = []
    for index, (text, reason) in enumerate(outputs):
        name = names[index // N_SEEDS]
        try:
            assert reason == "eog", "did not finish"
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            assert len(text) < 400, "whitespace stays bounded"
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((name, text, str(exc).splitlines()[0]))
    assert not failures, failures


def _prompt(model) -> str:
    return model.apply_chat_template([{"role": "user", "content": "Answer with a short JSON value."}])


def test_at_least_twelve_schema_features():
    assert len(SCHEMAS) >= 12


@pytest.mark.slow
def test_json_schema_outputs_validate_smollm2(smollm2):
    _check_schema_outputs(smollm2)


@pytest.mark.slow
def test_json_schema_outputs_validate_gemma3(gemma3):
    _check_schema_outputs(gemma3)


# ------------------------------------------------------------------------------------------------------------
# end to end through generate()
# ------------------------------------------------------------------------------------------------------------
def test_generate_stops_when_the_grammar_is_complete(smollm2):
    ctx = smollm2.new_context(n_ctx=256)
    chain = SamplerChain.from_params(SamplerParams(grammar='root ::= "yes" | "no"', temp=1.0, seed=7),
                                     model=smollm2)
    stats = GenerationStats()
    text = "".join(generate(ctx, "Is the sky blue? Answer:", chain, max_tokens=20, stats=stats))
    assert text in ("yes", "no")
    assert stats.stop_reason == "eog" and stats.n_generated <= 3


def test_each_chat_turn_starts_the_grammar_afresh(smollm2):
    ctx = smollm2.new_context(n_ctx=512)
    chain = SamplerChain.from_params(SamplerParams(regex="[0-9]{1,3}", temp=1.0, seed=3), model=smollm2)
    messages = [{"role": "user", "content": "Pick a number."}]
    first = "".join(generate(ctx, smollm2.apply_chat_template(messages), chain, max_tokens=8))
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Another one."}]
    second = "".join(generate(ctx, smollm2.apply_chat_template(messages), chain, max_tokens=8))
    assert re.fullmatch("[0-9]{1,3}", first) and re.fullmatch("[0-9]{1,3}", second), (first, second)


def test_any_json_object_with_generate_on_gemma3(gemma3):
    ctx = gemma3.new_context(n_ctx=256)
    chain = SamplerChain.from_params(SamplerParams(json_schema={"type": "object", "properties": {
        "answer": {"type": "string", "maxLength": 16}}, "required": ["answer"], "additionalProperties": False},
        temp=1.0, seed=5), model=gemma3)
    stats = GenerationStats()
    text = "".join(generate(ctx, _prompt(gemma3), chain, max_tokens=MAX_TOKENS, stats=stats))
    assert stats.stop_reason == "eog"
    assert isinstance(json.loads(text)["answer"], str)


def test_a_grammar_that_can_never_match_says_so(smollm2):
    # root ::= root "a" derives no finite text: it compiles, but no token can ever start it
    with pytest.raises(GrammarError, match="can never match"):
        SamplerChain.from_params(SamplerParams(grammar="root ::= root \"a\""), model=smollm2)
