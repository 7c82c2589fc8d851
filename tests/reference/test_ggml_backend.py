"""The "ggml" backend (numpy + llama.cpp's CPU roundings) on SmolLM2 against llama.cpp's reference outputs.

Kernel tests check the emulated arithmetic against independent computations (the gguf package's quantizer, an
integer block-by-block dot product like ``ggml_vec_dot_q4_1_q8_1``); model tests check the reference bar and
greedy agreement with llama.cpp's continuations.
"""
from __future__ import annotations

import numpy as np
import pytest

import llmfw
from llmfw.core.quants import GGMLType
from llmfw.plugins.backends.ggml_cpu import (
    GgmlMatrix,
    _scaled_part,
    ggml_gelu,
    q8_1_block_sums,
    quantize_q8,
    quantize_q8_k,
    round_bf16,
    round_f16,
)

from support.scores import BAR

#: llama.cpp's top-two gap under which the ggml backend may pick llama.cpp's second choice. The same bound as
#: the numpy backend's test, on purpose: with 8-bit activations a ±1-ulp change of the input embeddings alone
#: moves log-probs by ~0.1 on average (measured), so which near-tie flips is chance, not a property to pin.
#: (Measured today: prompts 1 and 2 match all the way, 0 and 3 first differ where llama.cpp's gap is 0.19 / 0.10.)
NEAR_TIE_GAP = 0.5


# ---------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------

def test_q8_activation_quantization_matches_ggml_q8_0():
    gguf_quants = pytest.importorskip("gguf.quants")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 576)) * rng.uniform(0.01, 30, (16, 1))).astype(np.float32)
    x[3, :32] = 0.0  # an all-zero block quantizes to zeros
    ours, _, _ = quantize_q8(x)
    reference = gguf_quants.dequantize(gguf_quants.quantize(x, GGMLType.Q8_0), GGMLType.Q8_0)
    # ggml's reference rounds x * (1/d) half away from zero, AVX2 x * (127/amax) to even: they may differ by
    # one step on a rare element whose product lands within an ulp of a half
    differs = ours != reference
    assert differs.mean() < 1e-3
    assert np.all(ours[3, :32] == 0.0)


def test_q8_1_block_sums_use_the_unrounded_scale():
    x = np.linspace(-1.0, 3.0, 64, dtype=np.float32).reshape(1, 64)
    xq, sums, d = quantize_q8(x)
    assert np.array_equal(sums, np.rint(xq.reshape(1, 2, 32) / d.astype(np.float16).astype(np.float32)).sum(-1))
    s = q8_1_block_sums(sums, d)
    np.testing.assert_array_equal(s, (d[..., 0] * sums).astype(np.float16).astype(np.float32))


def test_q8_k_maps_the_largest_magnitude_to_minus_127():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    q = quantize_q8_k(x).reshape(2, 2, 256)
    blocks = x.reshape(2, 2, 256)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
    d = (1.0 / (np.float32(-127.0) / peak)).astype(np.float32)
    codes = np.rint(q / d)
    assert np.all(codes >= -127) and np.all(codes <= 127)
    assert np.allclose(np.abs(q).max(-1, keepdims=True), np.abs(peak), rtol=1e-6)


def test_round_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5], dtype=np.float32)
    np.testing.assert_array_equal(round_bf16(x), np.array([1.0, 1.0, 1.0 + 2 ** -6, -2.5], dtype=np.float32))


def test_round_f16_equals_numpy_half_conversion():
    rng = np.random.default_rng(3)
    samples = [rng.random(4096, dtype=np.float32) ** 12,  # probabilities, many f16 subnormals
               (rng.standard_normal(4096) * 50).astype(np.float32),
               np.array([0.0, -0.0, 2 ** -25, 3 * 2 ** -25, -(2 ** -25), 65504, 1e5, -np.inf, np.nan], np.float32)]
    for x in samples:
        with np.errstate(over="ignore"):
            expected = x.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(round_f16(x), expected)


def _ggml_gelu_table() -> np.ndarray:
    """ggml_cpu_init's ``ggml_table_gelu_f16``: for each of the 65536 f16 bit patterns, f16(tanh-GELU(value))."""
    values = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        gelu = 0.5 * values * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * values * (1.0 + 0.044715 * values * values)))
    return gelu.astype(np.float16)


