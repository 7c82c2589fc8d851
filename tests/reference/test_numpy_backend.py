"""The numpy backend's fast paths keep the op semantics of ``llmfw.core.graph``.

Weights are stored in the layout their one-token product streams fastest, matmuls sharing an input run as one GEMM
over the weight ``fuse_weights`` concatenated once (the core's fusion pass rewrites the graph), ``rms_norm`` with
its folded weight is one kernel, rope uses precomputed full-width factors
and attention skips cells no query of a block can see. Each rewrite is checked here against the plain definition
(bit for bit where the arithmetic is the same, to float32 rounding where only the summation order changes).
The end-to-end check on the real model is ``tests/reference/test_llama_reference.py``.
"""
from __future__ import annotations

import numpy as np
import pytest

from llmfw.core.backend import KVLayerShape, Split, WeightSource
from llmfw.core.errors import ModelError
from llmfw.core.graph import Graph
from llmfw.core.passes import optimize
from llmfw.core.quants import GGMLType
from llmfw.plugins.backends import numpy as nb

RNG = np.random.default_rng(7)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def f32_source(name: str, array: np.ndarray, usage: str = "mul_mat", source_name: str | None = None) -> WeightSource:
    array = np.ascontiguousarray(array, dtype=np.float32)
    return WeightSource(name, source_name or name, int(GGMLType.F32), tuple(reversed(array.shape)),
                        array.reshape(-1).view(np.uint8), frozenset({usage}))


def load(backend: nb.NumpyBackend, name: str, array: np.ndarray, usage: str = "mul_mat",
         source_name: str | None = None):
    """What the model loader does: convert, then keep the handle under the weight's name."""
    backend.weights[name] = backend.load_weight(f32_source(name, array, usage, source_name))
    return backend.weights[name]


def named(graph: Graph, op: str, name: str):
    """An ``input`` or ``weight`` node: its name is an attribute (``Graph.add``'s ``name`` is the node's label)."""
    node = graph.add(op, name=name)
    node.attrs["name"] = name
    return node


def compile_graph(backend: nb.NumpyBackend, graph: Graph, outputs: list, kv=None):
    """One split with every non-input node of ``graph`` (as the scheduler cuts a single-backend graph)."""
    inputs = [n for n in graph.nodes if n.op == "input"]
    split = Split(backend, [n for n in graph.nodes if n.op != "input"], [n.id for n in inputs], [n.id for n in outputs])
    return backend.compile(split, kv or {})


# -- weight storage --------------------------------------------------------------------------------------------

def test_weights_keep_contract_shape_and_values_in_their_fast_layout() -> None:
    backend = nb.NumpyBackend()
    wide, narrow, norm = randn(48, 16), randn(16, 48), randn(16)
    wide_h = load(backend, "wide", wide)
    narrow_h = load(backend, "narrow", narrow)
    norm_h = load(backend, "norm", norm, usage="mul")
    for handle, array in ((wide_h, wide), (narrow_h, narrow), (norm_h, norm)):
        assert handle.shape == array.shape and handle.dtype == np.float32
        np.testing.assert_array_equal(handle, array)
    assert wide_h.T.flags.c_contiguous and not wide_h.flags.c_contiguous  # n_out >= n_in: stored transposed
    assert narrow_h.flags.c_contiguous  # n_in > n_out (ffn_down): as in the file
    raw = f32_source("wide", wide).raw
    assert not np.shares_memory(backend.load_weight(f32_source("wide2", wide)), raw)


def test_tied_table_shares_one_copy_and_rows_still_look_up() -> None:
    backend = nb.NumpyBackend()
    table = randn(40, 8)
    embd = load(backend, "token_embd.weight", table, usage="get_rows")
    head = load(backend, "output.weight", table, source_name="token_embd.weight")
    assert backend.weights["token_embd.weight"] is head  # the lookup table was rebound to the matmul layout
    assert all(handle is not embd for handle in backend.weights.values())  # the first copy is dropped
    ids = np.array([3, 0, 39, 3])
    np.testing.assert_array_equal(nb.get_rows(head, ids), table[ids])
    assert nb.get_rows(head, ids).flags.c_contiguous


# -- compiled splits ------------------------------------------------------------------------------------------

