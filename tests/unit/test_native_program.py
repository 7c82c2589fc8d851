"""The native backend's compiled programs: each op of the core IR compiled into a program and run by the C
interpreter against the numpy backend's compiler on the same split (the oracle); the checker that refuses a
program reaching outside its buffers before C runs it; the run-time checks of what only the data decides; and the
thread pool (no worker thread for one thread)."""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from llmfw.core.exec.backend import KVLayerShape, Split
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import Node

from llmfw.core.quants import GGMLType
from support.native import kernels_or_skip, random_blocks, random_float_tensor
from support.native_graph import Graph, both, native_and_oracle

kernels = kernels_or_skip()

from llmfw.plugins.backends.native import program as pg  # noqa: E402
from llmfw.plugins.backends.native import repack as rp  # noqa: E402

RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def backends():
    yield from native_and_oracle()


def f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("op,attrs", [("silu", {}), ("gelu", {}), ("relu", {}), ("sigmoid", {}), ("softplus", {}),
                                      ("scale", {"s": 0.125}), ("softcap", {"cap": 3.0}),
                                      ("clamp", {"min": -0.5, "max": 0.7})])
def test_unary_ops_match_the_oracle(backends, op, attrs):
    g = Graph()
    x = g.input(f32(5, 3, 40, scale=4.0))
    out = g.op(op, x, out=(5, 3, 40), **attrs)
    got, expected = both(g, out, backends)
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("b_shape", [(6, 4, 16), (16,), (6, 1, 1), (1, 4, 1)])
def test_binary_ops_broadcast_like_numpy(backends, op, b_shape):
    g = Graph()
    a = g.input(f32(6, 4, 16))
    b = g.input(f32(*b_shape) + 3.0)
    out = g.op(op, a, b, out=(6, 4, 16))
    got, expected = both(g, out, backends)
    assert np.array_equal(got, expected)  # one float operation per element: the same bits


@pytest.mark.parametrize("op", ["rms_norm", "norm"])
@pytest.mark.parametrize("with_weight", [False, True])
def test_norms_match_the_oracle(backends, op, with_weight):
    g = Graph()
    x = g.input(f32(7, 48, scale=3.0) + 1.0)
    extra = [g.weight("norm.weight", f32(48))] if with_weight else []
    out = g.op(op, x, *extra, out=(7, 48), eps=1e-5)
    got, expected = both(g, out, backends)
    np.testing.assert_allclose(got, expected, rtol=3e-6, atol=3e-6)


def test_softmax_swiglu_slices_reshapes_and_row_lookups_match_the_oracle(backends):
    g = Graph()
    x = g.input(f32(6, 2, 32, scale=2.0))
    flat = g.op("reshape", x, out=(6, 64), shape=(6, 64))
    gate = g.op("slice", flat, out=(6, 24), axis=-1, start=8, stop=32)
    up = g.op("slice", flat, out=(6, 24), axis=-1, start=40, stop=64)
    h = g.op("swiglu", gate, up, out=(6, 24))
    middle = g.op("slice", x, out=(6, 1, 32), axis=1, start=1, stop=2)
    rows = g.op("get_rows", h, g.input(np.array([5, 0, 5, 2], np.int32)), out=(4, 24))
    soft = g.op("softmax", rows, out=(4, 24))
    for output, tolerance in ((soft, 1e-6), (middle, 0.0)):
        got, expected = both(g, output, backends)
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance / 10)


ROPE = {"freq_base": 10000.0, "freq_scale": 1.0, "ext_factor": 0.0, "attn_factor": 1.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "n_ctx_orig": 4096}


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("variant", ["plain", "partial", "factors", "yarn"])
def test_rope_matches_the_oracle(backends, mode, variant):
    g = Graph()
    x = g.input(f32(5, 3, 32))
    pos = g.input(np.array([0, 3, 17, 250, 1999], np.int32))
    attrs = dict(ROPE, n_dims=16 if variant == "partial" else 32, mode=mode)
    extra = []
    if variant == "factors":
        extra = [g.weight("rope_freqs.weight", (1.0 + RNG.random(16) * 7).astype(np.float32))]
    if variant == "yarn":
        attrs.update(freq_scale=0.25, ext_factor=1.0, n_ctx_orig=512)
    out = g.op("rope", x, pos, *extra, out=(5, 3, 32), **attrs)
    got, expected = both(g, out, backends)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-5)


