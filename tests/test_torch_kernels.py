"""The torch backend's kernels and split compiler against the numpy backend (the oracle), op by op and on a small
hand-built graph with every rewrite the compiler does (fused QKV / gate-up, norm × weight, shared rope angles)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llmfw.core.backend import KVLayerShape, Split, WeightSource  # noqa: E402
from llmfw.core.errors import BackendUnavailable  # noqa: E402
from llmfw.core.graph import Graph  # noqa: E402
from llmfw.core.quants import GGMLType, dequantize  # noqa: E402
from llmfw.plugins.backends import numpy_cpu as oracle  # noqa: E402
from llmfw.core.architecture import RopeParams  # noqa: E402
from llmfw.plugins.backends.torch import TorchBackend  # noqa: E402
from llmfw.plugins.backends.torch.kernels import RopeTables, attention, k_shift, rope_apply, rope_cos_sin  # noqa: E402
from llmfw.plugins.backends.torch.weights import MATMUL_FORM_ENV, has_dynamic_int8  # noqa: E402

RNG = np.random.default_rng(7)


def randn(*shape: int, scale: float = 1.0, rng: np.random.Generator = RNG) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


ROPE_CASES = {
    "norm": dict(n_dims=64, mode="norm", freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0),
    "neox": dict(n_dims=64, mode="neox", freq_base=1e6, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0),
    "partial": dict(n_dims=32, mode="neox", freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0),
    "yarn": dict(n_dims=64, mode="norm", freq_base=10000.0, freq_scale=0.25, ext_factor=1.0, attn_factor=1.0),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
@pytest.mark.parametrize("with_factors", [False, True])
def test_rope_matches_ggml_semantics(case: str, with_factors: bool) -> None:
    attrs = dict(ROPE_CASES[case], beta_fast=32.0, beta_slow=1.0, n_ctx_orig=4096)
    x = randn(7, 3, 64)
    pos = np.array([0, 1, 5, 100, 511, 2000, 2726], dtype=np.int32)
    factors = (1.0 + RNG.random(attrs["n_dims"] // 2)).astype(np.float32) if with_factors else None
    cos, sin = oracle.rope_cos_sin(pos, freq_factors=factors, **attrs)
    expected = oracle.rope_apply(x, cos, sin, attrs["n_dims"], attrs["mode"])

    params = RopeParams.from_attrs(attrs)
    tcos, tsin = rope_cos_sin(torch.from_numpy(pos), params, None if factors is None else torch.from_numpy(factors))
    tables = RopeTables.make(tcos, tsin, params.mode == "neox")
    got = rope_apply(torch.from_numpy(x), tables, params.n_dims, params.mode == "neox").numpy()
    # the same rotation on a strided view (how q and k arrive: slices of a fused QKV output)
    wide = torch.from_numpy(np.concatenate([x, x[:, :1]], axis=1))[:, :3]
    np.testing.assert_allclose(rope_apply(wide, tables, params.n_dims, params.mode == "neox").numpy(), got)
    np.testing.assert_allclose(tcos.numpy(), cos, atol=2e-6)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)
    if attrs["n_dims"] < 64:
        np.testing.assert_array_equal(got[..., attrs["n_dims"]:], x[..., attrs["n_dims"]:])


def test_rope_rejects_unknown_mode() -> None:
    with pytest.raises(Exception, match="rope mode"):
        RopeParams.from_attrs(dict(n_dims=8, mode="sideways"))


def _causal_mask(n_tokens: int, n_kv: int, first_pos: int) -> np.ndarray:
    mask = np.full((n_tokens, n_kv), -np.inf, dtype=np.float32)
    for t in range(n_tokens):
        mask[t, : first_pos + t + 1] = 0.0
    return mask


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("n_head,n_head_kv", [(9, 3), (4, 4), (4, 1)])
def test_attention_with_cache_matches_numpy(softcap: float, n_head: int, n_head_kv: int) -> None:
    head_dim, n_cells = 16, 32
    shape = KVLayerShape("kv", 0, n_cells, n_head_kv, head_dim, head_dim)
    ref_kv = oracle.NumpyBackend().alloc_kv(shape)
    backend = TorchBackend("cpu")
    kv = backend.alloc_kv(shape)
    first = 0
    for n_tokens in (5, 1, 3):  # a prompt, then decodes into the same cache
        q, k, v = randn(n_tokens, n_head, head_dim), randn(n_tokens, n_head_kv, head_dim), randn(n_tokens, n_head_kv,
                                                                                                  head_dim)
        idx = np.arange(first, first + n_tokens, dtype=np.int64)
        n_kv = 16
        mask = _causal_mask(n_tokens, n_kv, first)
        oracle.write_kv(ref_kv, k, v, idx)
        expected = oracle.attention(q, ref_kv, n_kv, mask, 0.25, softcap)
        got = attention(*(torch.from_numpy(a) for a in (q, k, v, idx, mask)), {}, kv, 0.25, softcap)
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-5, rtol=1e-4)
        np.testing.assert_array_equal(kv.k.numpy(), ref_kv.k)
        first += n_tokens


def test_k_shift_matches_numpy() -> None:
    attrs = dict(ROPE_CASES["neox"], beta_fast=32.0, beta_slow=1.0, n_ctx_orig=4096)
    shape = KVLayerShape("kv", 0, 12, 2, 64, 64)
    ref_kv = oracle.NumpyBackend().alloc_kv(shape)
    ref_kv.k[:] = randn(2, 12, 64)
    kv = TorchBackend("cpu").alloc_kv(shape)
    kv.k.copy_(torch.from_numpy(ref_kv.k))
    shift = np.array([0, -3, -3, 4, 0, 0, 2, 1], dtype=np.int32)
    cos, sin = oracle.rope_cos_sin(shift, **attrs)
    cached = ref_kv.k[:, :8].transpose(1, 0, 2)
    ref_kv.k[:, :8] = oracle.rope_apply(cached, cos, sin, 64, "neox").transpose(1, 0, 2)
    k_shift(torch.from_numpy(shift), None, kv, RopeParams.from_attrs(attrs))
    np.testing.assert_allclose(kv.k.numpy(), ref_kv.k, atol=2e-5)


# -- weights -----------------------------------------------------------------------------------------------

def _f32_source(name: str, array: np.ndarray, usage: str | frozenset = "mul_mat") -> WeightSource:
    array = np.ascontiguousarray(array, dtype=np.float32)
    usage = frozenset({usage}) if isinstance(usage, str) else usage
    return WeightSource(name, name, int(GGMLType.F32), tuple(reversed(array.shape)), array.reshape(-1).view(np.uint8),
                        usage)


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


@pytest.mark.skipif(not has_dynamic_int8(), reason="this torch has no fbgemm dynamic quantized linear")
def test_int8_linear_error_on_real_weights(smollm2_path) -> None:
    """Per-row int8 of SmolLM2's Q4_1 / Q8_0 weights stays within ~1% of the f32 product, per token."""
    from llmfw.core.gguf import open_gguf

    backend = TorchBackend("cpu")
    with open_gguf(smollm2_path) as gguf:
        tensors = {name: (gguf.tensor_info(name), gguf.tensor_bytes(name))
                   for name in ("blk.3.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight")}
        for name, (info, raw) in tensors.items():
            source = WeightSource(name, name, int(info.ggml_type), info.shape, raw, frozenset({"mul_mat"}))
            weight = backend.load_weight(source)
            dense = dequantize(raw, info.ggml_type, info.shape)
            _check_int8_rows(weight, dense, name)


