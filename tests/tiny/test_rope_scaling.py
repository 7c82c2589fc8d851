"""The llama architecture's RoPE scaling types against llama.cpp (issue 4), on small random-weight files.

``tests/reference_gen`` writes three llama files that differ only in how they scale RoPE, each as llama.cpp's
converter writes it: ``linear`` (``rope.scaling.type`` + ``factor``), ``yarn`` (+ ``original_context_length``
and ``rope.scaling.attn_factor``; prompts run past the 64-token original context, where YaRN's ramp matters)
and Llama-3.1's ``llama3`` (no type key, per-dimension divisors in ``rope_freqs.weight``).
``tests/data/arch/llama-rope-*.json`` hold llama.cpp's logits for those exact bytes.
"""
from __future__ import annotations

import numpy as np
import pytest

from reference_gen.arch_specs import SPECS
from reference_gen.arch_testing import assert_clears_bar, decode_all, longest, model_file, records, reference

import llmfw

SCALINGS = ["linear", "yarn", "llama3"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("rope")
    return lambda scaling: model_file(f"llama-rope-{scaling}", directory)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_scaled_rope_matches_llama_cpp(files, score, scaling):
    name = f"llama-rope-{scaling}"
    with llmfw.load_model(files(scaling), backend="numpy") as model:
        for record in records(reference(name)):
            assert_clears_bar(score, record, decode_all(model, record["sequence"], n_ctx=record["n_ctx"]), name)


def test_scaling_keys_reach_the_hyperparameters(files):
    with llmfw.load_model(files("linear"), backend="numpy", vocab_only=True) as model:
        assert model.hparams.rope_scaling_type == "linear" and model.hparams.rope_freq_scale_train == 0.25
    with llmfw.load_model(files("yarn"), backend="numpy", vocab_only=True) as model:
        hp = model.hparams
        assert (hp.rope_scaling_type, hp.n_ctx_orig_yarn, hp.rope_attn_factor) == ("yarn", 64, pytest.approx(0.8))
        assert hp.yarn_ext_factor_effective == 1.0 and hp.rope_freq_scale_train == 0.25
    with llmfw.load_model(files("llama3"), backend="numpy") as model:
        assert model.has_weight("blk.0.rope_freqs.weight") and model.hparams.rope_freq_scale_train == 1.0


@pytest.mark.parametrize("scaling", ["linear", "yarn"])
def test_the_reference_sees_the_scaling(files, score, scaling):
    """Decoding the same file with its scaling factor overridden to 1 misses llama.cpp's numbers: the comparison
    above really checks the scaling, not just the rest of the model."""
    name = f"llama-rope-{scaling}"
    record = longest(reference(name))
    with llmfw.load_model(files(scaling), backend="numpy",
                          kv_overrides={"llama.rope.scaling.factor": 1.0}) as model:
        unscaled = decode_all(model, record["sequence"], n_ctx=record["n_ctx"])
    result = score(record, unscaled)
    assert result["top1"] < 0.9 or result["mean_lp_err"] > 0.2, result
    assert np.isfinite(unscaled).all()


def test_run_time_llama3_factors_equal_the_files_bit_for_bit(files):
    """A Llama-3.1 file without ``rope_freqs`` gets its divisors computed at load; they must be the converter's
    exact float32 values on any CPU (no vectorised float32 power, whose last bits depend on AVX2 / AVX-512)."""
    from llmfw.core.gguf import open_gguf
    from llmfw.plugins.architectures.llama import llama3_rope_factors

    path = files("llama3")
    with open_gguf(path) as f:
        stored = np.array(f.tensor_array("rope_freqs.weight"), dtype=np.float32)
    scaling = SPECS["llama-rope-llama3"]["llama3_rope"]  # the converter's inputs, which the file does not keep
    with llmfw.load_model(path, backend="numpy", vocab_only=True) as model:
        hparams = model.hparams.model_copy(update={
            "rope_scaling_factor": scaling["factor"], "n_ctx_orig_yarn": scaling["original_max_position_embeddings"],
            "rope_llama3_low_freq_factor": scaling["low_freq_factor"],
            "rope_llama3_high_freq_factor": scaling["high_freq_factor"]})
        computed = llama3_rope_factors(hparams)
    assert computed.dtype == np.float32 and computed.tobytes() == stored.tobytes()
