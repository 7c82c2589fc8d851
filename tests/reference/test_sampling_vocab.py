"""Samplers that need a real vocabulary: DRY's sequence breakers from strings, and a chain built from a model."""
from __future__ import annotations

import numpy as np
import pytest

from llmfw.core.sampling import SamplerChain, SamplerParams
from llmfw.plugins.samplers.dry import DRY, breakers_from_strings


@pytest.fixture(scope="module")
def vocab_model(shared_models):
    return shared_models.get("smollm2", vocab_only=True)


def test_breakers_from_strings_like_llama_cpp(vocab_model):
    vocab = vocab_model.vocab
    breakers = breakers_from_strings(vocab, ["\n", "User:"])
    newline = vocab.tokenize("\n", add_special=False)[0]
    user = vocab.tokenize("User", add_special=False)
    colon = vocab.tokenize(":", add_special=False)
    assert breakers[newline] == [[]]  # a token containing the breaker is a one-token breaker
    assert all(breakers[t] == [[]] for t in range(vocab.n_vocab) if b"\n" in vocab.token_to_piece(t, special=True))
    assert len(user) == 1 and colon in breakers[user[0]]  # "User" + the rest of the breaker, tokenized


def test_default_chain_with_dry_from_a_model(vocab_model):
    params = SamplerParams(dry_multiplier=0.8, temp=0.0, seed=1)
    chain = SamplerChain.from_params(params, model=vocab_model, n_ctx=512)
    assert chain.names[1] == "dry"
    dry = chain.samplers[1]
    assert isinstance(dry, DRY) and dry.context_size == vocab_model.n_ctx_train
    vocab = vocab_model.vocab
    a, b, c = vocab.tokenize(" alpha beta gamma", add_special=False)[:3]
    for t in (a, b, c, a, b):  # "a b" repeats: c would extend it to length 3 -> penalty 0.8 * 1.75^(2-2)
        chain.accept(t)
    logits = np.zeros(vocab.n_vocab, dtype=np.float32)
    logits[c] = 0.5  # the best token before DRY...
    assert chain.sample(logits) != c  # ...loses 0.8 and is no longer chosen
