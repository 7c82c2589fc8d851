"""The core passes (``llmfw.core.passes``) and the typed graph IR (``llmfw.core.graph``).

On the real SmolLM2 model: Q/K/V and gate/up are fused on weights built once at load, each norm carries its
weight, the numpy backend's ``swiglu`` rewrite rule fires, and the core's liveness frees values. On hand-built
graphs: the shape check rejects malformed nodes with a ModelError naming them, a rewrite rule leaves results
bit for bit unchanged and never absorbs a value someone else reads, and freed values bound a chain's memory.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import llmfw
from llmfw.core.backend import Split, WeightSource
from llmfw.core.errors import ModelError
from llmfw.core.graph import DYNAMIC, Graph, last_uses
from llmfw.core.passes import (
    ANY, Pattern, RewriteRule, apply_rewrite_rules, fuse_weight_groups, matmul_groups, optimize, representative_graph,
)
from llmfw.core.quants import GGMLType, quantize
from llmfw.plugins.backends import numpy as nb

RNG = np.random.default_rng(11)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def smollm2(shared_models):
    return shared_models.get("smollm2", "numpy")


def decode_plan(model, n_tokens: int):
    ctx = model.new_context(n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1)
    assert ctx.decode(llmfw.Batch(list(range(1, n_tokens + 1)), logits=True)) == 0, ctx.last_error
    return ctx, ctx._plan


# -- on the real model ---------------------------------------------------------------------------------------

def test_shared_input_matmuls_are_fused_on_weights_made_once_at_load(smollm2) -> None:
    n_layer = smollm2.n_layer
    backend = smollm2.host_backend
    names = sorted(smollm2.fused_weights.values())
    assert len(names) == 2 * n_layer  # Q+K+V and up+gate of every layer
    qkv = "blk.3.attn_q.weight+blk.3.attn_k.weight+blk.3.attn_v.weight"
    assert smollm2.fused_weights[("blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.attn_v.weight")] == qkv
    before = {name: backend.weights[name] for name in names}
    for n_tokens in (5, 1):  # two graphs (a prefill, a decode step): both use the load-time weights
        _, plan = decode_plan(smollm2, n_tokens)
        fused_nodes = [n for n in plan.graph.nodes if n.op == "weight" and "parts" in n.attrs]
        assert sorted(n.attrs["name"] for n in fused_nodes) == names
        assert not any(n.op == "weight" and n.attrs["name"] == "blk.3.attn_q.weight" for n in plan.graph.nodes)
        assert all(backend.weights[name] is before[name] for name in names)  # nothing rebuilt per graph
    fused = backend.weights[qkv]
    assert fused.shape == smollm2.weight_shape(qkv) == (576 + 192 + 192, 576)
    assert all(np.shares_memory(backend.weights[p], fused) for p in qkv.split("+"))  # the parts are views


def test_each_norm_carries_its_weight_and_swiglu_replaces_silu_times_up(smollm2) -> None:
    _, plan = decode_plan(smollm2, 3)
    nodes = [n for split in plan.splits for n in split.nodes]
    norms = [n for n in nodes if n.op == "rms_norm"]
    assert len(norms) == 2 * smollm2.n_layer + 1 and all(len(n.inputs) == 2 for n in norms)
    assert all(n.inputs[1].op == "weight" for n in norms)
    assert not any(n.op == "mul" and any(i.op == "rms_norm" for i in n.inputs) for n in nodes)
    swiglu = [n for n in nodes if n.op == "swiglu"]
    assert len(swiglu) == smollm2.n_layer and not any(n.op == "silu" for n in nodes)
    assert all(n.inputs[0].op == "slice" and n.shape == (3, 1536) for n in swiglu)


def test_built_graphs_are_fully_typed(smollm2) -> None:
    _, plan = decode_plan(smollm2, 4)
    graph = plan.graph
    assert all(n.shape is not None and n.dtype is not None for n in graph.nodes)
    assert graph.outputs["logits"].shape == (4, smollm2.n_vocab)
    assert graph.inputs["tokens"].dtype == "i32" and graph.inputs["kv_idx:kv"].dtype == "i64"
    attention = next(n for n in graph.nodes if n.op == "attention")
    assert attention.shape == (4, 576) and attention.inputs[1].shape == (4, 3, 64)


def test_liveness_frees_every_intermediate_of_the_model(smollm2) -> None:
    _, plan = decode_plan(smollm2, 2)
    (split,) = plan.splits
    freed = [i for ids in split.release_after.values() for i in ids]
    assert len(freed) == len(set(freed))  # each value is freed once
    assert not set(freed) & set(split.output_ids)
    read = {i.id for n in split.nodes for i in n.inputs if i.op != "weight"}
    assert set(freed) == read - set(split.output_ids)  # every value read is freed after its last reader
    for index, ids in split.release_after.items():
        for value_id in ids:
            readers = [k for k, n in enumerate(split.nodes) if any(i.id == value_id for i in n.inputs)]
            assert readers[-1] == index


# -- hand-built graphs ---------------------------------------------------------------------------------------

def chain_graph(n_ops: int, shape: tuple[int, ...]) -> tuple[Graph, list]:
    g = Graph()
    x = g.leaf("input", "embd", shape)
    nodes = [x]
    for i in range(n_ops):
        nodes.append(g.add("silu" if i % 2 else "relu", nodes[-1]))
    g.outputs["out"] = nodes[-1]
    return g, nodes


def run_split(backend, graph: Graph, outputs: list, release: bool, values: dict):
    nodes = [n for n in graph.nodes if n.op != "input"]
    inputs = [n.id for n in graph.nodes if n.op == "input"]
    out_ids = [n.id for n in outputs]
    split = Split(backend, nodes, inputs, out_ids, last_uses(nodes, set(out_ids)) if release else {})
    return backend.compile(split, {})(values)


def peak_bytes(backend, graph, outputs, release: bool, values) -> int:
    tracemalloc.start()
    try:
        run_split(backend, graph, outputs, release, values)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_liveness_bounds_the_memory_of_a_chain() -> None:
    """Ten 4 MB values in a row: with the core's last uses a run holds about two of them, without it all ten."""
    backend = nb.NumpyBackend()
    graph, nodes = chain_graph(10, (1024, 1024))
    values = {nodes[0].id: randn(1024, 1024)}
    with_release = peak_bytes(backend, graph, [nodes[-1]], True, values)
    without = peak_bytes(backend, graph, [nodes[-1]], False, values)
    size = 1024 * 1024 * 4
    assert with_release < 4 * size < 8 * size < without
    np.testing.assert_array_equal(run_split(backend, graph, [nodes[-1]], True, values)[nodes[-1].id],
                                  run_split(backend, graph, [nodes[-1]], False, values)[nodes[-1].id])


