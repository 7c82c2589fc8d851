"""qwen2, qwen3, phi3, gemma2 (issue 6) and smollm3, granite, mistral3, lfm2, granitehybrid, qwen35, nemotron_h,
gemma4 (issue 34) against llama.cpp, on small random-weight files.

No real model of these families is on this network, so ``tests/reference_gen`` writes each one exactly as
llama.cpp's converter names and shapes it (2-4 layers, mixed F32/F16/Q8_0/Q4_0/Q4_1/Q5_0 tensors, a vocabulary
cut from a real model); ``tests/data/arch/<family>.json`` holds llama.cpp's tokens and teacher-forced logits
for those exact bytes. Every prompt must clear issue 6's bar, also when decoded in small ubatches and when two
sequences share one batch; the long prompts run past the files' 32-token sliding window.
"""
from __future__ import annotations

import numpy as np
import pytest

from reference_gen.arch_testing import (SAME_LOGITS_ATOL, assert_clears_bar, check_tokenization, decode_all,
                                        decode_two_sequences, longest, model_file, records, reference,
                                        shift_error)

import llmfw

FAMILIES = ["qwen2", "qwen3", "phi3", "gemma2", "smollm3", "granite", "mistral3", "lfm2",
            "granitehybrid", "qwen35", "nemotron_h", "gemma4"]
SMALL_UBATCH = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (loaded numpy-backend model, llama.cpp reference); built once per module."""
    directory = tmp_path_factory.mktemp("arch")
    loaded = {}
    yield lambda family: loaded.setdefault(
        family, (llmfw.load_model(model_file(family, directory), backend="numpy"), reference(family)))
    for model, _ in loaded.values():
        model.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_prompt_clears_the_bar(models, score, family):
    model, ref = models(family)
    assert model.arch_name == family
    for record in records(ref):
        logits = decode_all(model, record["sequence"], n_ctx=record["n_ctx"])
        assert_clears_bar(score, record, logits, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenization_matches_llama_cpp(models, family):
    model, ref = models(family)
    for record in records(ref):
        check_tokenization(model, record)


@pytest.mark.parametrize("family", FAMILIES)
def test_small_ubatches_give_the_same_logits(models, score, family):
    model, ref = models(family)
    record = longest(ref)
    whole = decode_all(model, record["sequence"], n_ctx=record["n_ctx"])
    split = decode_all(model, record["sequence"], n_ctx=record["n_ctx"], n_ubatch=SMALL_UBATCH)
    assert_clears_bar(score, record, split, f"{family} with n_ubatch {SMALL_UBATCH}")
    assert np.abs(whole - split).max() <= SAME_LOGITS_ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_two_sequences_in_one_batch(models, score, family):
    model, ref = models(family)
    first, second = records(ref, n_ctx=512)[:2]
    logits_a, logits_b = decode_two_sequences(model, first["sequence"], second["sequence"], n_ctx=512)
    assert_clears_bar(score, first, logits_a, f"{family}, sequence 0 of 2")
    assert_clears_bar(score, second, logits_b, f"{family}, sequence 1 of 2")
    alone = decode_all(model, second["sequence"], n_ctx=512)
    assert np.abs(alone - logits_b).max() <= SAME_LOGITS_ATOL


def test_long_prompts_cross_the_sliding_window(models):
    """The references include prompts longer than the files' window; gemma2 windows its even layers (in a
    cache of their own), phi3 ignores its window like llama.cpp."""
    gemma2, ref = models("gemma2")
    assert gemma2.hparams.n_swa == 32 and gemma2.hparams.swa_layers == [True, False, True, False]
    assert max(len(r["sequence"]) for r in ref["prompts"]) > 256  # past the window cache of a small ubatch
    ctx = gemma2.new_context(n_ctx=512, n_ubatch=SMALL_UBATCH)
    assert set(ctx.memory.cache_names) == {"kv", "kv_swa"}
    phi3, ref = models("phi3")
    assert phi3.hparams.n_swa == 0  # the file says 32
    assert max(len(r["sequence"]) for r in ref["prompts"]) > 32


def test_phi3_picks_long_or_short_rope_factors_by_context(models):
    """n_ctx 512 > original context 256 uses rope_factors_long, n_ctx 256 the short ones: the same tokens get
    different logits, each matching llama.cpp (checked above)."""
    model, ref = models("phi3")
    by_ctx = {r["n_ctx"]: r for r in ref["prompts"] if r["name"] == "medium"}
    long_run = decode_all(model, by_ctx[512]["sequence"], n_ctx=512)
    short_run = decode_all(model, by_ctx[256]["sequence"], n_ctx=256)
    assert by_ctx[512]["sequence"][:40] == by_ctx[256]["sequence"][:40]
    assert np.abs(long_run[:40] - short_run[:40]).max() > 0.1


def test_phi3_k_shift_uses_the_same_rope_factors(tmp_path):
    """seq_add re-ropes the cached keys (K-shift) with the factors the graph used (long ones at n_ctx 512), so
    shifting a decoded prompt by 7 positions equals decoding it at those positions. attn_factor is overridden
    to 1: llama.cpp's K-shift multiplies the cached keys by it once more (and so do we), which would break the
    equality on purpose."""
    path = model_file("phi3", tmp_path)
    sequence = records(reference("phi3"))[1]["sequence"]
    prompt, follower, delta = sequence[:60], sequence[60], 7
    with llmfw.load_model(path, backend="numpy", kv_overrides={"phi3.rope.scaling.attn_factor": 1.0}) as model:
        assert shift_error(model, prompt, follower, delta) <= SAME_LOGITS_ATOL


def test_unknown_architecture_names_the_known_ones(tmp_path):
    from llmfw.core.errors import UnknownArchitecture
    from llmfw.core.gguf import GGUFValueType, GGUFWriter

    path = tmp_path / "mystery.gguf"
    with GGUFWriter(path) as writer:
        writer.add("general.architecture", "mystery", GGUFValueType.STRING)
    with pytest.raises(UnknownArchitecture) as caught:
        llmfw.load_model(path, backend="numpy")
    message = str(caught.value)
    assert "mystery" in message
    for known in ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"):
        assert known in message
