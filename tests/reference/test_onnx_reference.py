"""The ONNX Runtime backend on the real models against llama.cpp's reference logits (tests/data/reference)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import llmfw

from support.scores import assert_within_bar, teacher_forced_logits


@pytest.fixture(scope="module")
def smollm2_onnx(shared_models):
    return shared_models.get("smollm2", "onnx")


def _prompt_ids(ref: dict, long: bool) -> list[int]:
    return [i for i, p in enumerate(ref["prompts"]) if (len(p["sequence"]) > 1000) == long]


@pytest.mark.parametrize("index", range(4))
def test_smollm2_prompts_within_bar(smollm2_onnx, smollm2_ref, score, index):
    prompts = _prompt_ids(smollm2_ref, long=False)
    if index >= len(prompts):
        pytest.skip("fewer short prompts in the reference file")
    record = smollm2_ref["prompts"][prompts[index]]
    assert_within_bar(score(record, teacher_forced_logits(smollm2_onnx, record["sequence"])), f"prompt {index}")


@pytest.mark.slow
def test_smollm2_long_prompt_across_ubatches_within_bar(smollm2_onnx, smollm2_ref, score):
    """2,727 tokens in ubatches of 512: later ubatches attend to cells written by earlier sessions runs."""
    for index in _prompt_ids(smollm2_ref, long=True):
        record = smollm2_ref["prompts"][index]
        assert_within_bar(score(record, teacher_forced_logits(smollm2_onnx, record["sequence"])), f"long {index}")


def test_smollm2_token_by_token_decode_within_bar(smollm2_onnx, smollm2_ref, score):
    """Prompt as one batch, then the continuation one token per decode (the tg path: T=1, growing n_kv);
    the decode graphs reuse their ONNX session instead of building one per token."""
    record = smollm2_ref["prompts"][0]
    prompt, sequence = record["prompt_ids"], record["sequence"]
    backend = smollm2_onnx.backends["onnx"]
    ctx = smollm2_onnx.new_context(n_ctx=512)
    assert ctx.decode(llmfw.Batch(tokens=prompt, logits=True)) == 0
    rows = [ctx.get_logits()]
    built_after_first_decode = None
    for token in sequence[len(prompt):]:
        assert ctx.decode(llmfw.Batch(tokens=[token])) == 0
        rows.append(ctx.get_logits_ith(-1)[None, :])
        if built_after_first_decode is None:
            built_after_first_decode = backend.sessions_built
    logits = np.concatenate(rows)  # row i: the logits at position i, exactly len(sequence) rows
    assert logits.shape == (len(sequence), smollm2_onnx.n_vocab)
    assert_within_bar(score(record, logits), "token by token")
    assert backend.sessions_built == built_after_first_decode, "a decode step rebuilt its ONNX session"


def test_smollm2_prompt_and_decode_share_one_session(smollm2_path, smollm2_ref, score):
    """A prompt decoded for its last logits only, the reference sequence teacher-forced with every logit, then
    its continuation one token per decode beside a second sequence: one ONNX session serves them all (ONNX
    Runtime prepacks every weight per session, so a second one would hold the weights twice), within the bar."""
    record = smollm2_ref["prompts"][0]
    prompt, sequence = record["prompt_ids"], record["sequence"]
    with llmfw.load_model(smollm2_path, backend="onnx") as model:
        backend = model.backends["onnx"]
        ctx = model.new_context(n_ctx=512, n_seq_max=2)
        assert ctx.decode(llmfw.Batch(tokens=prompt, seq_id=1)) == 0, ctx.last_error  # logits of the last only
        assert ctx.decode(llmfw.Batch(tokens=sequence[:len(prompt)], seq_id=0, logits=True)) == 0
        rows = [ctx.get_logits()]
        for step, token in enumerate(sequence[len(prompt):]):
            batch = llmfw.Batch(tokens=[token, prompt[step % len(prompt)]], seq_id=[0, 1], logits=True)
            assert ctx.decode(batch) == 0, ctx.last_error
            rows.append(ctx.get_logits_ith(0)[None, :])
        assert backend.sessions_built == 1
    assert_within_bar(score(record, np.concatenate(rows)), "prompt, then decode beside another sequence")


def _mixed_placement_clears_the_bar(path, ref, score, placement: dict[int, str], label: str) -> set[str]:
    """The shortest prompt teacher-forced through an onnx model with ``placement``; the backend classes its layers
    ended up on."""
    model = llmfw.load_model(path, backend="onnx", placement=placement)
    try:
        record = min(ref["prompts"], key=lambda p: len(p["sequence"]))
        assert_within_bar(score(record, teacher_forced_logits(model, record["sequence"])), label)
        return {type(model.backends[spec]).__name__ for spec in model.layer_specs}
    finally:
        model.close()


def test_smollm2_mixed_placement_numpy_and_onnx(smollm2_path, smollm2_ref, score):
    """Layers 0-2 and 27-29 on numpy, the rest and the output head on ONNX Runtime: values cross backends
    at four cuts per token, each layer's KV cache lives on its own backend."""
    placement = {il: "numpy" for il in (0, 1, 2, 27, 28, 29)}
    kinds = _mixed_placement_clears_the_bar(smollm2_path, smollm2_ref, score, placement, "mixed placement")
    assert kinds == {"NumpyBackend", "OnnxBackend"}


def test_smollm2_mixed_placement_torch_and_onnx(smollm2_path, smollm2_ref, score):
    """Layers 10-19 and the output head on torch, the rest on ONNX Runtime."""
    pytest.importorskip("torch")
    placement = {il: "torch" for il in range(10, 20)}
    placement[30] = "torch"  # layer n_layer = the output head
    kinds = _mixed_placement_clears_the_bar(smollm2_path, smollm2_ref, score, placement, "onnx + torch")
    assert kinds == {"TorchBackend", "OnnxBackend"}
