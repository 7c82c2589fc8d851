"""ONNX Runtime backend, op by op: weight packing (MatMulNBits) and every IR op against the numpy oracle."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from llmfw.core.backend import KVLayerShape, WeightSource
from llmfw.core.errors import BackendUnavailable, ModelError
from llmfw.core.graph import DYNAMIC, Graph
from llmfw.core.passes import optimize
from llmfw.core.quants import GGMLType, dequantize, quantize
from llmfw.core.rope import rope_angle_slopes, rope_cos_sin
from llmfw.plugins.backends.onnx import OnnxBackend
from llmfw.plugins.backends.onnx.weights import (
    BlockWeight, convert_weight, dequantize_block_weight, pack_nbits, requantize_8bit,
)

from support.onnx_harness import Harness

RNG = np.random.default_rng(1234)


def weight_source(name: str, values: np.ndarray, qtype: GGMLType, usage: set[str]) -> WeightSource:
    raw = quantize(values, qtype).reshape(-1).view(np.uint8)
    return WeightSource(name=name, source_name=name, ggml_type=int(qtype), ne=tuple(reversed(values.shape)),
                        raw=raw, usage=frozenset(usage))


# ---------------------------------------------------------------------------------------------------------------
# weight forms
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype,bits", [(GGMLType.Q4_0, 4), (GGMLType.Q4_1, 4), (GGMLType.Q8_0, 8),
                                        (GGMLType.Q5_0, 8), (GGMLType.Q5_1, 8)])
def test_exact_types_reproduce_ggml_values(qtype, bits):
    values = RNG.normal(size=(48, 96)).astype(np.float32)
    values[3, :32] = 0.0  # an all-zero block (scale 0) must not produce NaNs
    source = weight_source("w", values, qtype, {"mul_mat", "get_rows"})
    weight = convert_weight(source)
    assert isinstance(weight, BlockWeight) and weight.exact and weight.bits == bits
    expected = dequantize(source.raw, qtype, source.ne)
    np.testing.assert_allclose(dequantize_block_weight(weight), expected, rtol=1e-6, atol=1e-7)


#: byte offsets of the f16 super-block scales in each K-quant block (the rest of a block may be any bytes)
K_QUANT_F16_FIELDS = {GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,), GGMLType.Q3_K: (108,),
                      GGMLType.Q2_K: (80, 82)}


def k_quant_source(name: str, qtype: GGMLType, n_out: int, n_in: int, usage: set[str]) -> WeightSource:
    """A K-quant tensor of random blocks (every byte pattern decodes) with small finite super-block scales."""
    from llmfw.core.quants import TYPE_INFO

    size = TYPE_INFO[qtype].type_size
    blocks = RNG.integers(0, 256, size=(n_out * n_in // 256, size), dtype=np.uint8)
    for offset in K_QUANT_F16_FIELDS[qtype]:
        scales = RNG.uniform(0.001, 0.01, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return WeightSource(name=name, source_name=name, ggml_type=int(qtype), ne=(n_in, n_out),
                        raw=blocks.reshape(-1), usage=frozenset(usage))


@pytest.mark.parametrize("qtype,bits,block,exact", [(GGMLType.Q4_K, 4, 32, True), (GGMLType.Q5_K, 8, 32, True),
                                                    (GGMLType.Q6_K, 8, 16, True), (GGMLType.Q3_K, 8, 32, False),
                                                    (GGMLType.Q2_K, 8, 32, False)])
def test_k_quants_map_exactly_or_requantize_closely(qtype, bits, block, exact):
    source = k_quant_source("w", qtype, 8, 512, {"mul_mat", "get_rows"})
    weight = convert_weight(source)
    assert (weight.bits, weight.block, weight.exact) == (bits, block, exact)
    want = dequantize(source.raw, qtype, source.ne)
    err = np.abs(dequantize_block_weight(weight) - want).max() / np.abs(want).max()
    assert err < (1e-6 if exact else 1e-2), err


def test_nibble_order_is_matmulnbits_order():
    # codes 0..31 of one block: MatMulNBits wants element 2i in the low nibble of byte i, 2i+1 in the high one
    codes = (np.arange(32, dtype=np.int16) % 16 - 8).astype(np.int8).reshape(1, 32)
    packed = pack_nbits(codes, 4)
    unsigned = codes.astype(np.int16).reshape(-1) + 8
    assert packed.shape == (1, 1, 16)
    assert [int(b) & 0xF for b in packed.reshape(-1)] == list(unsigned[0::2])
    assert [int(b) >> 4 for b in packed.reshape(-1)] == list(unsigned[1::2])


def test_requantized_8bit_error_is_small():
    values = RNG.normal(size=(16, 8, 32)).astype(np.float32) + 0.5  # skewed blocks: asymmetric helps
    for asymmetric in (False, True):
        w = requantize_8bit(values, (16, 256), asymmetric=asymmetric)
        err = np.abs(dequantize_block_weight(w) - values.reshape(16, 256)).max(axis=1)
        step = (values.max(axis=(1, 2)) - values.min(axis=(1, 2))) / 254 * (1 if asymmetric else 2)
        assert (err <= step * 0.5 + 1e-6).all()
        assert not w.exact


def test_float_weights_stay_dense():
    values = RNG.normal(size=(8, 32)).astype(np.float32)
    weight = convert_weight(weight_source("w", values, GGMLType.F16, {"mul_mat"}))
    np.testing.assert_allclose(weight.array, values.astype(np.float16).astype(np.float32))


# ---------------------------------------------------------------------------------------------------------------
# running graphs: the ONNX backend against the numpy oracle on identical weights and inputs
# ---------------------------------------------------------------------------------------------------------------

def inputs_of(graph: Graph, **values: np.ndarray) -> dict[str, np.ndarray]:
    for name in values:
        assert name in graph.inputs, name
    return values


def test_mul_mat_packing_exact_and_int8_activations_close():
    w = RNG.normal(size=(40, 64)).astype(np.float32)
    x = RNG.normal(size=(5, 64)).astype(np.float32)
    for qtype in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0):
        g = Graph()
        xi = g.leaf("input", "x", x.shape)
        g.outputs["y"] = g.add("mul_mat", g.leaf("weight", "w", w.shape), xi)
        for level, tol in ((0, 1e-5), (4, 3e-2)):
            h = Harness([weight_source("w", w, qtype, {"mul_mat"})], [], accuracy_level=level)
            got, want = h.run(g, {"x": x})
            rel = np.abs(got["y"] - want["y"]).max() / np.abs(want["y"]).max()
            assert rel < tol, (qtype.name, level, rel)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q5_K])
def test_k_quant_mul_mat_and_get_rows_run_exactly(qtype):
    """MatMulNBits with 16-element blocks (Q6_K) and offsets (Q4_K, Q5_K); rows looked up in the same form."""
    source = k_quant_source("w", qtype, 24, 256, {"mul_mat", "get_rows"})
    g = Graph()
    xi = g.leaf("input", "x", (3, 256))
    ids = g.leaf("input", "ids", (4,), "i32")
    w = g.leaf("weight", "w", (24, 256))
    g.outputs["y"] = g.add("mul_mat", w, xi)
    g.outputs["rows"] = g.add("get_rows", w, ids)
    h = Harness([source], [])
    got, want = h.run(g, {"x": RNG.normal(size=(3, 256)).astype(np.float32),
                          "ids": np.array([0, 23, 5, 5], np.int32)})
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-4 * np.abs(want["y"]).max())
    np.testing.assert_allclose(got["rows"], want["rows"], rtol=1e-6, atol=1e-7)


def test_fused_matmuls_match_separate_ones():
    """Q/K/V-style matmuls sharing an input, fused by the core pass on the weight ``fuse_weights`` stacked at load,
    run as one MatMulNBits; results equal the separate products (numpy's own fused GEMM)."""
    x = RNG.normal(size=(3, 64)).astype(np.float32)
    sizes = (32, 16, 16)
    sources = [weight_source(f"w{i}", RNG.normal(size=(n, 64)).astype(np.float32), GGMLType.Q4_1, {"mul_mat"})
               for i, n in enumerate(sizes)]
    g = Graph()
    xi = g.leaf("input", "x", (3, 64))
    for i, n in enumerate(sizes):
        g.outputs[f"y{i}"] = g.add("mul_mat", g.leaf("weight", f"w{i}", (n, 64)), xi)
    h = Harness(sources, [])
    separate, _ = h.run(g, {"x": x})
    parts = ("w0", "w1", "w2")
    assert h.onnx.fuse_weights("w0+w1+w2", parts) and h.numpy.fuse_weights("w0+w1+w2", parts)
    assert h.onnx.weights["w0+w1+w2"].shape == (64, 64)
    assert optimize(g, {parts: "w0+w1+w2"}, lambda name: None).fused_matmuls == 1
    h.compiled.clear()  # the graph changed: compile it again
    got, want = h.run(g, {"x": x})
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got[name], separate[name], rtol=1e-5, atol=1e-5)
    # a member alone afterwards (its arrays are now rows of the fused copy)
    single = Graph()
    xs = single.leaf("input", "x", x.shape)
    single.outputs["y1"] = single.add("mul_mat", single.leaf("weight", "w1", (sizes[1], 64)), xs)
    got_single, _ = h.run(single, {"x": x})
    np.testing.assert_allclose(got_single["y1"], want["y1"], rtol=1e-4, atol=1e-4)


