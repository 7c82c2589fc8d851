"""The ONNX Runtime backend on every random-weight architecture file (tests/reference_gen) and on Gemma-3.

Two checks per model:

* against the numpy oracle with ``accuracy_level = 0`` (float activations in MatMulNBits): the weights map
  exactly, so the logits must agree to float rounding — this proves every op of every architecture;
* against llama.cpp's logits (``tests/data/arch/<model>.json``, when generated) with the default int8
  activations: the architecture bar of ``reference_gen/arch_testing.py``, also with two sequences in a batch.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from reference_gen.arch_files import DATA_DIR, build_model_file
from reference_gen.arch_specs import SPECS, prompt_text, reference_name
from reference_gen.arch_testing import (assert_clears_bar, decode_all, decode_two_sequences,
                                        model_file, records, reference)

import llmfw

MODELS = [name for name, spec in SPECS.items() if spec["arch"] != "olmo"]  # olmo lives in an example package
#: |onnx - numpy| on logits with float activations: only summation order differs
ORACLE_ATOL = 2e-3


def _has_reference(name: str) -> bool:
    return (DATA_DIR / reference_name(name)).is_file()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("onnx_arch")
    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = model_file(name, directory) if _has_reference(name) else build_model_file(name, directory)
        return built[name]

    return get


def _oracle_tokens(model, name: str) -> list[int]:
    longest = max(SPECS[name]["prompts"], key=lambda key: len(prompt_text(key)))
    return model.vocab.tokenize(prompt_text(longest), add_special=True, parse_special=True)


@pytest.mark.parametrize("name", MODELS)
def test_same_logits_as_numpy_with_float_activations(files, name):
    path = files(name)
    with llmfw.load_model(path, backend="numpy") as reference_model:
        tokens = _oracle_tokens(reference_model, name)
        want = decode_all(reference_model, tokens, n_ctx=512, n_ubatch=64)
    with llmfw.load_model(path, backend="onnx") as model:
        model.backends["onnx"].accuracy_level = 0
        got = decode_all(model, tokens, n_ctx=512, n_ubatch=64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= ORACLE_ATOL * max(1.0, float(np.abs(want).max()) / 10)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.97


@pytest.mark.parametrize("name", MODELS)
def test_llama_cpp_bar_with_int8_activations(files, score, name):
    if not _has_reference(name):
        pytest.skip(f"no llama.cpp reference for {name} yet (tests/reference_gen/README.md)")
    with llmfw.load_model(files(name), backend="onnx") as model:
        ref = reference(name)
        for record in records(ref):
            assert_clears_bar(score, record, decode_all(model, record["sequence"], n_ctx=record["n_ctx"]),
                              f"onnx {name}")
        first, second = records(ref, n_ctx=512)[:2]
        logits_a, logits_b = decode_two_sequences(model, first["sequence"], second["sequence"], n_ctx=512)
        assert_clears_bar(score, first, logits_a, f"onnx {name}, sequence 0 of 2")
        assert_clears_bar(score, second, logits_b, f"onnx {name}, sequence 1 of 2")
        # int8 activations turn the float rounding differences of another batch layout into whole quantization
        # steps now and then (so do llama.cpp's): close logits, not the same bits (those are checked with float
        # activations against numpy above)
        alone = decode_all(model, second["sequence"], n_ctx=512)
        assert np.abs(alone - logits_b).max() <= 0.05 * np.abs(alone).max()


# ---------------------------------------------------------------------------------------------------------------
# Gemma-3 270M (Q5_0 / Q8_0 / Q4_K / Q6_K; K-quants requantized to 8-bit blocks), sliding window 512
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3_onnx(shared_models):
    return shared_models.get("gemma3", "onnx")


def test_gemma3_prompts_within_bar(gemma3_onnx, gemma3_ref, score):
    for index, record in enumerate(gemma3_ref["prompts"]):
        sequence = record["sequence"]
        ctx = gemma3_onnx.new_context(n_ctx=max(1024, len(sequence) + 16), n_batch=len(sequence), n_ubatch=512)
        assert ctx.decode(llmfw.Batch(sequence, logits=True)) == 0, ctx.last_error
        result = score(record, ctx.get_logits())
        ctx.close()
        assert result["top1"] >= 0.93 and result["top5"] >= 0.98 and result["mean_lp_err"] <= 0.25, (index, result)