def _check_int8_rows(weight, dense: np.ndarray, name: str) -> None:
    if True:
        x = randn(6, dense.shape[1])
        x[2] *= 300.0  # an outlier token must not coarsen the others' quantization
        got = weight.linear(torch.from_numpy(x)).numpy()
        expected = x @ dense.T
        for row in range(len(x)):
            assert _relative_error(got[row], expected[row]) < 0.02, (name, row)
        single = weight.linear(torch.from_numpy(x[:1])).numpy()
        assert _relative_error(single[0], expected[0]) < 0.02


@pytest.mark.parametrize("form", ["int8", "bf16", "f32"])
def test_fused_linear_equals_separate(form: str, monkeypatch) -> None:
    if form == "int8" and not has_dynamic_int8():
        pytest.skip("no fbgemm dynamic quantized linear")
    monkeypatch.setenv(MATMUL_FORM_ENV, form)
    backend = TorchBackend("cpu")
    assert backend.matmul_form == form
    weights = {"q": randn(32, 24), "k": randn(8, 24), "v": randn(8, 24)}
    for name, w in weights.items():
        backend.load_weight(_f32_source(name, w))
    x = torch.from_numpy(randn(4, 24))
    separate = [backend.linear(n)(x) for n in weights]
    fused = backend.fused_linear(("q", "k", "v"))
    assert backend.weights["q"].linear is None  # the fused copy replaced the members'
    np.testing.assert_allclose(fused(x).numpy(), torch.cat(separate, dim=-1).numpy(), rtol=1e-5, atol=1e-5)
    again = backend.linear("k")(x)  # rebuilt from the fused weight when a graph needs it alone
    np.testing.assert_allclose(again.numpy(), separate[1].numpy(), rtol=1e-5, atol=1e-5)
    assert backend.weight_nbytes() > 0