def kv_pair(backend, n_cells=32, n_head_kv=2, dk=16, dv=8):
    shape = KVLayerShape("kv", 0, n_cells, n_head_kv, dk, dv)
    return {("kv", 0): backend.alloc_kv(shape)}


def attention_graph(sinks: bool = False, order: np.ndarray | None = None, softcap: float = 0.0) -> tuple[Graph, Node]:
    """Five tokens written to cells 3..7 and attending causally past a window's hidden start (with ``order``, the
    kv_order input, and ``sinks``)."""
    g = Graph()
    n_tokens, n_kv = 5, 16
    q = g.input(f32(n_tokens, 6, 16))
    k = g.input(f32(n_tokens, 2, 16))
    v = g.input(f32(n_tokens, 2, 8))
    cells = g.input(np.array([3, 4, 5, 6, 7], np.int64))
    visible = np.arange(n_kv)[None, :] <= 3 + np.arange(n_tokens)[:, None]
    visible[:, :2] = False  # a sliding window's hidden start
    mask = g.input(np.where(visible, 0.0, -np.inf).astype(np.float32))
    extra = ([] if order is None else [g.input(order)]) + ([g.weight("sinks", f32(6))] if sinks else [])
    out = g.op("attention", q, k, v, cells, mask, *extra, out=(n_tokens, 48), layer=0, cache="kv", scale=0.25,
               softcap=softcap, window=0)
    return g, out


@pytest.mark.parametrize("softcap,sinks,ordered", [(0.0, False, False), (20.0, False, False), (0.0, True, False),
                                                   (0.0, True, True), (20.0, False, True)])
def test_attention_writes_the_cache_and_attends_like_the_oracle(backends, softcap, sinks, ordered):
    order = np.random.default_rng(3).permutation(16).astype(np.int32) if ordered else None  # any order: same sums
    g, out = attention_graph(sinks, order, softcap)
    results = []
    for backend in backends:
        kv = kv_pair(backend)
        kv[("kv", 0)].k[:, :3] = 0.5
        kv[("kv", 0)].v[:, :3] = -0.25
        results.append((g.run(backend, out, kv), kv[("kv", 0)]))
    (got, got_kv), (expected, expected_kv) = results
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.array_equal(got_kv.k, expected_kv.k) and np.array_equal(got_kv.v, expected_kv.v)


def test_an_attention_order_outside_the_cells_fails_the_run_and_a_misshapen_one_the_compile(backends):
    g, out = attention_graph(order=np.array([*range(15), 16], np.int32))  # cell 16 of 16
    with pytest.raises(ModelError, match="outside its table"):
        g.run(backends[0], out, kv_pair(backends[0]))
    g, out = attention_graph(order=np.arange(16, dtype=np.int64))
    with pytest.raises(ModelError, match="kv_order"):
        g.run(backends[0], out, kv_pair(backends[0]))