def typed_leaf(graph: Graph, op: str, name: str, array: np.ndarray | None = None, shape=None):
    """A typed ``input`` / ``weight`` leaf (what the graph builder makes), so the core passes can read it."""
    return graph.leaf(op, name, array.shape if array is not None else shape)


def test_matmuls_sharing_an_input_are_fused_into_one_gemm() -> None:
    """The core fuses the group on a weight this backend concatenated once; results are the separate products."""
    backend = nb.NumpyBackend()
    weights = {"q": randn(32, 16), "k": randn(8, 16), "v": randn(8, 16), "o": randn(16, 32)}
    for name, w in weights.items():
        load(backend, name, w)
    g = Graph()
    x = typed_leaf(g, "input", "embd", shape=(5, 16))
    nodes = {n: typed_leaf(g, "weight", n, w) for n, w in weights.items()}
    q, k, v = (g.add("mul_mat", nodes[n], x) for n in ("q", "k", "v"))
    o = g.add("mul_mat", nodes["o"], q)  # another input: not fused
    assert backend.fuse_weights("q+k+v", ("q", "k", "v"))  # at load, once
    report = optimize(g, {("q", "k", "v"): "q+k+v"}, lambda name: backend)
    assert report.fused_matmuls == 1 and [n.op for n in (q, k, v)] == ["slice"] * 3
    xv = randn(5, 16)
    run = compile_graph(backend, g, [q, k, v, o])
    out = run({x.id: xv})
    for node, name in ((q, "q"), (k, "k"), (v, "v")):
        np.testing.assert_allclose(out[node.id], xv @ weights[name].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[o.id], (xv @ weights["q"].T) @ weights["o"].T, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(run({x.id: xv})[k.id], out[k.id])  # a second run: same values
    fused = backend.weights["q+k+v"]
    assert fused.shape == (48, 16)
    assert all(np.shares_memory(backend.weights[n], fused) for n in "qkv")  # members are views: no second copy
    for name, w in weights.items():
        np.testing.assert_array_equal(backend.weights[name], w)


def test_quantized_tables_are_not_fused() -> None:
    backend = nb.NumpyBackend()
    load(backend, "dense", randn(8, 32))
    backend.weights["table"] = nb.QuantizedTable(np.zeros(4 * 18, np.uint8), int(GGMLType.Q4_0), (32, 4))
    assert not backend.fuse_weights("dense+table", ("dense", "table"))
    assert "dense+table" not in backend.weights


def test_rms_norm_times_weight_is_one_kernel_with_the_same_rounding() -> None:
    backend = nb.NumpyBackend()
    w = load(backend, "norm", randn(24), usage="mul")
    g = Graph()
    x = typed_leaf(g, "input", "embd", shape=(6, 24))
    normed = g.add("rms_norm", x, eps=1e-6)
    scaled = g.add("mul", normed, typed_leaf(g, "weight", "norm", w))
    plain = g.add("rms_norm", x, eps=1e-6)  # a norm that is a graph output is not folded
    g.outputs.update(scaled=scaled, plain=plain)
    assert optimize(g, {}, lambda name: backend).folded_norms == 1
    assert scaled.op == "rms_norm" and len(scaled.inputs) == 2 and normed not in g.nodes
    run = compile_graph(backend, g, [scaled, plain])
    xv = randn(6, 24) * 30
    out = run({x.id: xv})
    mean_sq = (xv.astype(np.float64) ** 2).mean(-1, keepdims=True)
    expected = xv * (1.0 / np.sqrt(mean_sq + 1e-6)).astype(np.float32)
    np.testing.assert_array_equal(out[plain.id], expected)
    np.testing.assert_array_equal(out[scaled.id], expected * w)


def test_a_missing_graph_input_is_a_clear_error() -> None:
    backend = nb.NumpyBackend()
    g = Graph()
    x = named(g, "input", "embd")
    y = g.add("silu", x)
    split = Split(backend, [x, y], [], [y.id])  # the input node itself inside the split, never handed in
    run = backend.compile(split, {})
    with pytest.raises(ModelError, match="'embd' was not set"):
        run({})
    xv = randn(2, 4)
    np.testing.assert_allclose(run({x.id: xv})[y.id], xv / (1 + np.exp(-xv)), rtol=1e-6)


# -- kernels -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["neox", "norm"])
@pytest.mark.parametrize("n_dims", [64, 32])
def test_rope_fast_path_is_bit_identical(mode: str, n_dims: int) -> None:
    pos = np.arange(3, 40, dtype=np.int32)
    cos, sin = nb.rope_cos_sin(pos, n_dims, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, 4096)
    table = nb.rope_table(cos, sin, mode)
    fused_qkv = randn(len(pos), 9 * 64 + 20)
    for x in (randn(len(pos), 4, 64), fused_qkv[:, 20:].reshape(len(pos), 9, 64)):  # contiguous, strided view
        before = x.copy()
        got = nb.rope_apply_full(x, table, n_dims, mode)
        np.testing.assert_array_equal(got, nb.rope_apply(x, cos, sin, n_dims, mode))
        np.testing.assert_array_equal(x, before)  # the input is never rotated in place


def naive_attention(q, k, v, mask, scale, softcap):
    """Per head, in float64, over every cell: the op's definition."""
    n_tokens, n_head, _ = q.shape
    group = n_head // k.shape[1]
    out = np.empty((n_tokens, n_head, v.shape[-1]))
    for h in range(n_head):
        scores = scale * q[:, h].astype(np.float64) @ k[:, h // group].T.astype(np.float64)
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        scores = scores + mask
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // group]
    return out.reshape(n_tokens, -1)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("n_tokens,first", [(1, 37), (70, 0), (130, 9)])
def test_attention_skipping_hidden_cells_matches_the_definition(n_tokens, first, softcap) -> None:
    n_kv, n_head, n_head_kv, dim = 256, 6, 2, 16
    kv = nb.NumpyBackend().alloc_kv(KVLayerShape("kv", 0, n_kv + 32, n_head_kv, dim, dim))
    kv.k[:, :first] = randn(n_head_kv, first, dim)
    kv.v[:, :first] = randn(n_head_kv, first, dim)
    q, k, v = randn(n_tokens, n_head, dim), randn(n_tokens, n_head_kv, dim), randn(n_tokens, n_head_kv, dim)
    nb.write_kv(kv, k, v, np.arange(first, first + n_tokens))
    mask = np.full((n_tokens, n_kv), -np.inf, dtype=np.float32)
    for t in range(n_tokens):
        mask[t, : first + t + 1] = 0.0
    limits = nb.visible_limits(mask)
    assert limits[0][2] == min(first + min(nb.ATTN_BLOCK_ROWS, n_tokens), n_kv)  # hidden cells are skipped
    got = nb.attention(q, kv, n_kv, mask, 0.25, softcap)
    expected = naive_attention(q, kv.k[:, :n_kv].transpose(1, 0, 2), kv.v[:, :n_kv].transpose(1, 0, 2), mask, 0.25,
                               softcap)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_a_fully_hidden_row_gives_nan_as_the_full_computation_does() -> None:
    kv = nb.NumpyBackend().alloc_kv(KVLayerShape("kv", 0, 8, 1, 4, 4))
    mask = np.full((2, 8), -np.inf, dtype=np.float32)
    mask[1, :3] = 0.0
    with np.errstate(invalid="ignore"):  # -inf - -inf: the NaN this test expects
        out = nb.attention(randn(2, 2, 4), kv, 8, mask, 1.0, 0.0)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize("load_mode", ["mmap", "read"])
def test_a_quantized_lookup_table_maps_the_file_instead_of_copying_it(smollm2_path, load_mode: str) -> None:
    """Kept as a mapping of its own, the table costs only the rows looked up (read mode keeps a copy); the rows
    are the file's either way."""
    import llmfw
    from llmfw.core.gguf import open_gguf
    from llmfw.core.quants import dequantize_rows

    model = llmfw.load_model(smollm2_path, backend="numpy", load_mode=load_mode)
    try:
        table = model.backends["numpy"].weights["token_embd.weight"]
        assert isinstance(table, nb.QuantizedTable)
        assert table.raw.flags.owndata == (load_mode == "read")
        assert not table.raw.flags.writeable or load_mode == "read"
        ids = np.array([0, 1, 4242, model.n_vocab - 1])
        with open_gguf(smollm2_path) as g:
            expected = dequantize_rows(g.tensor_bytes("token_embd.weight"), table.ggml_type, table.ne, ids)
        np.testing.assert_array_equal(nb.get_rows(table, ids), expected)
    finally:
        model.close()