def ffn_graph(backend) -> tuple[Graph, dict]:
    gate_w, up_w = randn(24, 8), randn(24, 8)
    backend.weights.update(gate=gate_w, up=up_w)
    g = Graph()
    x = g.leaf("input", "embd", (3, 8))
    gate = g.add("mul_mat", g.leaf("weight", "gate", gate_w.shape), x)
    up = g.add("mul_mat", g.leaf("weight", "up", up_w.shape), x)
    act = g.add("silu", gate)
    h = g.add("mul", act, up)
    g.outputs["h"] = h
    return g, {"x": x, "gate": gate, "up": up, "act": act, "h": h}


def test_the_numpy_rewrite_rule_fires_and_changes_no_bit() -> None:
    backend = nb.NumpyBackend()
    graph, n = ffn_graph(backend)
    x = randn(3, 8)
    plain = run_split(backend, graph, [n["h"]], True, {n["x"].id: x})[n["h"].id]
    nodes = [node for node in graph.nodes if node.op != "input"]
    rewritten = apply_rewrite_rules(nodes, nb.NumpyBackend.rewrite_rules, {n["h"].id})
    assert n["act"] not in rewritten and n["h"].op == "swiglu" and n["h"].inputs == (n["gate"], n["up"])
    split = Split(backend, rewritten, [n["x"].id], [n["h"].id], last_uses(rewritten, {n["h"].id}))
    fused = backend.compile(split, {})({n["x"].id: x})[n["h"].id]
    np.testing.assert_array_equal(fused, plain)
    np.testing.assert_array_equal(fused, nb.silu(x @ backend.weights["gate"].T) * (x @ backend.weights["up"].T))