def test_k_shift_rotates_the_cached_keys_like_the_oracle(backends):
    g = Graph()
    shift = g.input(np.array([5, 5, 5, -2, 0, 7], np.int32))
    out = g.op("k_shift", shift, out=(0,), layer=0, cache="kv", n_dims=16, mode="neox", **ROPE)
    caches = []
    for backend in backends:
        kv = kv_pair(backend)
        kv[("kv", 0)].k[:] = np.arange(kv[("kv", 0)].k.size, dtype=np.float32).reshape(kv[("kv", 0)].k.shape) / 97
        g.run(backend, out, kv)
        caches.append(kv[("kv", 0)].k)
    np.testing.assert_allclose(caches[0], caches[1], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def f16_backends():
    """Native backends with an f16 KV cache on each ISA path this CPU runs, and one with a float32 cache."""
    from llmfw.plugins.backends.native.runtime import NativeBackend, NativeOptions
    made = {isa: NativeBackend(options=NativeOptions(isa=isa, kv_type="f16")) for isa in kernels.available_isas()}
    yield made, NativeBackend(options=NativeOptions(kv_type="f32"))


def test_an_f16_cache_holds_each_value_rounded_to_nearest_even_on_every_isa_path(f16_backends):
    """The KV write rounds as numpy's float16 conversion does (IEEE, ties to even): ties, subnormals, the least
    normal, overflow to inf, infinities and NaN, through both the vector and the scalar tail of each row."""
    specials = np.array([0.0, -0.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -24,
                         2.0 ** -14 - 2.0 ** -25, 6e-8, -6.1e-5, 65504.0, 65519.99, 65520.0, 1e6, np.inf, -np.inf,
                         np.nan, -np.nan, 0.1, -3.14159], np.float32)
    g = Graph()
    values = np.resize(specials, (5, 2, 20))  # rows of 20: two vectors of 8 and a scalar tail of 4
    values[:, 1] = f32(5, 20) * 1000
    q, k, v = g.input(f32(5, 6, 20)), g.input(values), g.input(values[:, :, :12].copy())
    cells = g.input(np.array([3, 4, 5, 6, 7], np.int64))
    mask = g.input(np.zeros((5, 16), np.float32))
    out = g.op("attention", q, k, v, cells, mask, out=(5, 72), layer=0, cache="kv", scale=0.25, softcap=0.0,
               window=0)
    with np.errstate(over="ignore"):  # 1e6 to inf, as intended
        expected = values.transpose(1, 0, 2).astype(np.float16).view(np.uint16)
    backends, _ = f16_backends
    for isa, backend in backends.items():
        kv = kv_pair(backend, dk=20, dv=12)
        with np.errstate(invalid="ignore"):
            g.run(backend, out, kv)
        stored = kv[("kv", 0)].k[:, 3:8]
        assert stored.dtype == np.float16
        assert np.array_equal(stored.view(np.uint16), expected), isa


def test_an_f16_cache_attends_and_shifts_keys_with_the_bits_of_a_float32_cache_of_its_values(f16_backends):
    """A graph over an f16 cache gives what the same graph gives over a float32 cache holding the f16 values (its
    inputs rounded the same way): attention reads widened values, and a K shift rotates the widened keys and rounds
    them back."""
    backends, exact = f16_backends
    g, out = attention_graph()
    k_node, v_node = g.nodes[-1].inputs[1:3]
    shift = Graph()
    shift_out = shift.op("k_shift", shift.input(np.array([5, 5, 5, -2, 0, 7], np.int32)), out=(0,), layer=0,
                         cache="kv", n_dims=16, mode="neox", **ROPE)
    start = (np.arange(2 * 32 * 16, dtype=np.float32).reshape(2, 32, 16) / 97).astype(np.float16)
    reference_kv = kv_pair(exact)
    reference_kv[("kv", 0)].k[:] = start
    exact_graph = Graph()
    exact_graph.nodes, exact_graph.weights = g.nodes, g.weights
    exact_graph.inputs = {i: (value.astype(np.float16).astype(np.float32) if i in (k_node.id, v_node.id) else value)
                          for i, value in g.inputs.items()}
    expected = exact_graph.run(exact, out, reference_kv)
    shift.run(exact, shift_out, reference_kv)
    for isa, backend in backends.items():
        kv = kv_pair(backend)
        kv[("kv", 0)].k[:] = start
        assert np.array_equal(g.run(backend, out, kv), expected), isa
        shift.run(backend, shift_out, kv)
        assert np.array_equal(kv[("kv", 0)].k, reference_kv[("kv", 0)].k.astype(np.float16)), isa
        assert np.array_equal(kv[("kv", 0)].v, reference_kv[("kv", 0)].v.astype(np.float16)), isa


def fused_step_graph(n_tokens: int = 5) -> tuple[Graph, Node]:
    """A batched step's fused matmul output (q | k | v | gate | up columns of each token's row) cut into columns:
    q and k normed per head and rotated, k and v written to the cache and attended, gate and up through SwiGLU and
    through GELU times up (an elementwise pair), and v also concatenated (an op that reads rows contiguously); the
    results side by side."""
    g = Graph()
    fused = g.input(f32(n_tokens, 96 + 32 + 16 + 48))

    def columns(start: int, stop: int, shape: tuple[int, ...]) -> Node:
        cut = g.op("slice", fused, out=(n_tokens, stop - start), axis=-1, start=start, stop=stop)
        return g.op("reshape", cut, out=shape, shape=shape)

    def normed_and_rotated(start: int, n_head: int) -> Node:
        heads = columns(start, start + 16 * n_head, (n_tokens, n_head, 16))
        normed = g.op("rms_norm", heads, out=(n_tokens, n_head, 16), eps=1e-6)
        return g.op("rope", normed, pos, out=(n_tokens, n_head, 16), n_dims=16, mode="neox", **ROPE)

    pos = g.input(np.arange(3, 3 + n_tokens, dtype=np.int32))
    q, k = normed_and_rotated(0, 6), normed_and_rotated(96, 2)
    v = columns(128, 144, (n_tokens, 2, 8))
    cells = g.input(np.arange(3, 3 + n_tokens, dtype=np.int64))
    visible = np.arange(16)[None, :] <= 3 + np.arange(n_tokens)[:, None]
    mask = g.input(np.where(visible, 0.0, -np.inf).astype(np.float32))
    parts = [g.op("attention", q, k, v, cells, mask, out=(n_tokens, 48), layer=0, cache="kv", scale=0.25,
                  softcap=0.0, window=0),
             g.op("swiglu", columns(144, 168, (n_tokens, 24)), columns(168, 192, (n_tokens, 24)), out=(n_tokens, 24)),
             g.op("mul", g.op("gelu", columns(144, 168, (n_tokens, 24)), out=(n_tokens, 24)),
                  columns(168, 192, (n_tokens, 24)), out=(n_tokens, 24)),
             g.op("reshape", v, out=(n_tokens, 16), shape=(n_tokens, 16))]
    out = parts[0]
    for part in parts[1:]:
        out = g.op("concat", out, part, out=(n_tokens, out.shape[1] + part.shape[1]))
    return g, out


def compiled(backend, g: Graph, output: Node, kv):
    """``g``'s split compiled on ``backend`` (its program: ``.programs[()][0]``; called with inputs, it runs)."""
    backend.weights.update(g.weights)
    split = Split(backend, nodes=list(g.nodes), input_ids=list(g.inputs), output_ids=[output.id])
    return backend.compile(split, kv)


def program_labels(backend, g: Graph, output: Node, kv) -> list[str]:
    return compiled(backend, g, output, kv).programs[()][0].labels


def test_column_slices_of_a_batched_step_are_read_in_place_by_the_ops_that_take_row_strides(backends):
    g, out = fused_step_graph()
    results = [g.run(backend, out, kv_pair(backend)) for backend in backends]
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-5)
    labels = program_labels(backends[0], g, out, kv_pair(backends[0]))
    # one copy, v's for the concat; the norms, rope, the cache write, SwiGLU, GELU and mul read the columns in place
    assert labels.count("slice") == 1
    assert {"rms_norm", "rope", "kv_write", "attention", "swiglu", "gelu", "mul", "concat"} <= set(labels)


