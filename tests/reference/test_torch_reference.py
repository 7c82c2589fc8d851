"""The torch backend against llama.cpp: the same reference tests as the numpy backend.

* SmolLM2-135M (llama) and Gemma-3-270M (gemma3, sliding window, soft-capping off, GELU, q/k norms): every
  prompt teacher-forced with backend="torch" must clear the reference README's bar (top1 ≥ 0.93, top5 ≥ 0.98,
  mean_lp_err ≤ 0.25); greedy decoding through the reused one-token graph reproduces llama.cpp's continuation.
* The random-weight families of issue 6 (qwen2, qwen3, phi3, gemma2 with soft-capping, olmo, llama rope
  scalings: linear, yarn, llama3 freq factors) clear issue 6's bar on torch too, so nothing in the backend is
  llama-specific.
* CUDA: the same SmolLM2 test and the random-weight families on ``torch:cuda``, skipped without a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import llmfw  # noqa: E402
from reference_gen.arch_testing import assert_clears_bar as assert_clears_arch_bar  # noqa: E402
from reference_gen.arch_testing import decode_all, model_file, records, reference  # noqa: E402
from support.scores import BAR, combine_scores  # noqa: E402

SMOLLM2_PROMPTS = range(5)
FAMILIES = ["qwen2", "qwen3", "phi3", "gemma2", "olmo", "llama-rope-linear", "llama-rope-yarn", "llama-rope-llama3"]
#: ubatch size for the long teacher-forced runs: the 2,727-token prompt runs as 6 ubatches
N_UBATCH = 512


def assert_clears_bar(result: dict, label: str) -> None:
    for key in ("top1", "top5"):
        assert result[key] >= BAR[key], (label, result)
    assert result["mean_lp_err"] <= BAR["mean_lp_err"], (label, result)


def teacher_forced(model, sequence: list[int], n_ubatch: int = N_UBATCH) -> np.ndarray:
    ctx = model.new_context(n_ctx=len(sequence), n_batch=len(sequence), n_ubatch=n_ubatch, n_threads=2)
    assert ctx.decode(llmfw.Batch(sequence, logits=True)) == 0, ctx.last_error
    return ctx.get_logits()


def greedy(model, prompt: list[int], n_tokens: int) -> tuple[list[int], object]:
    n_ctx = max(512, len(prompt) + n_tokens)
    ctx = model.new_context(n_ctx=n_ctx, n_batch=n_ctx, n_threads=2)
    assert ctx.decode(llmfw.Batch(prompt)) == 0, ctx.last_error
    out: list[int] = []
    for _ in range(n_tokens):
        token = int(ctx.get_logits_ith(-1).argmax())
        out.append(token)
        if model.vocab.is_eog(token):
            break
        assert ctx.decode(llmfw.Batch([token])) == 0, ctx.last_error
    return out, ctx


def assert_greedy_matches(model, record: dict, generated: list[int]) -> None:
    """Equal to llama.cpp's continuation, or diverging only at one of llama.cpp's own near-ties (< 0.5 logits,
    to its second choice): its 8-bit activations legitimately flip those."""
    prompt, expected = record["prompt_ids"], record["sequence"][len(record["prompt_ids"]):]
    for i, (got, want) in enumerate(zip(generated, expected)):
        if got != want:
            position = record["positions"][len(prompt) + i - 1]
            assert position["top_logits"][0] - position["top_logits"][1] < 0.5, f"diverged at token {i}"
            assert got == position["top_ids"][1], f"diverged at token {i} to {got}, not llama.cpp's second choice"
            return
    assert generated == expected[:len(generated)]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    with llmfw.load_model(smollm2_path, backend="torch") as model:
        yield model


def test_weights_are_converted_once_to_the_device_form(smollm2) -> None:
    backend = smollm2.backends["torch"]
    assert backend.spec == "torch"
    linear = backend.linear("blk.0.ffn_down.weight")
    assert linear.form == backend.matmul_form
    # kept bytes: fp16 matmul weights, 2 bytes per parameter, but fbgemm pads a 576-wide input dimension to
    # 1024 (x1.78); small f32 norms. Less than float32's 4 bytes per parameter.
    n_params = sum(int(np.prod(w.shape)) for w in backend.weights.values())
    assert 2 * n_params < backend.weight_nbytes() < 3.6 * n_params


@pytest.mark.parametrize("index", SMOLLM2_PROMPTS)
def test_smollm2_teacher_forced_clears_the_bar(smollm2, smollm2_ref, score, index: int) -> None:
    record = smollm2_ref["prompts"][index]
    result = score(record, teacher_forced(smollm2, record["sequence"]))
    print(f"\nSmolLM2 torch prompt {index} ({len(record['sequence'])} tokens): {result}")
    assert_clears_bar(result, f"SmolLM2 prompt {index}")


def test_smollm2_greedy_decode_reuses_its_graph(smollm2, smollm2_ref) -> None:
    record = smollm2_ref["prompts"][0]
    expected = record["sequence"][len(record["prompt_ids"]):]
    generated, ctx = greedy(smollm2, record["prompt_ids"], len(expected))
    assert_greedy_matches(smollm2, record, generated)
    # one graph for the prompt, one for one-token decodes (rebuilt only when the padded KV length grows)
    assert ctx.n_graph_builds <= 4 and ctx.n_graph_reuses >= len(generated) - 4


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    with llmfw.load_model(gemma3_path, backend="torch") as model:
        yield model


@pytest.mark.parametrize("index", range(5))
@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_default_backend_greedy_follows_llama_cpp_on_every_prompt(request, model_name: str, index: int) -> None:
    """The default backend's greedy continuation of every reference prompt equals llama.cpp's up to one of its
    close calls (measured: SmolLM2 parts at reference gaps 0.33 / - / 0.275 / 0.035 / 0.051, Gemma-3 at 0.114 / - /
    0.087 / 0.049 / 0.16 — llama.cpp 0.3.36 rebuilt here parts from the reference at that same 0.16 token too,
    see benchmarks/llama_cpp_vs_reference.py)."""
    model = request.getfixturevalue(model_name)
    record = request.getfixturevalue(f"{model_name}_ref")["prompts"][index]
    expected = record["sequence"][len(record["prompt_ids"]):]
    generated, ctx = greedy(model, record["prompt_ids"], len(expected))
    ctx.close()
    assert_greedy_matches(model, record, generated)


def test_gemma3_teacher_forced_clears_the_bar(gemma3_path, gemma3_ref, score) -> None:
    with llmfw.load_model(gemma3_path, backend="torch") as model:
        for index, record in enumerate(gemma3_ref["prompts"]):
            sequence = record["sequence"]
            if len(sequence) > N_UBATCH:  # Gemma's 262k-row head: keep the logits of one long prompt modest
                continue
            result = score(record, teacher_forced(model, sequence))
            print(f"\nGemma-3 torch prompt {index} ({len(sequence)} tokens): {result}")
            assert_clears_bar(result, f"Gemma-3 prompt {index}")
        record = gemma3_ref["prompts"][0]
        generated, _ = greedy(model, record["prompt_ids"], 8)
        assert_greedy_matches(model, record, generated)


def test_gemma3_long_prompt_crosses_the_sliding_window(gemma3_path, gemma3_ref, score) -> None:
    """The 1,196-token prompt, past the 512-token window, in batches of 512 scored slice by slice (Gemma's
    262k-row head makes the whole logits matrix 1.25 GB)."""
    record = max(gemma3_ref["prompts"], key=lambda r: len(r["sequence"]))
    sequence = record["sequence"]
    assert len(sequence) > 2 * N_UBATCH
    with llmfw.load_model(gemma3_path, backend="torch") as model:
        ctx = model.new_context(n_ctx=2048, n_batch=N_UBATCH, n_ubatch=N_UBATCH, n_threads=2)
        parts = []
        for start in range(0, len(sequence), N_UBATCH):
            chunk = sequence[start:start + N_UBATCH]
            assert ctx.decode(llmfw.Batch(chunk, logits=True)) == 0, ctx.last_error
            positions = record["positions"][start:start + len(chunk)]
            parts.append((score({**record, "positions": positions}, ctx.get_logits()), positions))
    result = combine_scores(parts)
    print(f"\nGemma-3 torch long prompt ({len(sequence)} tokens): {result}")
    assert_clears_bar(result, "Gemma-3 long prompt")


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("arch_torch")


def assert_family_clears_its_bar(arch_dir, score, family: str, backend: str) -> None:
    from llmfw.core.plugins import registry

    arch = reference(family).get("arch", family.split("-")[0])
    if arch not in registry("architectures").names():
        pytest.skip(f"architecture {arch!r} is not registered in this checkout")
    with llmfw.load_model(model_file(family, arch_dir), backend=backend) as model:
        for record in records(reference(family)):
            logits = decode_all(model, record["sequence"], n_ctx=record["n_ctx"])
            assert_clears_arch_bar(score, record, logits, f"{family} on {backend}")


@pytest.mark.parametrize("family", FAMILIES)
def test_random_weight_families_clear_their_bar(arch_dir, score, family: str) -> None:
    assert_family_clears_its_bar(arch_dir, score, family, "torch")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_random_weight_families_on_cuda_clear_their_bar(arch_dir, score, family: str) -> None:
    assert_family_clears_its_bar(arch_dir, score, family, "torch:cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_smollm2_on_cuda_clears_the_bar(smollm2_path, smollm2_ref, score) -> None:
    with llmfw.load_model(smollm2_path, backend="torch:cuda") as model:
        assert model.backends["torch:cuda"].device.startswith("cuda")
        for index in SMOLLM2_PROMPTS:
            record = smollm2_ref["prompts"][index]
            assert_clears_bar(score(record, teacher_forced(model, record["sequence"])), f"cuda prompt {index}")