def test_bad_matmul_form_env_is_clear(monkeypatch) -> None:
    monkeypatch.setenv(MATMUL_FORM_ENV, "int3")
    with pytest.raises(BackendUnavailable, match="int8, bf16, f32"):
        TorchBackend("cpu")


# -- a whole split ---------------------------------------------------------------------------------------------

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_VOCAB, N_LAYER = 48, 6, 2, 8, 96, 50, 2


def _tiny_weights() -> dict[str, tuple[np.ndarray, str]]:
    """The same weights on every call (both backends of a comparison load them)."""
    rng = np.random.default_rng(11)

    def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w: dict[str, tuple[np.ndarray, str]] = {"token_embd.weight": (randn(N_VOCAB, N_EMBD), "get_rows"),
                                             "output.weight": (randn(N_VOCAB, N_EMBD, scale=0.2), "mul_mat"),
                                             "output_norm.weight": (1 + randn(N_EMBD, scale=0.1), "mul")}
    for il in range(N_LAYER):
        p = f"blk.{il}"
        w[f"{p}.attn_norm.weight"] = (1 + randn(N_EMBD, scale=0.1), "mul")
        w[f"{p}.attn_q.weight"] = (randn(N_HEAD * HEAD_DIM, N_EMBD, scale=0.2), "mul_mat")
        w[f"{p}.attn_k.weight"] = (randn(N_HEAD_KV * HEAD_DIM, N_EMBD, scale=0.2), "mul_mat")
        w[f"{p}.attn_v.weight"] = (randn(N_HEAD_KV * HEAD_DIM, N_EMBD, scale=0.2), "mul_mat")
        w[f"{p}.attn_output.weight"] = (randn(N_EMBD, N_HEAD * HEAD_DIM, scale=0.2), "mul_mat")
        w[f"{p}.ffn_norm.weight"] = (1 + randn(N_EMBD, scale=0.1), "mul")
        w[f"{p}.ffn_gate.weight"] = (randn(N_FF, N_EMBD, scale=0.2), "mul_mat")
        w[f"{p}.ffn_up.weight"] = (randn(N_FF, N_EMBD, scale=0.2), "mul_mat")
        w[f"{p}.ffn_down.weight"] = (randn(N_EMBD, N_FF, scale=0.2), "mul_mat")
    return w