def test_the_ropes_of_a_run_share_one_table_of_angles(backends):
    """q and k rotated at the same positions read one table of cos / sin, worked out once a run."""
    g, out = fused_step_graph()
    ops = list(compiled(backends[0], g, out, kv_pair(backends[0])).programs[()][0].instrs["op"])
    assert ops.count(pg.ROPE_ANGLES) == 1 and ops.count(pg.ROPE) == 2
    assert ops.index(pg.ROPE_ANGLES) < ops.index(pg.ROPE)


@pytest.mark.parametrize("isa", ["scalar", "auto"])
def test_a_rope_reading_the_table_gives_the_bits_of_one_that_works_out_its_angles(isa):
    """ROPE_ANGLES then ROPE with the table, against ROPE alone: 3 tokens, 2 heads of 16, YaRN's mix included."""
    x = f32(3, 2, 16)
    pos = np.array([5, 0, 1234], np.int32)
    mix = RNG.random(8).astype(np.float32)
    f = [10000.0 ** (-2.0 / 16), 0.5, 1.1, 1.0]
    rope = [3, 2, 16, 16, 1, 32, 16, 32, 16, 0]

    def run(with_table: bool) -> np.ndarray:
        buffers = [x.ravel(), pos, mix]  # buffers 1, 2, 3; the arena: out [0, 96), the table [96, 144)
        table = pg.Operand(0, 96) if with_table else pg.NONE
        instrs = [pg.Instr(pg.ROPE, [pg.Operand(0, 0), pg.Operand(1, 0), pg.Operand(2, 0), pg.NONE, pg.Operand(3, 0),
                                     table], rope, f)]
        if with_table:
            instrs.insert(0, pg.Instr(pg.ROPE_ANGLES, [table, pg.NONE, pg.Operand(2, 0), pg.NONE, pg.Operand(3, 0)],
                                      [3, 0, 0, 16], f))
        program = pg.Program(instrs, 144, buffers, [False] * 3, [], [])
        pool = kernels.ThreadPool(2)
        program.run(pool, kernels.resolve_isa(isa))
        pool.close()
        return program.arena[:96].copy()

    assert np.array_equal(run(True), run(False))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.F16], ids=lambda t: t.name)
