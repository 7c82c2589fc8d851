"""generate(): streaming, stop conditions, KV-cache reuse and seeds on the real SmolLM2 model.

The engine is slow on this machine, so every test decodes only a handful of tokens and the tests share one
context in order (each one starts from whatever the cache holds, which is exactly what reuse must handle).
"""
from __future__ import annotations

import pytest

from llmfw.core.errors import ContextError
from llmfw.core.generate import GenerationStats, TextStream, cached_tokens, generate
from llmfw.core.sampling import SamplerChain, SamplerParams


@pytest.fixture(scope="module")
def vocab_model(shared_models):
    return shared_models.get("smollm2", vocab_only=True)


@pytest.fixture(scope="module")
def model(shared_models):
    return shared_models.get("smollm2")


@pytest.fixture(scope="module")
def ctx(model):
    return model.new_context(n_ctx=256)


def run(ctx, prompt, sampler=None, **kw):
    stats = GenerationStats()
    pieces = list(generate(ctx, prompt, sampler, stats=stats, **kw))
    return pieces, stats


# -- text streaming (vocabulary only) --------------------------------------------------------------------------
def test_stream_is_utf8_safe(vocab_model):
    text = "Привіт 🙂 日本語"
    tokens = vocab_model.vocab.tokenize(text, add_special=False)
    stream = TextStream(vocab_model.vocab, [])
    pieces = [stream.feed(t) for t in tokens] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(tokens) > len(text.split())  # the emoji and CJK really are split across byte tokens


@pytest.mark.parametrize("stop, expected", [
    (["world"], "Hello, "), (["o, w"], "Hell"), ([", x"], "Hello, world and more"), (["d a", "lo"], "Hel"),
])
def test_stop_strings_are_cut_and_never_emitted(vocab_model, stop, expected):
    tokens = vocab_model.vocab.tokenize("Hello, world and more", add_special=False)
    stream = TextStream(vocab_model.vocab, stop)
    out = ""
    for t in tokens:
        piece = stream.feed(t)
        assert not any(s in out + piece for s in stop)
        out += piece
        if stream.stopped:
            break
    if not stream.stopped:
        out += stream.flush()
    assert out == expected


def test_text_that_may_start_a_stop_string_is_held_back(vocab_model):
    vocab = vocab_model.vocab
    stream = TextStream(vocab, ["\n\nUser:"])
    first = stream.feed(vocab.tokenize("Hi\n\n", add_special=False)[0])
    held = "".join(stream.feed(t) for t in vocab.tokenize("\n\n", add_special=False))
    assert "\n" not in first + held  # "\n\n" could still become the stop string
    assert stream.feed(vocab.tokenize(" ok", add_special=False)[0]) == "\n\n ok"


# -- the real model ----------------------------------------------------------------------------------------------
def test_greedy_chat_answer_matches_llama_cpp(ctx, smollm2_ref, confident_prefix):
    ref = smollm2_ref["prompts"][2]  # a ChatML prompt; llama.cpp answers "The answer is: 4" and ends the turn
    expected = ref["sequence"][len(ref["prompt_ids"]):]
    n_sure = confident_prefix(ref)
    assert n_sure >= 3
    pieces, stats = run(ctx, ref["prompt"], max_tokens=n_sure)
    assert stats.tokens == expected[:n_sure]
    assert "".join(pieces) == ctx.model.vocab.detokenize(expected[:n_sure])
    assert stats.stop_reason == "max_tokens"
    assert stats.n_prompt == len(ref["prompt_ids"]) and stats.n_prompt_decoded == len(ref["prompt_ids"])
    # the last sampled token is not decoded yet: the cache holds the prompt and the rest of the answer
    assert cached_tokens(ctx) == ref["prompt_ids"] + expected[:n_sure - 1]


def test_generation_stops_at_end_of_turn(ctx):
    # an answer that is already complete: the model's next token ends the turn
    _, stats = run(ctx, "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\nOK.", max_tokens=8)
    assert stats.stop_reason == "eog" and ctx.model.vocab.is_eog(stats.tokens[-1])


def test_next_turn_decodes_only_the_new_tokens(ctx, model, smollm2_ref):
    ref = smollm2_ref["prompts"][2]
    pieces, first = run(ctx, ref["prompt"], max_tokens=6)
    # every sampled token but the last (an end-of-turn token, or the one that hit the limit) was decoded
    in_cache = cached_tokens(ctx)
    assert in_cache == ref["prompt_ids"] + first.tokens[:-1]
    follow_up = ref["prompt"] + "".join(pieces) + "<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n" \
        "<|im_start|>assistant\n"
    full = model.vocab.tokenize(follow_up, add_special=True, parse_special=True)
    common = next((i for i, (a, b) in enumerate(zip(in_cache, full)) if a != b), min(len(in_cache), len(full)))
    _, stats = run(ctx, follow_up, max_tokens=1)
    assert stats.n_cached == common >= len(ref["prompt_ids"])
    assert stats.n_prompt_decoded == len(full) - common
    fresh = model.new_context(n_ctx=256)
    _, fresh_stats = run(fresh, follow_up, max_tokens=1)
    assert fresh_stats.n_cached == 0 and fresh_stats.tokens == stats.tokens


def test_stop_string_then_max_tokens_with_prefix_reuse(ctx, smollm2_ref):
    ref = smollm2_ref["prompts"][0]  # "The capital of France is" -> " Paris.\n\n..."
    pieces, stats = run(ctx, ref["prompt"], max_tokens=8, stop=["\n"])
    assert "".join(pieces) == " Paris."
    assert stats.stop_reason == "stop" and stats.n_generated == 3
    pieces, stats = run(ctx, ref["prompt"], max_tokens=1)
    assert "".join(pieces) == " Paris" and stats.stop_reason == "max_tokens"
    assert stats.n_cached == len(ref["prompt_ids"]) - 1  # the last prompt token is decoded again for its logits
    assert stats.n_prompt_decoded == 1


def test_cache_trimmed_elsewhere_is_noticed(ctx, smollm2_ref):
    ref = smollm2_ref["prompts"][0]
    run(ctx, ref["prompt"], max_tokens=1)
    ctx.memory.seq_rm(0, 3, -1)  # someone else trims the cache
    _, stats = run(ctx, ref["prompt"], max_tokens=1)
    assert stats.n_cached == 3 and stats.n_prompt_decoded == len(ref["prompt_ids"]) - 3
    assert cached_tokens(ctx) == ref["prompt_ids"]


def test_same_seed_same_text(model):
    def sample(seed):
        # a fresh context each time: the same decode path gives the same logits, so only the sampler varies
        chain = SamplerChain.from_params(SamplerParams(seed=seed, temp=1.5, top_k=0, top_p=1.0, min_p=0.0),
                                         model=model)
        _, stats = run(model.new_context(n_ctx=256), "Once upon a time", chain, max_tokens=4)
        return stats.tokens

    first = sample(1234)
    assert sample(1234) == first


def test_prompt_longer_than_the_context_is_a_clear_error(model):
    small = model.new_context(n_ctx=32)
    too_long = small.n_ctx + 10  # the engine may round n_ctx up
    with pytest.raises(ContextError, match=rf"prompt has {too_long} tokens but the context holds {small.n_ctx}"):
        generate(small, [198] * too_long)
    with pytest.raises(ContextError, match="outside the vocabulary"):
        generate(small, [model.n_vocab + 5])
    with pytest.raises(ContextError, match="empty"):
        generate(small, [])
