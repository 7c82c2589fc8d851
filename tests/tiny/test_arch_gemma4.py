"""Gemma 4 (issue 34) against llama.cpp on its random-weight file: sliding-window layers with their own head size and
rotary width, global layers with proportional rope (``rope_freqs``), per-layer inputs, output scales, a layer
without ``attn_v`` (values are the keys) and the last two layers reusing earlier layers' KV caches.

Every prompt clears the random-weight bar on numpy and onnx, whole, in ubatches of 32 and two sequences together;
a ``seq_cp`` fork decodes like each sequence alone; switching off one feature fails the bar; the server answers
with llama.cpp's log-probabilities.
"""
from __future__ import annotations

import numpy as np
import openai
import pytest

from reference_gen.arch_testing import (BAR, SAME_LOGITS_ATOL, assert_clears_bar, decode_all, decode_two_sequences,
                                        fork_errors, longest, model_file, records, reference)
from reference_gen.variant_files import write_variant

import llmfw
from llmfw.serving import Engine
from llmfw.serving.app import create_app
from support.live_server import TIMEOUT, LiveServer

NAME = "gemma4"
UBATCH = 32


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return model_file(NAME, tmp_path_factory.mktemp(NAME))


@pytest.fixture(scope="module", params=["numpy", "onnx"])
def model(request, path):
    with llmfw.load_model(path, backend=request.param) as loaded:
        yield loaded


def test_every_prompt_clears_the_bar_whole_and_in_ubatches_of_32(model, score):
    for record in records(reference(NAME)):
        assert_clears_bar(score, record, decode_all(model, record["sequence"], n_ctx=512), f"{NAME} whole")
    record = longest(reference(NAME))  # 457 tokens: far past the 32-token window
    assert_clears_bar(score, record, decode_all(model, record["sequence"], n_ctx=512, n_ubatch=UBATCH),
                      f"{NAME} in ubatches of {UBATCH}")


def test_two_sequences_together(model, score):
    first, second = records(reference(NAME))[:2]
    logits_a, logits_b = decode_two_sequences(model, first["sequence"], second["sequence"], n_ctx=512,
                                              n_ubatch=UBATCH)
    assert_clears_bar(score, first, logits_a, f"{NAME}, sequence 0 of 2")
    assert_clears_bar(score, second, logits_b, f"{NAME}, sequence 1 of 2")


def test_the_shared_layers_keep_no_cache_of_their_own(path):
    with llmfw.load_model(path, backend="numpy") as model:
        hp = model.hparams
        assert [hp.kv_source(il) for il in range(6)] == [0, 1, 2, 3, 2, 3]
        assert [hp.head_dim_k(il) for il in range(6)] == [64, 128] * 3
        ctx = model.new_context(n_ctx=512)
        assert ctx.memory.swa.layers == [0, 2] and ctx.memory.base.layers == [1, 3]


def test_seq_cp_fork_decodes_like_each_sequence_alone(path):
    with llmfw.load_model(path, backend="numpy") as model:
        assert max(fork_errors(model, NAME)) <= SAME_LOGITS_ATOL


#: one feature switched off by a file edit: the per-layer inputs' projections zeroed, output scales of 1,
#: frequency factors of 1 (plain rope on the global layers)
WITHOUT = {
    "per-layer inputs": lambda: {f"blk.{il}.proj.weight": np.zeros((256, 64), np.float32) for il in range(6)},
    "output scales": lambda: {f"blk.{il}.layer_output_scale.weight": np.ones(1, np.float32) for il in range(6)},
    "proportional rope": lambda: {"rope_freqs.weight": np.ones(64, np.float32)},
}
#: or by a key: no final soft-capping, no window
WITHOUT_KEYS = {"final soft-capping": {"gemma4.final_logit_softcapping": 0.0},
                "sliding window": {"gemma4.attention.sliding_window": 4096}}


@pytest.mark.parametrize("feature", [*WITHOUT, *WITHOUT_KEYS])
def test_without_one_feature_fails_the_bar(path, tmp_path, score, feature):
    if feature in WITHOUT:
        model = llmfw.load_model(write_variant(path, tmp_path / "variant.gguf", replace=WITHOUT[feature]()),
                                 backend="numpy")
    else:
        model = llmfw.load_model(path, backend="numpy", kv_overrides=WITHOUT_KEYS[feature])
    record = longest(reference(NAME))
    with model:
        result = score(record, decode_all(model, record["sequence"], n_ctx=512))
    assert result["top1"] < BAR["top1"] or result["mean_lp_err"] > BAR["mean_lp_err"], (feature, result)


def test_the_moe_variant_is_refused_clearly(path):
    from llmfw.core.errors import ModelError

    with pytest.raises(ModelError, match="mixture-of-experts Gemma 4"):
        llmfw.load_model(path, backend="numpy", kv_overrides={"gemma4.expert_count": 8})


def test_serves_llama_cpp_log_probabilities(path):
    """The server (the app `llmfw serve` runs) on the file, driven by the openai client: the five best
    log-probabilities of the first completion token are llama.cpp's for that position."""
    record = records(reference(NAME))[1]
    expected = record["positions"][len(record["prompt_ids"]) - 1]
    want = [logit - expected["lse"] for logit in expected["top_logits"][:5]]
    with llmfw.load_model(path, backend="numpy") as model, Engine(model, parallel=1, n_ctx=1024, alias=NAME) as engine:
        live = LiveServer(create_app(engine))
        try:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
            done = client.completions.create(model=NAME, prompt=record["prompt"], max_tokens=1, temperature=0,
                                             logprobs=5)
        finally:
            live.stop()
    got = sorted(done.choices[0].logprobs.top_logprobs[0].values(), reverse=True)
    assert np.abs(np.array(got) - np.array(want)).max() < 0.3, (got, want)
