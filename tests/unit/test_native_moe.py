"""The native backend's mixture-of-experts ops (csrc/moe.c) against the numpy backend's (the oracle), on every ISA
path this CPU runs: ``mul_mat_id`` is bit for bit the dense matmul kernel of each row's expert, and a row's bits
do not depend on the batch around it or on the threads; the routing ops match numpy's (top_k's tie order
included); an expert id outside the table fails the run; the checker refuses a misfit program before C runs it."""
from __future__ import annotations

import numpy as np
import pytest

from llmfw.core.errors import ModelError
from llmfw.core.exec.backend import WeightSource
from llmfw.core.quants import TYPE_INFO, GGMLType, dequantize, tensor_nbytes
from llmfw.plugins.backends.numpy.runtime import NumpyBackend

from support.native import BLOCK_TYPES, kernels_or_skip, random_blocks, random_float_tensor
from support.native_graph import Graph

kernels = kernels_or_skip()

from llmfw.plugins.backends.native import program as pg  # noqa: E402
from llmfw.plugins.backends.native import repack as rp  # noqa: E402
from llmfw.plugins.backends.native.runtime import NativeBackend, NativeOptions  # noqa: E402

ISAS = kernels.available_isas()
RNG = np.random.default_rng(32)
#: (block type, columns): a 4-bit table kind, an 8-bit kind, one with offsets and 16-element scales, a float kind
EXPERT_TYPES = [(GGMLType.Q4_0, 64), (GGMLType.Q8_0, 64), (GGMLType.Q4_K, 256), (GGMLType.F16, 48)]


def f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture(scope="module")
def natives():
    """A native backend per ISA path, two threads each."""
    made = {isa: NativeBackend(options=NativeOptions(isa=isa)) for isa in ISAS}
    for backend in made.values():
        backend.set_n_threads(2)
    yield made
    for backend in made.values():
        backend.free_weights()