def test_mixed_block_types_are_not_fused():
    sources = [weight_source("a", RNG.normal(size=(16, 64)).astype(np.float32), GGMLType.Q4_0, {"mul_mat"}),
               weight_source("b", RNG.normal(size=(16, 64)).astype(np.float32), GGMLType.Q8_0, {"mul_mat"})]
    h = Harness(sources, [])
    assert not h.onnx.fuse_weights("a+b", ("a", "b")) and "a+b" not in h.onnx.weights


def _layer_graph(sources: list[WeightSource], n_head: int, n_head_kv: int, head_dim: int, rope_attrs: dict,
                 softcap: float, use_factors: bool) -> Graph:
    """One transformer layer using every op of the IR, typed for any token count and KV length (DYNAMIC)."""
    g = Graph()
    weight_shapes = {source.name: tuple(reversed(source.ne)) for source in sources}

    def weight(name):
        return g.leaf("weight", name, weight_shapes[name], layer=0)

    tokens, pos = g.leaf("input", "tokens", (DYNAMIC,), "i32"), g.leaf("input", "pos", (DYNAMIC,), "i32")
    kv_idx = g.leaf("input", "kv_idx:kv", (DYNAMIC,), "i64")
    mask = g.leaf("input", "kq_mask:kv", (DYNAMIC, DYNAMIC))
    x = g.add("get_rows", weight("token_embd.weight"), tokens)
    h = g.add("mul", g.add("rms_norm", x, eps=1e-5), weight("attn_norm.weight"))
    q = g.add("reshape", g.add("mul_mat", weight("attn_q.weight"), h), shape=(-1, n_head, head_dim))
    k = g.add("reshape", g.add("mul_mat", weight("attn_k.weight"), h), shape=(-1, n_head_kv, head_dim))
    v = g.add("reshape", g.add("mul_mat", weight("attn_v.weight"), h), shape=(-1, n_head_kv, head_dim))
    rope_inputs = (pos, weight("rope_freqs.weight")) if use_factors else (pos,)
    q = g.add("rope", q, *rope_inputs, **rope_attrs)
    k = g.add("rope", k, *rope_inputs, **rope_attrs)
    attn = g.add("attention", q, k, v, kv_idx, mask, layer=0, cache="kv", scale=head_dim ** -0.5, softcap=softcap)
    attn.attrs["layer"] = 0  # Graph.add takes `layer` as the owner; the builder also records it in attrs
    x = g.add("add", x, g.add("mul_mat", weight("attn_output.weight"), attn))
    h = g.add("norm", x, eps=1e-6)
    up = g.add("mul_mat", weight("ffn_up.weight"), h)
    gate = g.add("gelu", g.add("mul_mat", weight("ffn_gate.weight"), h))
    act = g.add("mul", g.add("silu", up), gate)
    x = g.add("sub", x, g.add("scale", g.add("mul_mat", weight("ffn_down.weight"), act), s=0.5))
    x = g.add("clamp", g.add("relu", x), min=-1.0, max=3.0)
    x = g.add("softcap", g.add("slice", x, axis=-1, start=0, stop=x_dim(n_head, head_dim)), cap=2.0)
    g.outputs["logits"] = g.add("mul_mat", weight("output.weight"), x)
    return g