def test_a_rule_never_absorbs_a_value_read_elsewhere() -> None:
    backend = nb.NumpyBackend()
    graph, n = ffn_graph(backend)
    nodes = [node for node in graph.nodes if node.op != "input"]
    # the silu is a split output (another split reads it): the pattern must not swallow it
    assert apply_rewrite_rules(list(nodes), nb.NumpyBackend.rewrite_rules, {n["act"].id, n["h"].id}) == nodes
    assert n["h"].op == "mul"
    other = RewriteRule("nothing", Pattern("add", (ANY, ANY)), "never")
    assert apply_rewrite_rules(list(nodes), (other,), set()) == nodes


def test_unprepared_groups_stay_separate_matmuls() -> None:
    """fuse_weights said no (or was never asked): the graph keeps its matmuls."""
    backend = nb.NumpyBackend()
    graph, n = ffn_graph(backend)
    (group,) = matmul_groups(graph, lambda name: backend)
    assert group.parts == ("gate", "up") and group.name == "gate+up"
    report = optimize(graph, {}, lambda name: backend)
    assert report.fused_matmuls == 0 and n["gate"].op == "mul_mat" and n["up"].op == "mul_mat"


@pytest.mark.parametrize("build,message", [
    (lambda g, x, w: g.add("mul_mat", w, g.add("reshape", x, shape=(8, 3))), "cannot multiply"),
    (lambda g, x, w: g.add("add", x, g.leaf("input", "pos", (4,), "i32")), "must be f32"),
    (lambda g, x, w: g.add("mul", x, g.leaf("weight", "bad", (5,))), "do not broadcast"),
    (lambda g, x, w: g.add("reshape", x, shape=(5, -1)), "cannot reshape"),
    (lambda g, x, w: g.add("reshape", x, shape="3x8"), "reshape needs a shape"),
    (lambda g, x, w: g.add("slice", x, axis=2, start=0, stop=1), "slice axis"),
    (lambda g, x, w: g.add("get_rows", w, x), "row ids"),
    (lambda g, x, w: g.add("rms_norm", x, g.leaf("weight", "n", (2, 1, 8)), eps=1e-5), "does not fit"),
    (lambda g, x, w: g.add("silu", x, x), "takes 1..1 inputs"),
    (lambda g, x, w: g.add("rope", g.add("reshape", x, shape=(3, 2, 4)), g.leaf("input", "pos", (3,), "i32"),
                           n_dims=6), "n_dims"),
])
def test_the_shape_check_rejects_a_malformed_node(build, message) -> None:
    g = Graph()
    x = g.leaf("input", "embd", (3, 8))
    w = g.leaf("weight", "w", (16, 8))
    with pytest.raises(ModelError, match=message) as error:
        build(g, x, w)
    assert "graph node %" in str(error.value)  # the node is named


def test_attention_heads_and_token_counts_are_checked() -> None:
    g = Graph()
    q = g.leaf("input", "q", (2, 6, 4))
    k = g.leaf("input", "k", (2, 4, 4))  # 6 query heads cannot share 4 KV heads
    idx = g.leaf("input", "kv_idx:kv", (2,), "i64")
    mask = g.leaf("input", "kq_mask:kv", (2, 16))
    with pytest.raises(ModelError, match="heads do not match"):
        g.add("attention", q, k, k, idx, mask, layer=0, cache="kv", scale=0.5)
    k2 = g.leaf("input", "k2", (2, 2, 4))
    out = g.add("attention", q, k2, k2, idx, mask, layer=0, cache="kv", scale=0.5)
    assert out.shape == (2, 24) and out.dtype == "f32"
    short = g.leaf("input", "idx3", (3,), "i64")
    with pytest.raises(ModelError, match="token count"):
        g.add("attention", q, k2, k2, short, mask, layer=0, cache="kv", scale=0.5)


def test_dynamic_dimensions_pass_the_check_and_stay_dynamic() -> None:
    g = Graph()
    shift = g.leaf("input", "k_shift:kv", (DYNAMIC,), "i32")
    assert g.add("k_shift", shift, layer=0, cache="kv", n_dims=4).shape == (0,)
    x = g.leaf("input", "x", (DYNAMIC, 8))
    assert g.add("reshape", x, shape=(-1, 2, 4)).shape == (-1, 2, 4)
    assert g.add("mul_mat", g.leaf("weight", "w", (3, 8)), x).shape == (DYNAMIC, 3)
    assert g.add("slice", x, axis=-1, start=2, stop=5).shape == (DYNAMIC, 3)


