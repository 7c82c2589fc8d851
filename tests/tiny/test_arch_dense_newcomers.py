"""What sets issue 34's dense newcomers apart from llama, each shown to matter (their llama.cpp bar is checked in
tests/tiny/test_arch_families.py and, on the onnx backend, tests/reference/test_onnx_arch.py):

* smollm3: every fourth layer without RoPE, so the K-shift after ``seq_add`` must leave that layer's keys alone;
* granite: the embedding / residual / attention / logit multipliers;
* mistral3: the Llama-4 attention temperature past the original context, and YaRN's log multiplier.
"""
from __future__ import annotations

import numpy as np
import pytest

from reference_gen.arch_testing import SAME_LOGITS_ATOL, decode_all, model_file, records, reference, shift_error

import llmfw
from llmfw.core.errors import ModelError
from llmfw.plugins.architectures.mistral3 import attention_temperature
from llmfw.plugins.architectures.smollm3 import uses_rope


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("newcomers")
    return lambda name: model_file(name, directory)


def _sequence(name: str) -> list[int]:
    return records(reference(name))[1]["sequence"]


def test_smollm3_layer_pattern():
    assert [uses_rope(il) for il in range(8)] == [True, True, True, False, True, True, True, False]


def test_smollm3_k_shift_skips_the_layers_without_rope(files):
    """Shifting a decoded prompt by 5 positions equals decoding it there: the NoPE layer's cached keys carry no
    position, so re-rotating them (as a K-shift over every layer would) breaks the equality."""
    sequence = _sequence("smollm3")
    prompt, follower, delta = sequence[:50], sequence[50], 5
    with llmfw.load_model(files("smollm3"), backend="numpy") as model:
        assert shift_error(model, prompt, follower, delta) <= SAME_LOGITS_ATOL


@pytest.mark.parametrize("key, value", [("granite.logit_scale", 1.0), ("granite.residual_scale", 1.0),
                                        ("granite.embedding_scale", 1.0), ("granite.attention.scale", 0.125)])
def test_every_granite_multiplier_changes_the_logits(files, key, value):
    tokens = _sequence("granite")[:40]
    with llmfw.load_model(files("granite"), backend="numpy") as model:
        want = decode_all(model, tokens, n_ctx=512)
    with llmfw.load_model(files("granite"), backend="numpy", kv_overrides={key: value}) as model:
        got = decode_all(model, tokens, n_ctx=512)
    assert np.abs(got - want).max() > 0.05, f"{key} = {value} made no difference"


def test_granite_needs_a_logit_scale(files):
    with pytest.raises(ModelError, match="logit_scale"):
        llmfw.load_model(files("granite"), backend="numpy", kv_overrides={"granite.logit_scale": 0.0})


def test_mistral3_temperature_starts_past_the_original_context(files):
    scale = attention_temperature(np.arange(200, dtype=np.int32), 0.5, 64).ravel()
    assert (scale[:64] == 1.0).all() and scale[64] > 1.3 and scale[199] > scale[128] > scale[64]
    tokens = _sequence("mistral3")  # 86 tokens: past 64
    with llmfw.load_model(files("mistral3"), backend="numpy") as model:
        want = decode_all(model, tokens, n_ctx=512)
    overrides = {"mistral3.attention.temperature_scale": 0.0}
    with llmfw.load_model(files("mistral3"), backend="numpy", kv_overrides=overrides) as model:
        got = decode_all(model, tokens, n_ctx=512)
    assert np.abs(got[:64] - want[:64]).max() <= SAME_LOGITS_ATOL
    assert np.abs(got[64:] - want[64:]).max() > 0.05


def test_mistral3_yarn_log_multiplier_sets_the_rope_magnitude(files):
    with llmfw.load_model(files("mistral3"), backend="numpy") as model:
        params = model.arch.rope_params(model.hparams, 0)
    # factor 4, m = 1: 1 / (1 + 0.1 ln 4); ggml's own YaRN magnitude 1 + 0.1 ln 4 cancels it
    assert params.attn_factor == pytest.approx(1.0 / (1.0 + 0.1 * np.log(4.0)))
    assert params.ext_factor == 1.0