def _tiny_graph(rope_mode: str, softcap: float) -> Graph:
    """A llama-shaped graph written with the raw IR (no architecture plugin): every op the models use."""
    g = Graph()
    tokens, pos = g.add("input", name="tokens"), g.add("input", name="pos")
    kv_idx, mask = g.add("input", name="kv_idx:kv"), g.add("input", name="kq_mask:kv")
    for node in (tokens, pos, kv_idx, mask):
        node.attrs["name"] = node.name
        g.inputs[node.name] = node
    weight = {}

    def w(name: str, layer: int):
        if name not in weight:
            weight[name] = g.add("weight", layer=layer, name=name)
            weight[name].attrs["name"] = name
        return weight[name]

    rope = dict(n_dims=HEAD_DIM, mode=rope_mode, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0,
                beta_fast=32.0, beta_slow=1.0, n_ctx_orig=128)
    x = g.add("get_rows", w("token_embd.weight", -1), tokens)
    x = g.add("scale", x, s=1.5)
    for il in range(N_LAYER):
        p = f"blk.{il}"
        h = g.add("mul", g.add("rms_norm", x, layer=il, eps=1e-5), w(f"{p}.attn_norm.weight", il), layer=il)
        q = g.add("reshape", g.add("mul_mat", w(f"{p}.attn_q.weight", il), h, layer=il), layer=il,
                  shape=(-1, N_HEAD, HEAD_DIM))
        k = g.add("reshape", g.add("mul_mat", w(f"{p}.attn_k.weight", il), h, layer=il), layer=il,
                  shape=(-1, N_HEAD_KV, HEAD_DIM))
        v = g.add("reshape", g.add("mul_mat", w(f"{p}.attn_v.weight", il), h, layer=il), layer=il,
                  shape=(-1, N_HEAD_KV, HEAD_DIM))
        q, k = g.add("rope", q, pos, layer=il, **rope), g.add("rope", k, pos, layer=il, **rope)
        a = g.add("attention", q, k, v, kv_idx, mask, layer=il, cache="kv", scale=HEAD_DIM ** -0.5, softcap=softcap)
        a.attrs["layer"] = il  # the KV cache's layer (Graph.add takes ``layer`` as the node's owner)
        a = g.add("mul_mat", w(f"{p}.attn_output.weight", il), a, layer=il)
        x = g.add("add", x, a, layer=il)
        h = g.add("mul", g.add("norm", x, layer=il, eps=1e-5), w(f"{p}.ffn_norm.weight", il), layer=il)
        gate = g.add("mul_mat", w(f"{p}.ffn_gate.weight", il), h, layer=il)
        up = g.add("mul_mat", w(f"{p}.ffn_up.weight", il), h, layer=il)
        act = g.add("gelu" if il % 2 else "silu", gate, layer=il)
        ff = g.add("mul_mat", w(f"{p}.ffn_down.weight", il), g.add("mul", act, up, layer=il), layer=il)
        x = g.add("add", x, g.add("clamp", ff, layer=il, min=-50.0, max=50.0), layer=il)
    x = g.add("slice", x, layer=N_LAYER, axis=-1, start=0, stop=N_EMBD)
    x = g.add("mul", g.add("rms_norm", x, layer=N_LAYER, eps=1e-5), w("output_norm.weight", N_LAYER), layer=N_LAYER)
    logits = g.add("softcap", g.add("mul_mat", w("output.weight", N_LAYER), x, layer=N_LAYER), layer=N_LAYER, cap=30.0)
    g.outputs["logits"] = logits
    return g