def test_a_residual_add_after_a_matmul_is_done_by_the_matmul_with_the_adds_bits(backends, qtype):
    """mul_mat then add of another value (a residual connection): the matmul adds it as its threads finish their
    rows, one instruction, the same bits as the add; a product something else also reads keeps its own add."""
    from llmfw.plugins.backends.native.compiler import native_matrix

    rng = np.random.default_rng(11)
    n_rows = 45
    raw = (random_blocks(qtype, n_rows, 4, rng) if qtype != GGMLType.F16
           else random_float_tensor(qtype, n_rows, 128, rng))
    matrix = native_matrix(rp.repack(raw, qtype, (128, n_rows)))
    x, residual = f32(5, 128), f32(5, n_rows)
    results, ops = [], []
    for also_read in (False, True):
        g = Graph()
        w = g.weight("w", matrix)
        xs, rs = g.input(x), g.input(residual)
        product = g.op("mul_mat", w, xs, out=(5, n_rows))
        out = g.op("add", rs, product, out=(5, n_rows))
        if also_read:  # a second reader of the product: the add stays an op of its own
            out = g.op("add", out, g.op("mul", product, g.input(np.zeros((5, n_rows), np.float32)), out=(5, n_rows)),
                       out=(5, n_rows))
        run = compiled(backends[0], g, out, {})
        ops.append(list(run.programs[()][0].instrs["op"]))
        results.append(np.asarray(run({i: v.copy() for i, v in g.inputs.items()})[out.id]))
    assert pg.BINARY not in ops[0][:2] and ops[0][0] == pg.MUL_MAT and len(ops[0]) == 1
    assert ops[1].count(pg.BINARY) == 3
    assert np.array_equal(results[0], results[1])  # the second adds +0 (products are finite): the same bits