def x_dim(n_head: int, head_dim: int) -> int:
    return n_head * head_dim


def _layer_sources(n_embd: int, n_head: int, n_head_kv: int, head_dim: int, n_ff: int, n_vocab: int,
                   n_dims: int) -> list[WeightSource]:
    def mat(rows, cols, scale=0.2):
        return (RNG.normal(size=(rows, cols)) * scale).astype(np.float32)

    return [
        weight_source("token_embd.weight", mat(n_vocab, n_embd, 1.0), GGMLType.Q8_0, {"get_rows"}),
        weight_source("attn_norm.weight", (1 + mat(1, n_embd)).reshape(-1), GGMLType.F32, {"mul"}),
        weight_source("attn_q.weight", mat(n_head * head_dim, n_embd), GGMLType.Q4_0, {"mul_mat"}),
        weight_source("attn_k.weight", mat(n_head_kv * head_dim, n_embd), GGMLType.Q4_0, {"mul_mat"}),
        weight_source("attn_v.weight", mat(n_head_kv * head_dim, n_embd), GGMLType.Q4_0, {"mul_mat"}),
        weight_source("attn_output.weight", mat(n_embd, n_head * head_dim), GGMLType.Q4_1, {"mul_mat"}),
        weight_source("ffn_up.weight", mat(n_ff, n_embd), GGMLType.Q5_0, {"mul_mat"}),
        weight_source("ffn_gate.weight", mat(n_ff, n_embd), GGMLType.Q5_1, {"mul_mat"}),
        weight_source("ffn_down.weight", mat(n_embd, n_ff), GGMLType.Q8_0, {"mul_mat"}),
        weight_source("output.weight", mat(n_vocab, n_embd), GGMLType.F16, {"mul_mat"}),
        weight_source("rope_freqs.weight", (1 + np.arange(n_dims // 2) / 8).astype(np.float32), GGMLType.F32,
                      {"rope"}),
    ]


ROPE_CASES = {
    "norm-full": dict(n_dims=32, mode="norm", freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0,
                      beta_fast=32.0, beta_slow=1.0, n_ctx_orig=4096),
    "neox-partial-yarn": dict(n_dims=16, mode="neox", freq_base=500000.0, freq_scale=0.25, ext_factor=1.0,
                              attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, n_ctx_orig=2048),
    "norm-partial": dict(n_dims=24, mode="norm", freq_base=1e6, freq_scale=0.5, ext_factor=0.0, attn_factor=0.9,
                         beta_fast=32.0, beta_slow=1.0, n_ctx_orig=2048),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
@pytest.mark.parametrize("use_factors", [False, True])
def test_onnx_rope_angles_are_the_core_rope_tables(case, use_factors):
    """One RoPE derivation: the per-pair slopes the ONNX graph multiplies positions by (core.rope's
    rope_angle_slopes, YaRN ramp included) give ggml's cos/sin tables (core.rope's rope_cos_sin) up to 8k."""
    attrs = ROPE_CASES[case]
    factors = (1 + np.arange(attrs["n_dims"] // 2) / 8).astype(np.float32) if use_factors else None
    pos = np.array([0, 1, 7, 100, 2047, 8191], dtype=np.int32)
    slope, mscale = rope_angle_slopes(freq_factors=factors, **attrs)
    theta = pos[:, None].astype(np.float32) * slope
    want_cos, want_sin = rope_cos_sin(pos, freq_factors=factors, **attrs)
    np.testing.assert_allclose(np.cos(theta) * np.float32(mscale), want_cos, atol=2e-3)
    np.testing.assert_allclose(np.sin(theta) * np.float32(mscale), want_sin, atol=2e-3)
    plain_cos, _ = rope_cos_sin(pos, freq_factors=factors, **{**attrs, "ext_factor": 0.0, "freq_scale": 1.0})
    if attrs["ext_factor"] or attrs["freq_scale"] != 1.0:  # the scaling is visible, so agreeing means something
        assert np.abs(plain_cos - want_cos).max() > 0.1


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
@pytest.mark.parametrize("softcap,use_factors", [(0.0, False), (30.0, True)])
def test_layer_graph_matches_numpy_over_decode_steps(case, softcap, use_factors):
    """Prefill 5 tokens, then decode 2 one by one: logits and the KV cache contents agree with numpy; the
    prefill and the decode graphs share nothing but the ONNX sessions are built once per structure."""
    n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_cells = 64, 4, 2, 32, 96, 50, 16
    rope = ROPE_CASES[case]
    sources = _layer_sources(n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, rope["n_dims"])
    h = Harness(sources, [KVLayerShape("kv", 0, n_cells, n_head_kv, head_dim, head_dim)])
    g = _layer_graph(sources, n_head, n_head_kv, head_dim, rope, softcap, use_factors)
    steps = [np.arange(5), np.array([5]), np.array([6])]
    for step, pos in enumerate(steps):
        n_kv = 8 if step < 2 else 16  # padded like llama.cpp; the same session serves both lengths
        mask = np.full((len(pos), n_kv), -np.inf, np.float32)
        for t, p in enumerate(pos):
            mask[t, :p + 1] = 0.0
        got, want = h.run(g, inputs_of(
            g, tokens=RNG.integers(0, n_vocab, len(pos)).astype(np.int32), pos=(pos + 100).astype(np.int32),
            **{"kv_idx:kv": pos.astype(np.int64), "kq_mask:kv": mask}))
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=2e-4, atol=2e-4)
    onnx_kv, numpy_kv = h.kv[h.onnx][("kv", 0)], h.kv[h.numpy][("kv", 0)]
    np.testing.assert_allclose(onnx_kv.k, numpy_kv.k, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(onnx_kv.v, numpy_kv.v, rtol=1e-4, atol=1e-5)
    assert np.abs(onnx_kv.k[:, 7:]).max() == 0.0  # cells never written stay zero
    assert h.onnx.sessions_built == 1


def test_dynamic_token_axis_takes_the_input_arrays_size():
    """The translator reads shapes from the IR; a DYNAMIC dimension of a split input is the array's own size,
    so one typed graph serves several token counts."""
    w = RNG.normal(size=(24, 256)).astype(np.float32)
    g = Graph()
    xi = g.leaf("input", "x", (DYNAMIC, 256))
    g.outputs["y"] = g.add("mul_mat", g.leaf("weight", "w", w.shape), xi)
    assert g.outputs["y"].shape == (DYNAMIC, 24)
    h = Harness([weight_source("w", w, GGMLType.Q4_1, {"mul_mat"})], [])
    for n_tokens in (3, 1):
        got, want = h.run(g, {"x": RNG.normal(size=(n_tokens, 256)).astype(np.float32)})
        assert got["y"].shape == (n_tokens, 24)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-4 * np.abs(want["y"]).max())


def test_untyped_or_misfit_inputs_are_model_errors():
    w = RNG.normal(size=(8, 32)).astype(np.float32)
    h = Harness([weight_source("w", w, GGMLType.Q8_0, {"mul_mat"})], [])
    untyped = Graph()
    x = untyped.inputs["x"] = untyped.add_node("input", (), {"name": "x"})  # a leaf given no type
    untyped.outputs["y"] = untyped.add("mul_mat", untyped.leaf("weight", "w", w.shape), x)
    with pytest.raises(ModelError, match="untyped"):
        h.run(untyped, {"x": np.ones((2, 32), np.float32)})
    typed = Graph()
    typed.outputs["y"] = typed.add("mul_mat", typed.leaf("weight", "w", w.shape),
                                   typed.leaf("input", "x", (DYNAMIC, 32)))
    with pytest.raises(ModelError, match="got an array of shape"):
        h.run(typed, {"x": np.ones(32, np.float32)})


def test_k_shift_rotates_cache_in_place():
    n_head_kv, head_dim, n_cells = 2, 16, 8
    shape = KVLayerShape("kv", 3, n_cells, n_head_kv, head_dim, head_dim)
    h = Harness([], [shape])
    k = RNG.normal(size=(n_head_kv, n_cells, head_dim)).astype(np.float32)
    for backend in (h.onnx, h.numpy):
        h.kv[backend][("kv", 3)].k[:] = k
    g = Graph()
    shift = g.leaf("input", "k_shift:kv", (DYNAMIC,), "i32")
    g.add("k_shift", shift, layer=3, cache="kv", **ROPE_CASES["neox-partial-yarn"]).attrs["layer"] = 3
    h.run(g, {"k_shift:kv": np.array([0, -1, 2, 3, 0, 5], np.int32)})
    onnx_k, numpy_k = h.kv[h.onnx][("kv", 3)].k, h.kv[h.numpy][("kv", 3)].k
    np.testing.assert_allclose(onnx_k, numpy_k, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(onnx_k[:, 6:], k[:, 6:])  # cells past n_kv untouched
    assert not np.allclose(onnx_k[:, 1:4], k[:, 1:4])


# ---------------------------------------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------------------------------------

def test_unknown_device_is_unavailable():
    with pytest.raises(BackendUnavailable, match="unknown device"):
        OnnxBackend.check_available("tpu")


def test_without_onnxruntime_choosing_it_names_the_extra():
    script = textwrap.dedent("""
        import sys
        sys.modules["onnxruntime"] = None  # as if it were not installed
        from llmfw.core.backend import create_backend
        from llmfw.core.errors import BackendUnavailable
        try:
            create_backend("onnx")
        except BackendUnavailable as exc:
            print("UNAVAILABLE:", exc)
    """)
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert "UNAVAILABLE:" in result.stdout, result.stdout + result.stderr
    assert "pip install onnxruntime onnx" in result.stdout


def test_thread_count_change_rebuilds_sessions_with_same_results():
    w = RNG.normal(size=(16, 64)).astype(np.float32)
    g = Graph()
    xi = g.leaf("input", "x", (2, 64))
    g.outputs["y"] = g.add("silu", g.add("mul_mat", g.leaf("weight", "w", w.shape), xi))
    h = Harness([weight_source("w", w, GGMLType.Q8_0, {"mul_mat"})], [])
    x = RNG.normal(size=(2, 64)).astype(np.float32)
    first, _ = h.run(g, {"x": x})
    again, _ = h.run(g, {"x": x})
    assert h.onnx.sessions_built == 1
    h.onnx.set_n_threads(1)
    after, _ = h.run(g, {"x": x})
    assert h.onnx.sessions_built == 2
    np.testing.assert_array_equal(first["y"], again["y"])
    np.testing.assert_allclose(after["y"], first["y"], rtol=1e-6, atol=1e-6)


def test_cuda_without_its_execution_provider_is_unavailable():
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA execution provider")
    with pytest.raises(BackendUnavailable, match="CUDAExecutionProvider"):
        OnnxBackend.check_available("cuda")


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0])
def test_blocks_repacked_directly_equal_the_packed_codes(qtype):
    """A matmul-only Q4_0 / Q4_1 / Q8_0 matrix goes from the file's bytes to MatMulNBits' layout without the int8
    code matrix; the bytes are those the codes would pack to, and the matrix is ggml's."""
    values = RNG.normal(size=(40, 128)).astype(np.float32)
    matmul_only = convert_weight(weight_source("w", values, qtype, {"mul_mat"}))
    with_codes = convert_weight(weight_source("w", values, qtype, {"mul_mat", "get_rows"}))
    assert matmul_only.codes is None
    np.testing.assert_array_equal(matmul_only.packed, pack_nbits(with_codes.codes, with_codes.bits))
    np.testing.assert_array_equal(matmul_only.packed, with_codes.packed)
    source = weight_source("w", values, qtype, {"mul_mat"})
    np.testing.assert_allclose(dequantize_block_weight(matmul_only), dequantize(source.raw, qtype, source.ne),
                               rtol=1e-6, atol=1e-7)