class Experts:
    """A 3-D weight [E, n_out, n_in] of one block type: its file bytes, values, and the per-expert dense weights
    the plain matmul kernel takes."""

    def __init__(self, qtype: GGMLType, n_expert: int, n_out: int, n_in: int, usage: str = "mul_mat_id"):
        self.qtype, self.ne = qtype, (n_in, n_out, n_expert)
        self.raw = random_blocks(qtype, n_expert * n_out, n_in // TYPE_INFO[qtype].block_size, RNG) \
            if qtype in BLOCK_TYPES else random_float_tensor(qtype, n_expert * n_out, n_in, RNG).view(np.uint8)
        self.dense = dequantize(self.raw, qtype, self.ne).reshape(n_expert, n_out, n_in)
        self.source = WeightSource("experts", "experts", int(qtype), self.ne, self.raw, frozenset({usage}))
        step = tensor_nbytes(qtype, (n_in, n_out))
        self.each = [rp.repack(self.raw[e * step:(e + 1) * step], qtype, (n_in, n_out)) for e in range(n_expert)]

    def handle(self, backend: NativeBackend) -> object:
        return backend.load_weight(self.source)


def mul_mat_id_graph(experts: Experts, x: np.ndarray, ids: np.ndarray) -> tuple[Graph, object]:
    g = Graph()
    w = g.weight("experts", experts.dense)
    out = g.op("mul_mat_id", w, g.input(x), g.input(ids), out=(ids.shape[0], ids.shape[1], experts.ne[1]))
    return g, out


def run_native(backend: NativeBackend, experts: Experts, g: Graph, out: object) -> np.ndarray:
    g.weights["experts"] = experts.handle(backend)
    return g.run(backend, out)


@pytest.mark.parametrize("qtype,n_in", EXPERT_TYPES)
@pytest.mark.parametrize("n_out", [16, 12])  # 12: the last row group of each expert is padded
@pytest.mark.parametrize("per_slot", [False, True])
def test_mul_mat_id_is_each_rows_expert_matmul_bit_for_bit(natives, qtype, n_in, n_out, per_slot):
    experts = Experts(qtype, 6, n_out, n_in)
    n_tokens, n_used = 5, 3
    x = f32(n_tokens, n_used, n_in) if per_slot else f32(n_tokens, n_in)
    ids = np.array([[0, 5, 2], [5, 2, 0], [3, 3, 1], [2, 0, 5], [1, 5, 2]], np.int32)  # expert 4: never chosen
    g, out = mul_mat_id_graph(experts, x, ids)
    oracle = g.run(NumpyBackend(), out)
    for isa, backend in natives.items():
        got = run_native(backend, experts, g, out)
        for t in range(n_tokens):
            for j in range(n_used):
                row = x[t, j] if per_slot else x[t]
                dense = kernels.mul_mat(experts.each[ids[t, j]], row[None], backend.pool, isa)[0]
                assert np.array_equal(got[t, j], dense), (isa, t, j)
        # the dense kernel's 8-bit activations (float weights: none) against the float oracle
        bound = 1e-5 if qtype == GGMLType.F16 else 0.03
        np.testing.assert_allclose(got, oracle, rtol=0, atol=bound * np.abs(oracle).max())


@pytest.mark.parametrize("qtype,n_in", EXPERT_TYPES)
def test_a_rows_experts_give_the_same_bits_alone_in_a_batch_and_on_any_thread_count(natives, qtype, n_in):
    experts = Experts(qtype, 8, 24, n_in)
    x = f32(9, n_in)
    ids = RNG.integers(0, 8, size=(9, 2)).astype(np.int32)
    g_alone, out_alone = mul_mat_id_graph(experts, x[4:5], ids[4:5])
    g_batch, out_batch = mul_mat_id_graph(experts, x, ids)
    results = []
    for backend in natives.values():
        for n_threads in (1, 3):
            backend.set_n_threads(n_threads)
            results.append(run_native(backend, experts, g_alone, out_alone)[0])
            results.append(run_native(backend, experts, g_batch, out_batch)[4])
        backend.set_n_threads(2)
    for result in results[1:]:
        assert np.array_equal(result, results[0])


@pytest.mark.parametrize("bad", [6, -1])
def test_an_expert_id_outside_the_table_fails_the_run(natives, bad):
    experts = Experts(GGMLType.Q8_0, 6, 8, 32)
    g, out = mul_mat_id_graph(experts, f32(2, 32), np.array([[0, 1], [bad, 2]], np.int32))
    backend = natives["scalar"]
    with pytest.raises(ModelError, match="outside its table"):
        run_native(backend, experts, g, out)
    g = Graph()
    a = g.input(f32(2, 2, 8))
    out = g.op("add_id", a, g.weight("bias", f32(6, 8)), g.input(np.array([[0, bad], [1, 2]], np.int32)),
               out=(2, 2, 8))
    with pytest.raises(ModelError, match="outside its table"):
        g.run(backend, out)


def test_mul_mat_heads_is_a_matmul_per_head(natives):
    heads = Experts(GGMLType.Q8_0, 4, 12, 64, usage="mul_mat_heads")
    g = Graph()
    x = g.input(f32(5, 4, 64))
    out = g.op("mul_mat_heads", g.weight("experts", heads.dense), x, out=(5, 4, 12))
    oracle = g.run(NumpyBackend(), out)
    for isa, backend in natives.items():
        got = run_native(backend, heads, g, out)
        for h in range(4):
            dense = kernels.mul_mat(heads.each[h], g.inputs[x.id][:, h], backend.pool, isa)
            assert np.array_equal(got[:, h], dense)
        np.testing.assert_allclose(got, oracle, rtol=0, atol=0.03 * np.abs(oracle).max())


def both_natives(natives, g: Graph, output) -> tuple[list[np.ndarray], np.ndarray]:
    return [g.run(backend, output) for backend in natives.values()], g.run(NumpyBackend(), output)


def test_top_k_ranks_like_numpy_ties_to_the_lower_index_nan_last(natives):
    x = np.round(f32(6, 3, 10, scale=1.5))  # rounded: many ties
    x[0, 0, [2, 5]] = np.nan
    x[1, 2, :] = 1.0
    x[2, 1, [0, 9]] = -np.inf
    x[3, 0, :] = np.nan
    g = Graph()
    out = g.op("top_k", g.input(x), out=(6, 3, 4), dtype="i32", k=4)
    got, expected = both_natives(natives, g, out)
    for result in got:
        assert result.dtype == np.int32 and np.array_equal(result, expected)


def test_the_routing_ops_match_numpy(natives):
    """DeepSeek-V3's grouped routing (top_k, take, sum_rows, id_mask) and OLMoE's weight normalisation."""
    g = Graph()
    scores = g.input(f32(7, 4, 6))
    best_two = g.op("take", scores, g.op("top_k", scores, out=(7, 4, 2), dtype="i32", k=2), out=(7, 4, 2))
    sums = g.op("reshape", g.op("sum_rows", best_two, out=(7, 4, 1)), out=(7, 4), shape=(7, 4))
    mask = g.op("id_mask", sums, g.op("top_k", sums, out=(7, 2), dtype="i32", k=2), out=(7, 4))
    for output in (best_two, sums, mask):
        got, expected = both_natives(natives, g, output)
        for result in got:
            np.testing.assert_allclose(result, expected, rtol=1e-7, atol=0)


def test_add_id_swiglu_oai_and_concat_match_numpy(natives):
    g = Graph()
    a, up = g.input(f32(5, 3, 40, scale=6.0)), g.input(f32(5, 3, 40, scale=6.0))  # beyond the limit 7 too
    ids = g.input(RNG.integers(0, 4, size=(5, 3)).astype(np.int32))
    biased = g.op("add_id", a, g.weight("bias", f32(4, 40)), ids, out=(5, 3, 40))
    gated = g.op("swiglu_oai", biased, up, out=(5, 3, 40), alpha=1.702, limit=7.0)
    joined = g.op("concat", gated, a, out=(5, 3, 80))
    for output, tolerance in ((biased, 0.0), (gated, 2e-6), (joined, 2e-6)):
        got, expected = both_natives(natives, g, output)
        for result in got:
            np.testing.assert_allclose(result, expected, rtol=tolerance, atol=tolerance)


def mul_mat_id_program(**changes) -> pg.Program:
    """One mul_mat_id of 2 tokens x 2 slots over 3 experts of 8 x 32 Q8_0 rows (weights 0..2)."""
    info = pg.WeightInfo(rp.KIND_QBYTE, 8, 32)
    scratch = pg.moe_scratch_words(3, 4, 2, info)
    n = changes.pop("n", [0, 3, 2, 2, 0, 4])
    infos = changes.pop("infos", [info] * 3)
    instr = pg.Instr(pg.MUL_MAT_ID, [pg.Operand(0, 0), pg.Operand(0, 32), pg.Operand(0, 96), pg.Operand(0, 100)], n)
    arena = changes.pop("arena", 100 + scratch)
    return pg.Program([instr], arena, [], [], [kernels.NatWeight()] * 3, infos)


@pytest.mark.parametrize("change,reason", [
    ({"arena": 99}, "spans words"),
    ({"n": [1, 3, 2, 2, 0, 4]}, "weight 3 of 3"),
    ({"n": [0, 3, 2, 2, 0, 2]}, "ids of 4 or 8 bytes"),
    ({"n": [0, 3, 2, 2, 2, 4]}, "x per slot 2"),
    ({"n": [0, 3, 2, 2, 1, 4]}, "spans words"),  # x of a row per slot: 4 rows, not 2
    ({"infos": [pg.WeightInfo(rp.KIND_QBYTE, 8, 32)] * 2 + [pg.WeightInfo(rp.KIND_QBYTE, 16, 32)]},
     "not experts of one shape"),
])
def test_a_misfit_mul_mat_id_is_refused_before_c_runs_it(change, reason):
    with pytest.raises(pg.ProgramError, match=reason):
        mul_mat_id_program(**change)


def test_a_fitting_mul_mat_id_program_is_accepted():
    assert len(mul_mat_id_program().instrs) == 1


def test_top_k_of_more_than_a_row_is_refused():
    instr = pg.Instr(pg.TOP_K, [pg.Operand(0, 0), pg.Operand(0, 16)], [4, 2, 3])
    with pytest.raises(pg.ProgramError, match="the 3 best of 2"):
        pg.Program([instr], 64, [], [], [], [])
