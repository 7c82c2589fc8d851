"""The torch backend's kernels and split compiler against the numpy backend (the oracle), op by op and on a small
hand-built graph with every rewrite the compiler does (fused QKV / gate-up, norm × weight, shared rope angles)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llmfw.core.backend import (  # noqa: E402
    KVLayerShape, Split, WeightSource, backend_options_from_environment, create_backend,
)
from llmfw.core.errors import BackendUnavailable, ConfigError, ModelError  # noqa: E402
from llmfw.core.graph import Graph, last_uses  # noqa: E402
from llmfw.core.passes import matmul_groups, optimize  # noqa: E402
from llmfw.core.quants import GGMLType, dequantize  # noqa: E402
from llmfw.plugins.backends import numpy as oracle  # noqa: E402
from llmfw.core.architecture import RopeParams  # noqa: E402
from llmfw.plugins.backends.torch import TorchBackend, TorchOptions  # noqa: E402
from llmfw.plugins.backends.torch.kernels import (  # noqa: E402
    RopeTables,
    attention,
    grouped_mask,
    k_shift,
    rope_apply,
    rope_cos_sin,
)
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
        q_t, k_t, v_t, idx_t, mask_t = (torch.from_numpy(a) for a in (q, k, v, idx, mask))
        got = attention(q_t, k_t, v_t, idx_t, grouped_mask(mask_t, n_head // n_head_kv), kv, 0.25, softcap)
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
    x = randn(6, dense.shape[1])
    x[2] *= 300.0  # an outlier token must not coarsen the others' quantization
    got = weight.linear(torch.from_numpy(x)).numpy()
    expected = x @ dense.T
    for row in range(len(x)):
        assert _relative_error(got[row], expected[row]) < 0.02, (name, row)
    single = weight.linear(torch.from_numpy(x[:1])).numpy()
    assert _relative_error(single[0], expected[0]) < 0.02


@pytest.mark.parametrize("form", ["int8", "bf16", "f32"])
def test_fused_linear_equals_separate(form: str) -> None:
    if form == "int8" and not has_dynamic_int8():
        pytest.skip("no fbgemm dynamic quantized linear")
    backend = TorchBackend("cpu", options=TorchOptions(matmul=form))
    assert backend.matmul_form == form
    weights = {"q": randn(32, 24), "k": randn(8, 24), "v": randn(8, 24)}
    for name, w in weights.items():
        backend.load_weight(_f32_source(name, w))
    x = torch.from_numpy(randn(4, 24))
    separate = [backend.linear(n)(x) for n in weights]
    bytes_before = backend.weight_nbytes()
    assert backend.fuse_weights("q+k+v", ("q", "k", "v"))
    assert backend.weights["q"].linear is None  # the fused copy replaced the members'
    assert backend.weight_nbytes() == bytes_before  # ... so the weights take no more room than before
    assert backend.weights["q+k+v"].shape == (48, 24)
    fused = backend.linear("q+k+v")
    np.testing.assert_allclose(fused(x).numpy(), torch.cat(separate, dim=-1).numpy(), rtol=1e-5, atol=1e-5)
    again = backend.linear("k")(x)  # rebuilt from the fused weight when a graph needs it alone
    np.testing.assert_allclose(again.numpy(), separate[1].numpy(), rtol=1e-5, atol=1e-5)
    assert backend.weight_nbytes() == bytes_before + backend.weights["k"].nbytes  # the rebuilt k is extra
    assert not backend.fuse_weights("k+o", ("k", "o"))  # a part already fused, or a weight not loaded


def test_weights_of_different_widths_are_not_fused() -> None:
    backend = TorchBackend("cpu")
    backend.load_weight(_f32_source("a", randn(8, 24)))
    backend.load_weight(_f32_source("b", randn(8, 16)))
    assert not backend.fuse_weights("a+b", ("a", "b"))
    assert "a+b" not in backend.weights and backend.weights["a"].linear is not None


def test_bad_matmul_form_env_is_clear() -> None:
    options = backend_options_from_environment({MATMUL_FORM_ENV: "int3"})  # what the CLI does with the variable
    assert options["torch"] == {"matmul": "int3"}
    with pytest.raises(ConfigError, match="backend 'torch': matmul: must be one of 'fp16', 'int8', 'bf16' or 'f32'"):
        create_backend("torch", options)
    assert create_backend("torch", backend_options_from_environment({MATMUL_FORM_ENV: " F32 "})).matmul_form == "f32"


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


N_CELLS = 16


def _tiny_graph(rope_mode: str, softcap: float, n_tokens: int) -> Graph:
    """A llama-shaped graph of one ``n_tokens`` ubatch written with the raw IR (no architecture plugin): every
    op the models use."""
    g = Graph()
    tokens, pos = g.leaf("input", "tokens", (n_tokens,), "i32"), g.leaf("input", "pos", (n_tokens,), "i32")
    kv_idx = g.leaf("input", "kv_idx:kv", (n_tokens,), "i64")
    mask = g.leaf("input", "kq_mask:kv", (n_tokens, N_CELLS))
    shapes = {name: array.shape for name, (array, _) in _tiny_weights().items()}
    weight = {}

    def w(name: str, layer: int):
        if name not in weight:
            weight[name] = g.leaf("weight", name, shapes[name], layer=layer)
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
        # attrs["layer"] is the KV cache's layer (Graph.add's ``layer`` is the node's owner)
        a = g.add_node("attention", (q, k, v, kv_idx, mask),
                       dict(layer=il, cache="kv", scale=HEAD_DIM ** -0.5, softcap=softcap), layer=il)
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


def _load_tiny_model(backend) -> tuple[dict[tuple[str, ...], str], dict]:
    """The tiny weights on ``backend`` with the fused weights the core's load-time detection asks it for, and
    its KV cache."""
    for name, (array, usage) in _tiny_weights().items():
        backend.weights[name] = backend.load_weight(_f32_source(name, array, usage))
    fused = {}
    for group in matmul_groups(_tiny_graph("norm", 0.0, 1), lambda name: backend):
        if backend.fuse_weights(group.name, group.parts):
            fused[group.parts] = group.name
    kv = {("kv", il): backend.alloc_kv(KVLayerShape("kv", il, N_CELLS, N_HEAD_KV, HEAD_DIM, HEAD_DIM))
          for il in range(N_LAYER)}
    return fused, kv


def _compile_tiny_graph(backend, fused, kv, rope_mode: str, softcap: float, n_tokens: int):
    """The graph through the core passes, as one split (what the scheduler makes of a single-backend graph)."""
    graph = _tiny_graph(rope_mode, softcap, n_tokens)
    optimize(graph, fused, lambda name: backend)
    inputs = [n for n in graph.nodes if n.op == "input"]
    nodes = [n for n in graph.nodes if n.op != "input"]
    logits = graph.outputs["logits"].id
    split = Split(backend, nodes, [n.id for n in inputs], [logits], last_uses(nodes, {logits}))
    return backend.compile(split, kv), inputs, logits


def _run_graph(backend, rope_mode: str, softcap: float, steps: list[tuple[np.ndarray, np.ndarray]]):
    fused, kv = _load_tiny_model(backend)
    results, runs = [], []
    for tokens, pos in steps:
        run, inputs, logits = _compile_tiny_graph(backend, fused, kv, rope_mode, softcap, len(tokens))
        values = {"tokens": tokens, "pos": pos, "kv_idx:kv": pos.astype(np.int64),
                  "kq_mask:kv": _causal_mask(len(tokens), N_CELLS, int(pos[0]))}
        out = run({n.id: backend.from_numpy(values[n.name]) for n in inputs})
        results.append(np.array(backend.to_numpy(out[logits])))
        runs.append(run)
    return results, runs


def _steps_reading(plan: list[str], label: str) -> list[str]:
    return [line for line in plan if f" = {label}" in line]


@pytest.mark.parametrize("form", ["f32", "fp16", "int8"])
@pytest.mark.parametrize("rope_mode,softcap", [("norm", 0.0), ("neox", 20.0)])
def test_split_matches_numpy_backend(form: str, rope_mode: str, softcap: float) -> None:
    if form == "int8" and not has_dynamic_int8():
        pytest.skip("no fbgemm dynamic quantized linear")
    steps = [(np.array([3, 14, 15, 9], dtype=np.int32), np.arange(4, dtype=np.int32)),
             (np.array([26], dtype=np.int32), np.array([4], dtype=np.int32))]
    expected, _ = _run_graph(oracle.NumpyBackend(), rope_mode, softcap, steps)
    backend = TorchBackend("cpu", options=TorchOptions(matmul=form))
    got, runs = _run_graph(backend, rope_mode, softcap, steps)
    tolerance = {"f32": 2e-4, "fp16": 2e-3, "int8": 0.1}[form]  # int8: 8-bit activations, see docs/backends.md
    for e, g in zip(expected, got):
        assert g.shape == e.shape
        assert np.max(np.abs(g - e)) <= tolerance * max(1.0, np.max(np.abs(e))), np.max(np.abs(g - e))
    plan = runs[0].plan
    fused = [line for line in _steps_reading(plan, "linear[") if "+" in line.split("]")[0]]
    assert len(fused) == 2 * N_LAYER  # QKV and gate/up of every layer, on the weights fused at load
    norms = _steps_reading(plan, "rms_norm(") + _steps_reading(plan, "norm(")
    assert len(norms) == 2 * N_LAYER + 1 and all(", %" in line for line in norms)  # each with its weight
    assert len(_steps_reading(plan, "mul(")) == N_LAYER  # act * up: the norms' muls were folded
    assert len(_steps_reading(plan, "rope_tables(")) == 1  # angles shared by q and k of every layer
    assert len(_steps_reading(plan, "grouped_mask[")) == 1  # one grouped mask for every layer's attention


def test_every_activation_is_dropped_after_its_last_reader() -> None:
    """The core's liveness reaches the steps: each intermediate value is dropped once, after its last reader,
    and the split's output never is (a long prefill holds one layer's temporaries at a time)."""
    backend = TorchBackend("cpu")
    fused, kv = _load_tiny_model(backend)
    run, inputs, _ = _compile_tiny_graph(backend, fused, kv, "neox", 0.0, 3)
    steps = [line for line in run.plan if " = " in line and "shared by this run" not in line]
    assert "# softcap" in steps[-1]  # the logits: computed last, never dropped
    computed = [line.split(" = ")[0] for line in steps]
    dropped = [slot for line in run.plan if line.startswith("drop ") for slot in line[5:].split(", ")]
    handed_in = [f"%{slot}" for slot in range(len(inputs))]  # the inputs take the first slots
    assert sorted(dropped) == sorted(handed_in + computed[:-1])  # every value but the logits, each exactly once
    for index, line in enumerate(run.plan):
        if line.startswith("drop "):
            for slot in line[5:].split(", "):
                readers = [later for later in run.plan[index + 1:] if " = " in later
                           and slot in later.split("(", 1)[1].split(")")[0].split(", ")]
                assert not readers, (slot, readers)


def test_a_missing_split_input_is_a_clear_error() -> None:
    backend = TorchBackend("cpu")
    fused, kv = _load_tiny_model(backend)
    run, inputs, _ = _compile_tiny_graph(backend, fused, kv, "norm", 0.0, 1)
    with pytest.raises(ModelError, match="was not set"):
        run({inputs[0].id: backend.from_numpy(np.array([1], dtype=np.int32))})


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
    steps = [(np.array([3, 14, 15], dtype=np.int32), np.arange(3, dtype=np.int32))]
    expected, _ = _run_graph(oracle.NumpyBackend(), "neox", 0.0, steps)
    got, _ = _run_graph(TorchBackend("cuda"), "neox", 0.0, steps)
    assert np.max(np.abs(got[0] - expected[0])) <= 0.05 * max(1.0, np.max(np.abs(expected[0])))


SPIN_PROBE = ("import os; from llmfw.core.backend import backend_options_from_environment, create_backend; "
              "create_backend('torch', backend_options_from_environment(os.environ)); "
              "print(os.environ.get('OMP_WAIT_POLICY'))")


@pytest.mark.parametrize("spin, preset, expected", [("0", None, "PASSIVE"), ("1", None, "None"), (None, None, "None"),
                                                    ("0", "ACTIVE", "ACTIVE")])
def test_spin_setting_reaches_openmp_before_torch_loads(spin: str | None, preset: str | None,
                                                        expected: str) -> None:
    """LLMFW_TORCH_SPIN=0, mapped by the CLI onto the spin option, sets OpenMP's passive wait policy in a fresh
    process before torch is imported; an explicit OMP_WAIT_POLICY is left alone."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("LLMFW_TORCH_SPIN", "OMP_WAIT_POLICY")}
    if spin is not None:
        env["LLMFW_TORCH_SPIN"] = spin
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    result = subprocess.run([sys.executable, "-c", SPIN_PROBE], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == expected


def _one_node_split(backend, op: str, attrs: dict, shape=(2, 4)):
    """A split of one node over one input, built by hand (so its attributes can be anything a plugin emits)."""
    from llmfw.core.graph import Node

    x = Node(0, "input", (), {"name": "x"}, -1, "x", shape, "f32")
    node = Node(1, op, (x,), attrs, 0, "", None, None)
    return backend.compile(Split(backend, [node], [x.id], [node.id]), {}), x, node


@pytest.mark.parametrize("op, attrs, message", [
    ("swiglu", {}, "cannot compile op 'swiglu'"),
    ("reshape", {"shape": "4x2"}, "tuple of integers"),
    ("slice", {"axis": -1, "start": 0.5, "stop": 2}, "must be an integer"),
    ("clamp", {"min": "low", "max": 1.0}, "must be a number"),
    ("scale", {}, "lacks attribute 's'"),
])
def test_a_malformed_node_is_a_clear_error_at_compile(op: str, attrs: dict, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        _one_node_split(TorchBackend("cpu"), op, attrs)


def test_a_one_node_split_computes_its_op() -> None:
    run, x, node = _one_node_split(TorchBackend("cpu"), "clamp", {"min": -0.5, "max": None})
    values = randn(2, 4)
    out = run({x.id: torch.from_numpy(values)})[node.id].numpy()
    np.testing.assert_array_equal(out, np.maximum(values, -0.5))