def test_a_norm_placed_apart_from_its_weight_keeps_running_where_it_was(smollm2_path) -> None:
    """With the layers on onnx, the first attention norm follows the host's embedding lookup (native where its
    extension is built, else numpy): it stays a plain norm there, as before the passes, and its weight multiplies
    on onnx."""
    pytest.importorskip("onnxruntime")
    with llmfw.load_model(smollm2_path, backend="onnx") as model:
        _, plan = decode_plan(model, 3)
        host, rest = plan.splits[0], plan.splits[1:]
        assert host.backend is model.host_backend and host.backend.name in ("native", "numpy")
        assert [n.op for n in host.nodes][-1] == "rms_norm"
        assert len(host.nodes[-1].inputs) == 1
        first_mul = next(n for n in rest[0].nodes if n.op == "mul")
        assert host.nodes[-1] in first_mul.inputs
        norms = [n for split in rest for n in split.nodes if n.op == "rms_norm"]
        assert len(norms) == 2 * model.n_layer and all(len(n.inputs) == 2 for n in norms)


# -- fusion keys: a group of mixed quant layouts fuses its same-layout subsets ---------------------------------

def quantized_source(name: str, values: np.ndarray, qtype: GGMLType) -> WeightSource:
    raw = quantize(values, qtype).reshape(-1).view(np.uint8)
    return WeightSource(name=name, source_name=name, ggml_type=int(qtype), ne=tuple(reversed(values.shape)),
                        raw=raw, usage=frozenset({"mul_mat"}))


#: one input times five weights: Q4_0 and Q4_1 share the onnx block layout (4 bits, blocks of 32), Q8_0 another,
#: and the float one is never fused
MIXED = (("q", GGMLType.Q4_0, 32), ("k", GGMLType.Q8_0, 16), ("v", GGMLType.Q4_1, 16), ("o", GGMLType.Q8_0, 24),
         ("f", GGMLType.F32, 8))


def mixed_group_graph() -> Graph:
    g = Graph()
    x = g.leaf("input", "x", (3, 64))
    g.inputs["x"] = x
    for name, _, n_out in MIXED:
        g.outputs[name] = g.add("mul_mat", g.leaf("weight", name, (n_out, 64)), x)
    return g


def run_graph(backend, graph: Graph, x: np.ndarray) -> dict[str, np.ndarray]:
    split = Split(backend, [n for n in graph.nodes if n.op != "input"], [graph.inputs["x"].id],
                  [n.id for n in graph.outputs.values()])
    values = backend.compile(split, {})({graph.inputs["x"].id: backend.from_numpy(x)})
    return {name: backend.to_numpy(values[n.id]) for name, n in graph.outputs.items()}


def test_a_mixed_group_is_fused_into_its_same_key_subsets() -> None:
    pytest.importorskip("onnxruntime")
    from llmfw.plugins.backends.onnx import OnnxBackend

    backend = OnnxBackend()
    for name, qtype, n_out in MIXED:
        backend.weights[name] = backend.load_weight(quantized_source(name, randn(n_out, 64), qtype))
    assert backend.fusion_key("q") == backend.fusion_key("v") != backend.fusion_key("k") == backend.fusion_key("o")
    assert backend.fusion_key("f") is None and backend.fusion_key("absent") is None
    x = randn(3, 64)
    separate = run_graph(backend, mixed_group_graph(), x)

    graph = mixed_group_graph()
    prepared = fuse_weight_groups(graph, lambda name: backend)
    assert prepared == {("q", "v"): "q+v", ("k", "o"): "k+o"}  # members in graph order, "f" left alone
    assert backend.weights["q+v"].shape == (48, 64) and backend.weights["k+o"].shape == (40, 64)
    assert optimize(graph, prepared, lambda name: backend).fused_matmuls == 2
    fused = {n.attrs["name"] for n in graph.nodes if n.op == "weight" and "parts" in n.attrs}
    assert fused == {"q+v", "k+o"}
    assert sum(n.op == "mul_mat" for n in graph.nodes) == 3  # two fused products and the float matmul
    got = run_graph(backend, graph, x)
    for name in separate:
        np.testing.assert_allclose(got[name], separate[name], rtol=1e-5, atol=1e-5)
    # numpy keys every weight alike (it dequantizes them all): the same group there is fused whole
    numpy_backend = nb.NumpyBackend()
    for name, qtype, n_out in MIXED:
        numpy_backend.weights[name] = numpy_backend.load_weight(quantized_source(name, randn(n_out, 64), qtype))
    assert list(fuse_weight_groups(mixed_group_graph(), lambda name: numpy_backend)) == [("q", "k", "v", "o", "f")]


