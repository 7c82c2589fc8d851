"""Tensors llama.cpp creates with ``TENSOR_NOT_REQUIRED`` / ``TENSOR_DUPLICATED`` (``src/models/<arch>.cpp``,
``create_tensor_qkv``) are optional here too, for every family llmfw ships.

Each test writes a variant of a random-weight family file (tests/reference_gen/variant_files.py; the family file
itself is the one llama.cpp measured, sha256-checked) that omits the optional tensors, and a second variant
that holds their neutral value instead (rope factors of 1, zero biases, the head as a copy of the embedding,
separate Q/K/V for a fused attn_qkv): both must load and give the same logits, and the omission must matter
where the tensor is not neutral in the original. A tensor that is required still fails the load, by name.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from reference_gen.arch_testing import SPECS, decode_all, longest, model_file, reference
from reference_gen.variant_files import float_tensor, fused_qkv_edits, tensor_names, write_variant

import llmfw
from llmfw.core.errors import ModelError

SAME = 1e-4  # two files holding the same numbers decode to the same logits up to float rounding
N_TOKENS = 40


@pytest.fixture(scope="module")
def family_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("families")
    built = {}
    return lambda name: built.setdefault(name, model_file(name, directory))


@pytest.fixture
def variant(tmp_path):
    return lambda source, label, **edits: write_variant(source, tmp_path / f"{label}.gguf", **edits)


def logits(path, family: str) -> np.ndarray:
    record = longest(reference(family))
    with llmfw.load_model(path, backend="numpy") as model:
        return decode_all(model, record["sequence"][:N_TOKENS], n_ctx=record["n_ctx"])


def test_phi3_without_rope_factors_runs_unscaled_rope(family_file, variant):
    # a Phi-3-mini-4k file: no rope_factors_long / _short (llama.cpp: TENSOR_NOT_REQUIRED)
    source = family_file("phi3")
    factors = ("rope_factors_long.weight", "rope_factors_short.weight")
    without = variant(source, "phi3-4k", drop=factors)
    ones = variant(source, "phi3-ones", replace={name: np.ones_like(float_tensor(source, name)) for name in factors})
    assert not any(name.startswith("rope_factors") for name in tensor_names(without))
    got, neutral, original = logits(without, "phi3"), logits(ones, "phi3"), logits(source, "phi3")
    assert np.abs(got - neutral).max() <= SAME
    assert np.abs(got - original).max() > 0.1  # the long factors of the original do change the logits


def test_qwen2_without_qkv_biases(family_file, variant):
    source = family_file("qwen2")
    biases = [name for name in tensor_names(source) if name.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias"))]
    assert len(biases) == 3 * SPECS["qwen2"]["n_layer"]
    without = variant(source, "qwen2-nobias", drop=biases)
    zeros = variant(source, "qwen2-zero", replace={name: np.zeros_like(float_tensor(source, name)) for name in biases})
    got = logits(without, "qwen2")
    assert np.abs(got - logits(zeros, "qwen2")).max() <= SAME
    assert np.abs(got - logits(source, "qwen2")).max() > 0.1


@pytest.mark.parametrize("family", ["qwen3", "phi3", "llama-rope-linear"])
def test_without_output_weight_the_head_is_the_embedding(family_file, variant, family):
    source = family_file(family)
    tied = variant(source, f"{family}-tied", drop=["output.weight"])
    copied = variant(source, f"{family}-copied", drop=["output.weight"], raw_copies={"output.weight": "token_embd.weight"})
    with llmfw.load_model(tied, backend="numpy") as model:
        assert model.weight_sources["output.weight"][0] == "token_embd.weight"
    assert np.abs(logits(tied, family) - logits(copied, family)).max() <= SAME


@pytest.mark.parametrize("family", ["llama-rope-linear", "qwen3", "gemma2"])
def test_fused_qkv_instead_of_separate_projections(family_file, variant, family):
    source = family_file(family)
    separate, fused, names = fused_qkv_edits(source, SPECS[family]["n_layer"])
    as_separate = variant(source, f"{family}-separate", replace=separate)
    as_fused = variant(source, f"{family}-fused", drop=names, replace=fused)
    assert "blk.0.attn_q.weight" not in tensor_names(as_fused)
    assert np.abs(logits(as_fused, family) - logits(as_separate, family)).max() <= SAME


def test_phi3_with_separate_qkv(family_file, variant):
    source = family_file("phi3")
    n_q = SPECS["phi3"]["n_embd"]
    n_kv = n_q * SPECS["phi3"]["n_head_kv"] // SPECS["phi3"]["n_head"]
    separate, fused = {}, {}
    for il in range(SPECS["phi3"]["n_layer"]):
        qkv = float_tensor(source, f"blk.{il}.attn_qkv.weight")
        fused[f"blk.{il}.attn_qkv.weight"] = qkv
        for part, rows in zip("qkv", np.split(qkv, [n_q, n_q + n_kv])):
            separate[f"blk.{il}.attn_{part}.weight"] = rows
    as_fused = variant(source, "phi3-fused-f32", replace=fused)
    as_separate = variant(source, "phi3-separate", drop=list(fused), replace=separate)
    assert np.abs(logits(as_separate, "phi3") - logits(as_fused, "phi3")).max() <= SAME


@pytest.mark.parametrize("family, dropped, message", [
    ("llama-rope-linear", ["blk.1.attn_q.weight"], "missing tensor 'blk.1.attn_q.weight' \\(nor 'blk.1.attn_qkv"),
    ("phi3", ["blk.0.attn_qkv.weight"], "missing tensor 'blk.0.attn_q.weight' \\(nor 'blk.0.attn_qkv"),
    ("qwen2", ["blk.2.ffn_down.weight"], "missing tensor 'blk.2.ffn_down.weight'"),
    ("gemma2", ["blk.0.post_attention_norm.weight"], "missing tensor 'blk.0.post_attention_norm.weight'"),
])
def test_a_required_tensor_still_fails_by_name(family_file, variant, family, dropped, message):
    broken = variant(family_file(family), f"{family}-broken", drop=dropped)
    with pytest.raises(ModelError, match=message):
        llmfw.load_model(broken, backend="numpy")


LLAMA_PYTHON = os.environ.get("LLMFW_LLAMA_PYTHON")
LLAMA_LOGITS = Path(__file__).resolve().parents[1] / "reference_gen" / "llamacpp_logits.py"


def _variants_for_llama_cpp(family_file, variant) -> dict[str, tuple[Path, str]]:
    """The variants llama.cpp must load too: label -> (file, family)."""
    phi3, qwen2, llama = family_file("phi3"), family_file("qwen2"), family_file("llama-rope-linear")
    biases = [n for n in tensor_names(qwen2) if n.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias"))]
    separate, fused, names = fused_qkv_edits(llama, SPECS["llama-rope-linear"]["n_layer"])
    return {
        "phi3-4k": (variant(phi3, "phi3-4k", drop=["rope_factors_long.weight", "rope_factors_short.weight"]), "phi3"),
        "qwen2-nobias": (variant(qwen2, "qwen2-nobias", drop=biases), "qwen2"),
        "qwen2-tied": (variant(qwen2, "qwen2-tied", drop=["output.weight"]), "qwen2"),
        "llama-fused": (variant(llama, "llama-fused", drop=names, replace=fused), "llama-rope-linear"),
    }


@pytest.mark.skipif(not LLAMA_PYTHON, reason="opt-in: set LLMFW_LLAMA_PYTHON to a python with llama-cpp-python "
                                             "0.3.36 to compare the variants with llama.cpp")
def test_variants_match_llama_cpp(family_file, variant, tmp_path):
    for label, (path, family) in _variants_for_llama_cpp(family_file, variant).items():
        record = longest(reference(family))
        tokens = record["sequence"][:N_TOKENS]
        out = tmp_path / f"{label}.npy"
        subprocess.run([LLAMA_PYTHON, str(LLAMA_LOGITS), str(path), str(record["n_ctx"]), json.dumps(tokens),
                        str(out)], check=True, capture_output=True, timeout=300)
        theirs, ours = np.load(out), logits(path, family)
        agree = float(np.mean(theirs.argmax(-1) == ours.argmax(-1)))
        lp_theirs = theirs - np.logaddexp.reduce(theirs, axis=-1, keepdims=True)
        lp_ours = ours - np.logaddexp.reduce(ours, axis=-1, keepdims=True)
        top = theirs.argmax(-1)[:, None]
        lp_err = float(np.mean(np.abs(np.take_along_axis(lp_theirs - lp_ours, top, -1))))
        assert agree >= 0.9 and lp_err <= 0.2, (label, agree, lp_err)