def test_row_lookups_read_a_paired_weight_as_its_values(backends):
    """get_rows of a Q4_1 table with its row groups in pairs (the layout the AVX2 path takes): the dequantizer's
    values, the bits of the same table apart, rows of the last group alone included."""
    from llmfw.core.quants import dequantize
    from llmfw.plugins.backends.native.compiler import native_matrix

    rng = np.random.default_rng(12)
    n_rows = 53  # seven groups: three pairs and a last group alone
    raw = random_blocks(GGMLType.Q4_1, n_rows, 4, rng)
    ids = np.array([52, 0, 9, 17, 48, 40, 8], np.int32)
    results = []
    for paired in (False, True):
        g = Graph()
        w = g.weight("w", native_matrix(rp.repack(raw, GGMLType.Q4_1, (128, n_rows), paired)))
        out = g.op("get_rows", w, g.input(ids), out=(len(ids), 128))
        run = compiled(backends[0], g, out, {})
        results.append(np.asarray(run({i: v.copy() for i, v in g.inputs.items()})[out.id]))
    assert np.array_equal(results[1], results[0])
    assert np.array_equal(results[1], dequantize(raw, GGMLType.Q4_1, (128, n_rows))[ids])


def test_a_column_slice_that_is_a_splits_output_comes_out_contiguous(backends):
    g = Graph()
    x = g.input(f32(4, 40))
    out = g.op("slice", x, out=(4, 24), axis=-1, start=8, stop=32)
    got, expected = both(g, out, backends)
    assert np.array_equal(got, expected) and np.array_equal(got, g.inputs[x.id][:, 8:32])


def test_each_run_writes_its_outputs_into_new_arrays_that_later_runs_leave_alone(backends):
    """A split output has a buffer of its own that each run points at a new array: the op computing it writes it
    there (no copy instruction, no copy out of the arena), and an array handed out stays as it was after the next
    run."""
    g = Graph()
    x = g.input(f32(3, 16))
    out = g.op("relu", x, out=(3, 16))
    run = compiled(backends[0], g, out, {})
    assert list(run.programs[()][0].instrs["op"]) == [pg.UNARY]
    first_input, second_input = f32(3, 16), f32(3, 16)
    first = run({x.id: first_input})[out.id]
    second = run({x.id: second_input})[out.id]
    assert not np.shares_memory(first, second)
    assert np.array_equal(first, np.maximum(first_input, 0)) and np.array_equal(second, np.maximum(second_input, 0))


def test_an_output_that_is_a_view_or_an_input_is_copied_into_its_own_array(backends):
    g = Graph()
    x = g.input(f32(4, 6))
    reshaped = g.op("reshape", x, out=(6, 4), shape=(6, 4))
    run = compiled(backends[0], g, reshaped, {})
    values = f32(4, 6)
    got = run({x.id: values})[reshaped.id]
    assert got.shape == (6, 4) and np.array_equal(got, values.reshape(6, 4))
    assert list(run.programs[()][0].instrs["op"]) == [pg.SLICE]


def test_an_empty_output_that_is_a_view_compiles_to_no_copy(backends):
    g = Graph()
    x = g.input(np.zeros((0, 6), np.float32))
    reshaped = g.op("reshape", x, out=(0, 3), shape=(0, 3))
    run = compiled(backends[0], g, reshaped, {})
    assert run({x.id: np.zeros((0, 6), np.float32)})[reshaped.id].shape == (0, 3)
    assert len(run.programs[()][0].instrs) == 0


def test_an_output_buffer_takes_only_an_array_of_its_own_size():
    program = pg.Program([], 16, [pg.output_array(8)], [True], [], [], outputs=[1])
    program.rebind(1, pg.output_array(8))
    with pytest.raises(pg.ProgramError, match="32 bytes, not 36"):
        program.rebind(1, pg.output_array(9))
    with pytest.raises(pg.ProgramError, match="not an output buffer"):
        program.rebind(0, np.zeros(16, np.float32))
    with pytest.raises(pg.ProgramError, match="is not a writable buffer"):
        pg.Program([], 16, [np.zeros(8, np.float32)], [False], [], [], outputs=[1])