def _run_graph(backend, graph: Graph, steps: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    weights = _tiny_weights()
    for name, (array, usage) in weights.items():
        backend.weights[name] = backend.load_weight(_f32_source(name, array, usage))
    kv = {("kv", il): backend.alloc_kv(KVLayerShape("kv", il, 16, N_HEAD_KV, HEAD_DIM, HEAD_DIM))
          for il in range(N_LAYER)}
    inputs = [n for n in graph.nodes if n.op == "input"]
    split = Split(backend, [n for n in graph.nodes if n.op != "input"], [n.id for n in inputs],
                  [graph.outputs["logits"].id])
    run = backend.compile(split, kv)
    results = []
    for tokens, pos in steps:
        values = {"tokens": tokens, "pos": pos, "kv_idx:kv": pos.astype(np.int64),
                  "kq_mask:kv": _causal_mask(len(tokens), 16, int(pos[0]))}
        out = run({n.id: backend.from_numpy(values[n.name]) for n in inputs})
        results.append(np.array(backend.to_numpy(out[graph.outputs["logits"].id])))
    return results, run


@pytest.mark.parametrize("form", ["f32", "fp16", "int8"])
@pytest.mark.parametrize("rope_mode,softcap", [("norm", 0.0), ("neox", 20.0)])
def test_split_matches_numpy_backend(form: str, rope_mode: str, softcap: float, monkeypatch) -> None:
    if form == "int8" and not has_dynamic_int8():
        pytest.skip("no fbgemm dynamic quantized linear")
    monkeypatch.setenv(MATMUL_FORM_ENV, form)
    graph = _tiny_graph(rope_mode, softcap)
    steps = [(np.array([3, 14, 15, 9], dtype=np.int32), np.arange(4, dtype=np.int32)),
             (np.array([26], dtype=np.int32), np.array([4], dtype=np.int32))]
    expected, _ = _run_graph(oracle.NumpyBackend(), graph, steps)
    backend = TorchBackend("cpu")
    got, run = _run_graph(backend, graph, steps)
    tolerance = {"f32": 2e-4, "fp16": 2e-3, "int8": 0.1}[form]  # int8: 8-bit activations, see the README
    for e, g in zip(expected, got):
        assert g.shape == e.shape
        assert np.max(np.abs(g - e)) <= tolerance * max(1.0, np.max(np.abs(e))), np.max(np.abs(g - e))
    source = run.source
    assert source.count("# fused") == 2 * N_LAYER  # QKV and gate/up of every layer
    assert "F.rms_norm" in source and "F.layer_norm" in source
    assert source.count("rope_tables") == 1  # angles shared by q and k of every layer


def test_import_does_not_import_torch() -> None:
    code = "import sys, llmfw.plugins.backends.torch, llmfw.plugins.backends; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cuda_device_unavailable_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(BackendUnavailable, match="CUDA"):
        TorchBackend("cuda")
    with pytest.raises(BackendUnavailable, match="'cpu' or 'cuda"):
        TorchBackend("tpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_split_on_cuda_matches_numpy() -> None:
    graph = _tiny_graph("neox", 0.0)
    steps = [(np.array([3, 14, 15], dtype=np.int32), np.arange(3, dtype=np.int32))]
    expected, _ = _run_graph(oracle.NumpyBackend(), graph, steps)
    got, _ = _run_graph(TorchBackend("cuda"), graph, steps)
    assert np.max(np.abs(got[0] - expected[0])) <= 0.05 * max(1.0, np.max(np.abs(expected[0])))


SPIN_PROBE = ("import os; from llmfw.plugins.backends.torch.environment import import_torch; import_torch(); "
              "print(os.environ.get('OMP_WAIT_POLICY'))")


@pytest.mark.parametrize("spin, preset, expected", [("0", None, "PASSIVE"), ("1", None, "None"), (None, None, "None"),
                                                    ("0", "ACTIVE", "ACTIVE")])
def test_spin_setting_reaches_openmp_before_torch_loads(spin: str | None, preset: str | None,
                                                        expected: str) -> None:
    """LLMFW_TORCH_SPIN=0 sets OpenMP's passive wait policy in a fresh process before torch is imported; an
    explicit OMP_WAIT_POLICY is left alone."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("LLMFW_TORCH_SPIN", "OMP_WAIT_POLICY")}
    if spin is not None:
        env["LLMFW_TORCH_SPIN"] = spin
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    result = subprocess.run([sys.executable, "-c", SPIN_PROBE], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == expected