def test_gelu_is_ggml_f16_table_lookup():
    table = _ggml_gelu_table()
    rng = np.random.default_rng(5)
    x = np.concatenate([(rng.standard_normal(20000) * 4).astype(np.float32),
                        np.array([-10.0, -9.999, 0.0, 9.999, 10.0, 12.5, -30.0], np.float32)])
    inside = (x > -10) & (x < 10)
    expected = np.where(x >= 10, x, 0.0).astype(np.float32)
    expected[inside] = table[x[inside].astype(np.float16).view(np.uint16)].astype(np.float32)
    got = ggml_gelu(x)
    # ggml fills its table in float32 (tanhf), this test in float64: for x < -3 ``1 + tanh(..)`` cancels and the
    # float32 value keeps few correct bits (absolute error < 1e-6); elsewhere both give the same f16 but where the
    # float32 value lands next to an f16 rounding tie (one f16 ulp apart, ~0.1 % of the samples)
    clean = np.abs(expected) > 1e-3
    ulp = np.spacing(expected[clean].astype(np.float16)).astype(np.float32)
    apart = np.abs(got[clean] - expected[clean])
    assert np.all(apart <= ulp) and np.mean(apart > 0) < 0.005
    np.testing.assert_allclose(got[~clean], expected[~clean], rtol=0, atol=1e-6)
    assert not np.array_equal(got[clean], x[clean])  # not the identity: the table was applied
    assert list(got[-7:][[0, 4, 5, 6]]) == [0.0, 10.0, 12.5, 0.0]  # outside (-10, 10): 0 below, x above


def _q4_1_blocks(raw: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """d, m [rows, nb] and the 4-bit codes [rows, nb, 32] of a Q4_1 matrix, decoded independently."""
    blocks = raw.reshape(n_rows, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
    return d, m, codes


def test_q4_1_matmul_equals_ggml_integer_dot_product(smollm2_path):
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(smollm2_path))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
    ne = tuple(int(n) for n in tensor.shape)
    scaled, block_min = _scaled_part(raw, GGMLType.Q4_1, ne)
    matrix = GgmlMatrix(scaled, block_min, "q8_1")
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, ne[0])) * 2).astype(np.float32)
    got = matrix.matmul(x)

    # ggml_vec_dot_q4_1_q8_1: Σ_blocks d_w·d_a·Σ(q_w·q_a) + m_w·s_a, integers exact
    d_w, m_w, q_w = _q4_1_blocks(raw, ne[1])
    xq, sums, d = quantize_q8(x)
    d_a = d[..., 0].astype(np.float16).astype(np.float64)
    q_a = np.rint(xq.reshape(3, -1, 32) / d_a[..., None]).astype(np.int64)
    s_a = q8_1_block_sums(sums, d).astype(np.float64)
    int_dot = np.einsum("tbk,obk->tob", q_a, q_w)
    expected = (d_w[None] * d_a[:, None] * int_dot).sum(-1) + (m_w[None] * s_a[:, None]).sum(-1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    # and without activation quantization it is the plain float32 product with the dequantized weight
    dense = scaled + np.repeat(block_min, 32, axis=1)
    np.testing.assert_allclose(matrix.matmul(x, quantize=False), x @ dense.T, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# SmolLM2 against llama.cpp
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(shared_models):
    return shared_models.get("smollm2", "ggml")


#: the 2,727-token prompt takes ~2x the numpy backend's time (f16 roundings of the attention probabilities)
@pytest.mark.parametrize("index", [0, 1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_teacher_forced_logits_clear_the_bar(model, smollm2_ref, score, index):
    record = smollm2_ref["prompts"][index]
    sequence = record["sequence"]
    ctx = model.new_context(n_ctx=len(sequence), n_batch=len(sequence), n_ubatch=512, n_threads=1)
    assert ctx.decode(llmfw.Batch(sequence, logits=True)) == 0, ctx.last_error
    result = score(record, ctx.get_logits())
    print(f"\nggml backend, prompt {index} ({len(sequence)} tokens): {result}")
    for key in ("top1", "top5"):
        assert result[key] >= BAR[key], (index, result)
    assert result["mean_lp_err"] <= BAR["mean_lp_err"], (index, result)


@pytest.mark.parametrize("index", range(4))
def test_greedy_continuation_follows_llama_cpp(model, smollm2_ref, index):
    record = smollm2_ref["prompts"][index]
    prompt = record["prompt_ids"]
    expected = record["sequence"][len(prompt):]
    ctx = model.new_context(n_ctx=512, n_threads=1)
    assert ctx.decode(llmfw.Batch(prompt)) == 0
    for i, want in enumerate(expected):
        got = int(ctx.get_logits_ith(-1).argmax())
        if got != want:
            position = record["positions"][len(prompt) + i - 1]
            top, ids = position["top_logits"], position["top_ids"]
            assert top[0] - top[1] < NEAR_TIE_GAP, f"prompt {index}: diverged at token {i}: {got} != {want}"
            assert got == ids[1], f"prompt {index}: diverged at token {i} to {got}, not llama.cpp's second"
            return
        if model.vocab.is_eog(got):
            break
        assert ctx.decode(llmfw.Batch([got])) == 0, ctx.last_error