def test_an_op_without_a_kernel_is_refused_naming_it(backends):
    g = Graph()
    x = g.input(f32(4, 8))
    out = g.op("no_such_op", x, out=(4, 2), dtype="i32", k=2)  # every op of the IR has a kernel now
    with pytest.raises(ModelError, match="cannot compile op 'no_such_op'"):
        g.run(backends[0], out)


# -- the checker -----------------------------------------------------------------------------------------------

def small_program(**changes) -> tuple[list[pg.Instr], dict]:
    """One RMS norm of 4 rows of 16 (arena words 0..63 → 64..127) with a read-only weight buffer."""
    instr = pg.Instr(pg.RMS_NORM, [pg.Operand(0, 64), pg.Operand(0, 0), pg.Operand(1, 0)], [4, 16, 4, 64], [1e-6])
    for key, value in changes.items():
        setattr(instr, key, value)
    return [instr], {"arena_words": 128, "buffers": [np.ones(16, np.float32)], "writable": [False], "weights": [],
                     "weight_infos": []}


def test_a_checked_program_runs_and_its_instructions_are_frozen():
    instrs, parts = small_program()
    program = pg.Program(instrs, **parts)
    program.arena[:64] = 2.0
    pool = kernels.ThreadPool(1)
    program.run(pool, "scalar")
    pool.close()
    np.testing.assert_allclose(program.arena[64:128], 1.0, rtol=1e-6)
    with pytest.raises(ValueError):
        program.instrs[0]["off"][0] = 10**9  # what was checked is what runs


@pytest.mark.parametrize("change,reason", [
    ({"args": [pg.Operand(0, 100), pg.Operand(0, 0), pg.Operand(1, 0)]}, "spans words"),
    ({"args": [pg.Operand(0, -8), pg.Operand(0, 0), pg.Operand(1, 0)]}, "spans words"),
    ({"args": [pg.Operand(0, 64), pg.Operand(7, 0), pg.Operand(1, 0)]}, "names buffer 7"),
    ({"args": [pg.Operand(1, 0), pg.Operand(0, 0), pg.Operand(1, 0)]}, "spans words"),
    ({"args": [pg.Operand(1, 0), pg.Operand(0, 0)], "n": [1, 16, 1, 16]}, "writes read-only buffer"),
    ({"n": [4, 32, 4, 128]}, "spans words"),
    ({"n": [4, 16, 3, 64]}, "4 rows in groups of 3"),
    ({"n": [4, 16, 2, 24]}, "rows of 32, 24 words apart"),
    ({"n": [4, 16, 2, 100]}, "operand 1 spans"),
    ({"op": pg.UNARY, "n": [0, 64, 16, 8]}, "64 words in rows of 16, 8 words apart"),
    ({"n": [-4, 16]}, "out of range"),
    ({"op": 99}, "unknown op code"),
    ({"op": pg.MUL_MAT, "n": [0, 4]}, "weight 0 of 0"),
    ({"op": pg.GET_ROWS, "n": [4, 16, 1, 3]}, "ids of 4 or 8 bytes"),
    ({"op": pg.SLICE, "n": [4, 16, 10, 8]}, "slice 10\\+8"),
    ({"op": pg.SWIGLU, "n": [4, 16, 8, 16]}, "16 words 8 and 16 words apart"),
    ({"op": pg.SWIGLU, "n": [2, 16, 120, 16]}, "operand 1 spans"),
    ({"op": pg.KV_WRITE, "n": [1, 1, 8, 8, 4, 4, 8]}, "k and v 4 and 8 words apart"),
    ({"op": pg.ATTEND, "n": [1, 3, 2, 4, 4, 4, 4]}, "3 heads over 2 KV heads"),
    ({"op": pg.ATTEND, "n": [1, 3, 0, 4, 4, 4, 4]}, "3 heads over 0 KV heads"),
    ({"op": pg.ROPE_ANGLES, "n": [4, 0, 0, 15]}, "angles of 15 rotated dimensions"),
    ({"op": pg.ROPE_ANGLES, "n": [4, 0, 0, 32]}, "operand 0 spans"),
    ({"op": pg.ROPE, "args": [pg.Operand(0, 64), pg.Operand(0, 0), pg.Operand(0, 0), pg.NONE, pg.NONE,
                              pg.Operand(0, 100)], "n": [2, 1, 16, 16, 1, 16, 16, 16, 16, 0]}, "operand 5 spans"),
    ({"op": pg.BINARY, "n": [0, 1, 1, 4, 16, 0, 0, 64, 1, 0, 0, 0, 1]}, "operand 1 spans"),
])
def test_a_corrupted_program_is_refused_before_c_runs_it(change, reason):
    instrs, parts = small_program(**change)
    with pytest.raises(pg.ProgramError, match=reason):
        pg.Program(instrs, **parts)