def test_a_group_of_singletons_by_key_is_left_alone() -> None:
    """Every weight keyed differently (or None): no sub-group of two, nothing asked of fuse_weights."""
    graph = mixed_group_graph()
    keys = {"q": 1, "k": 2, "v": 3, "o": None, "f": None}
    assert matmul_groups(graph, lambda name: None, keys.get) == []
    assert [g.parts for g in matmul_groups(graph, lambda name: None, lambda name: name in "qvf")] == [("q", "v", "f"),
                                                                                                    ("k", "o")]


def two_input_graph() -> tuple[Graph, dict[str, np.ndarray]]:
    """``a`` multiplies both inputs: it is a part of two groups."""
    g = Graph()
    xs = {name: g.leaf("input", name, (3, 8)) for name in ("x1", "x2")}
    g.inputs.update(xs)
    for out, (w, x) in {"a1": ("a", "x1"), "b1": ("b", "x1"), "a2": ("a", "x2"), "c2": ("c", "x2")}.items():
        g.outputs[out] = g.add("mul_mat", g.leaf("weight", w, (16, 8)), xs[x])
    return g, {"x1": randn(3, 8), "x2": randn(3, 8)}


def run_two_inputs(backend, graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    split = Split(backend, [n for n in graph.nodes if n.op != "input"], [graph.inputs[k].id for k in inputs],
                  [n.id for n in graph.outputs.values()])
    values = backend.compile(split, {})({graph.inputs[k].id: v for k, v in inputs.items()})
    return {name: values[n.id] for name, n in graph.outputs.items()}


def test_only_prepared_subsets_in_graph_order_are_fused_and_a_shared_part_joins_both() -> None:
    backend = nb.NumpyBackend()
    backend.weights.update(a=randn(16, 8), b=randn(16, 8), c=randn(16, 8))
    graph, inputs = two_input_graph()
    separate = run_two_inputs(backend, graph, inputs)
    assert optimize(two_input_graph()[0], {("b", "a"): "b+a", ("a", "b"): "a-b"}, lambda n: backend).fused_matmuls == 0
    prepared = fuse_weight_groups(graph, lambda name: backend)
    assert prepared == {("a", "b"): "a+b", ("a", "c"): "a+c"}
    assert optimize(graph, prepared, lambda name: backend).fused_matmuls == 2
    got = run_two_inputs(backend, graph, inputs)
    for name in separate:
        np.testing.assert_allclose(got[name], separate[name], rtol=1e-6, atol=1e-6)


def test_gemma3_onnx_fuses_every_same_layout_subset(gemma3_path) -> None:
    """Gemma-3's Q4_K_M file mixes quant types within groups (V in Q8_0 beside Q/K in Q5_0): the onnx backend
    fuses every subset of one block layout, and each fused weight is of one layout. (It holds Q5_0 and Q8_0 alike,
    as 8-bit codes in blocks of 32, so here every whole group is one such subset.)"""
    pytest.importorskip("onnxruntime")
    with llmfw.load_model(gemma3_path, backend="onnx") as model:
        graph = representative_graph(model)
        assert graph is not None
        backend = model.weight_backend("blk.0.attn_q.weight")
        whole = matmul_groups(graph, model.weight_backend)
        subsets = matmul_groups(graph, model.weight_backend, backend.fusion_key)
        assert len(whole) == 2 * model.n_layer  # Q/K/V and gate/up of each layer
        assert sorted(model.fused_weights) == sorted(g.parts for g in subsets)
        for parts, name in model.fused_weights.items():
            assert len({backend.fusion_key(p) for p in parts}) == 1
            assert backend.weights[name].shape[0] == sum(backend.weights[p].shape[0] for p in parts)
        qkv = model.fused_weights[("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight")]
        assert backend.weights[qkv].source_type == "Q5_0+Q8_0"  # mixed types, one layout: fused