@pytest.mark.parametrize("m,n_cols", [(1, 32), (4, 576), (3, 1536), (7, 96), (512, 2048)])
def test_the_checker_sizes_a_matmuls_activation_buffers_as_the_c_code_lays_them_out(m, n_cols):
    # the program's scratch for a quantized matmul is sized in Python and filled in C: a mismatch writes past it
    assert kernels.load_library().nat_act_words(m, n_cols, None, None) == pg.activation_words(m, n_cols)


def test_an_id_outside_its_table_fails_the_run_instead_of_reading_past_it():
    instr = pg.Instr(pg.GET_ROWS, [pg.Operand(0, 0), pg.Operand(1, 0), pg.Operand(0, 64)], [2, 8, 4, 4])
    program = pg.Program([instr], 80, [np.zeros(32, np.float32)], [False], [], [])
    program.arena[64:66].view(np.int32)[:] = [1, 4]  # the table has rows 0..3
    pool = kernels.ThreadPool(1)
    with pytest.raises(pg.ProgramError, match="outside its table"):
        program.run(pool, "scalar")
    pool.close()


# -- the pool --------------------------------------------------------------------------------------------------

def thread_count() -> int:
    """The native pools' worker threads in this process, by the name pool.c gives them: other libraries' threads
    (a server's, ONNX Runtime's, Ray's) come and go while the whole suite runs, so the count ignores them."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() == "llmfw-native"
        except OSError:  # a thread that ended while we looked
            pass
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_one_thread_starts_no_worker_and_n_threads_start_n_minus_one():
    gc.collect()  # an earlier test's unreachable backend would close its pool while this one counts
    before = thread_count()
    single = kernels.ThreadPool(1)
    assert thread_count() == before
    triple = kernels.ThreadPool(3)
    assert thread_count() == before + 2
    triple.close()
    single.close()
    assert thread_count() == before


def test_more_threads_than_cores_give_the_same_bits_as_one(backends):
    """Chunks are claimed by whichever thread is free, never assigned: a row's result does not depend on who ran
    it, even with far more threads than this machine's cores (most of them asleep or descheduled)."""
    g = Graph()
    x = g.input(f32(64, 128, scale=2.0))
    out = g.op("gelu", g.op("rms_norm", x, out=(64, 128), eps=1e-6), out=(64, 128))
    native = backends[0]
    results = []
    for n_threads in (1, 16):
        native.set_n_threads(n_threads)
        results.append(g.run(native, out))
    native.set_n_threads(2)
    assert np.array_equal(results[0], results[1])


def test_a_batch_without_output_rows_runs(backends):
    """A prompt decoded with no logits selects zero rows: zero-row values compile and run (nothing to compute)."""
    g = Graph()
    x = g.input(f32(5, 32))
    rows = g.op("get_rows", x, g.input(np.zeros(0, np.int32)), out=(0, 32))
    out = g.op("mul", g.op("rms_norm", rows, out=(0, 32), eps=1e-6), g.weight("w", f32(32)), out=(0, 32))
    got, expected = both(g, out, backends)
    assert got.shape == expected.shape == (0, 32)
