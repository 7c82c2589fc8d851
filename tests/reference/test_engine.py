"""The decode engine on the real SmolLM2-135M (numpy backend): batches, return codes, logits access, graph
reuse, multiple sequences, the KV cache's sequence operations (incl. the K-shift), and loading errors.

Contexts use ``n_threads=1``: on a shared, oversubscribed CPU, BLAS threads that spin waiting for each other make
small matmuls 10x slower.
"""
from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

import llmfw
from llmfw.core.errors import (
    ConfigError, ContextError, LoadCancelled, LogitsIndexError, ModelError, UnknownArchitecture, UnknownBackend,
)
from support.models import TINY_N_VOCAB, write_tiny_llama

PROMPT_A = [1, 504, 3458, 282, 4649, 314]  # token ids of a short prompt
PROMPT_B = [1, 9690, 28, 2053, 30, 4582, 253]
TOL = 1e-3


@pytest.fixture(scope="module")
def model(shared_models):
    return shared_models.get("smollm2", "numpy")


def new_ctx(model, **kw):
    kw.setdefault("n_ctx", 256)
    kw.setdefault("n_threads", 1)
    return model.new_context(**kw)


def decode_alone(model, tokens, **batch_kw):
    ctx = new_ctx(model)
    assert ctx.decode(llmfw.Batch(tokens, logits=True, **batch_kw)) == 0, ctx.last_error
    return ctx, ctx.get_logits().copy()


def cells_snapshot(ctx):
    cells = ctx.memory.cells
    return cells.pos.copy(), cells.seq.copy(), cells.head


# -- model and context basics ------------------------------------------------------------------------------

def test_model_basics(model):
    assert model.n_vocab == 49152
    assert model.hparams.n_layer == 30 and model.hparams.n_head_kv(0) == 3
    assert model.arch.name == "llama"
    assert set(model.layer_specs) == {"numpy"}
    # tied head: output.weight comes from token_embd.weight and shares the float32 copy
    assert model.has_weight("output.weight")
    ctx = model.new_context()
    assert ctx.n_ctx == 4096 and ctx.n_ubatch == 512  # n_ctx 0 -> min(n_ctx_train=8192, 4096)
    assert isinstance(llmfw.Context(model, llmfw.ContextParams(n_ctx=100)).n_ctx, int)
    assert llmfw.Context(model, n_ctx=100).n_ctx == 256  # padded like llama.cpp


def test_bad_context_params(model):
    with pytest.raises(ConfigError, match="n_ubatch"):
        model.new_context(n_ubatch=0)
    with pytest.raises(ConfigError, match="n_seq_max"):
        model.new_context(n_seq_max=65)
    # the project's one wording: the bound, the value given, the closest known key for a misspelt one
    with pytest.raises(ConfigError, match=r"n_ubatch: must be > 0 \(got 0\); n_ctxx: unknown key, "
                                          r"did you mean 'n_ctx'\?"):
        model.new_context(n_ubatch=0, n_ctxx=512)


def test_bad_model_params_name_the_key_and_the_value(tmp_path):
    with pytest.raises(ConfigError, match=r"invalid model parameters: vocab_only: must be true or false "
                                          r"\(got 'maybe'\); n_gpu_layerz: unknown key, did you mean 'n_gpu_layers'\?"):
        llmfw.load_model(tmp_path / "never-opened.gguf", vocab_only="maybe", n_gpu_layerz=1)


# -- decode return codes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("batch_kw, message", [
    (dict(tokens=[1, 49152]), "out of range"),
    (dict(tokens=[1, -5]), "out of range"),
    (dict(tokens=[]), "empty"),
    (dict(tokens=[1, 2], seq_id=[0, 1]), "seq_id 1"),
    (dict(tokens=[1, 2], seq_id=[0]), "seq_id has 1 entries"),
    (dict(tokens=[1, 2], pos=[0]), "pos has shape"),
    (dict(tokens=[1, 2], logits=[True]), "logits has shape"),
    (dict(tokens=[1, 2], pos=[0, 2]), "gaps"),
    (dict(tokens=None), "exactly one of tokens or embd"),
    (dict(tokens=[[1, 2]]), "one-dimensional"),
])
def test_bad_batch_returns_minus_one(model, batch_kw, message):
    ctx = new_ctx(model)
    tokens = batch_kw.pop("tokens")
    before = cells_snapshot(ctx)
    assert ctx.decode(llmfw.Batch(tokens, **batch_kw)) == -1
    assert message in ctx.last_error
    after = cells_snapshot(ctx)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_batch_larger_than_n_batch_and_position_gap(model):
    ctx = new_ctx(model, n_batch=4)
    assert ctx.decode(llmfw.Batch(list(range(1, 6)))) == -1
    assert "n_batch" in ctx.last_error
    assert ctx.decode(llmfw.Batch([1, 2, 3])) == 0
    assert ctx.decode(llmfw.Batch([4], pos=[7])) == -1  # positions must continue at 3
    assert "expected 3" in ctx.last_error
    assert ctx.decode(llmfw.Batch([4])) == 0 and ctx.memory.seq_pos_max(0) == 3


def test_no_kv_slot_returns_one_and_changes_nothing(model):
    ctx = new_ctx(model, n_ctx=256, n_batch=256, n_ubatch=64)
    assert ctx.decode(llmfw.Batch(list(range(1000, 1200)))) == 0
    logits_before = ctx.get_logits().copy()
    before = cells_snapshot(ctx)
    # 100 more tokens need two ubatches; only 56 cells are free: the reservation fails before any ubatch runs
    assert ctx.decode(llmfw.Batch(list(range(2000, 2100)))) == 1
    assert "no KV cache slot" in ctx.last_error
    after = cells_snapshot(ctx)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert ctx.memory.seq_pos_max(0) == 199
    assert np.array_equal(ctx.get_logits(), logits_before)
    # exactly the free cells still fit
    assert ctx.decode(llmfw.Batch(list(range(2000, 2056)))) == 0
    assert ctx.memory.seq_pos_max(0) == 255


def test_abort_callback(model):
    ctx = new_ctx(model, abort_callback=lambda: True)
    assert ctx.decode(llmfw.Batch(PROMPT_A)) == 2
    assert "abort" in ctx.last_error
    assert ctx.memory.seq_pos_max(0) == -1

    calls = []

    def abort_after_first_ubatch():
        calls.append(1)
        return len(calls) > 1

    ctx = new_ctx(model, n_ubatch=4, abort_callback=abort_after_first_ubatch)
    assert ctx.decode(llmfw.Batch(list(range(100, 110)), logits=True)) == 2
    # the ubatch that ran stays in the cache (llama.cpp keeps processed ubatches), its logits are readable
    assert ctx.memory.seq_pos_max(0) == 3
    assert ctx.get_logits().shape == (4, model.n_vocab)
    with pytest.raises(LogitsIndexError):
        ctx.get_logits_ith(5)


# -- logits access --------------------------------------------------------------------------------------------

def test_get_logits_ith(model):
    ctx = new_ctx(model)
    assert ctx.decode(llmfw.Batch(PROMPT_A[:4], logits=[False, True, False, True])) == 0
    logits = ctx.get_logits()
    assert logits.shape == (2, model.n_vocab) and logits.dtype == np.float32
    np.testing.assert_array_equal(ctx.get_logits_ith(1), logits[0])
    np.testing.assert_array_equal(ctx.get_logits_ith(3), logits[1])
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), logits[1])
    np.testing.assert_array_equal(ctx.get_logits_ith(-2), logits[0])
    for bad in (0, 2, 4, -3):
        with pytest.raises(LogitsIndexError):
            ctx.get_logits_ith(bad)
    with pytest.raises(IndexError):  # LogitsIndexError is also an IndexError
        ctx.get_logits_ith(0)
    row = ctx.get_logits_ith(1)
    row[:] = 0
    assert ctx.get_logits_ith(1).any()  # a copy
    # default: only the last token has logits
    assert ctx.decode(llmfw.Batch([5, 6])) == 0
    assert ctx.get_logits().shape == (1, model.n_vocab)
    with pytest.raises(LogitsIndexError):
        ctx.get_logits_ith(0)
    assert ctx.get_logits_ith(1).shape == (model.n_vocab,)


def test_graph_reuse_during_one_token_decodes(model):
    ctx = new_ctx(model)
    assert ctx.decode(llmfw.Batch(PROMPT_A)) == 0
    assert (ctx.n_graph_builds, ctx.n_graph_reuses) == (1, 0)
    token = int(ctx.get_logits_ith(-1).argmax())
    for _ in range(5):
        assert ctx.decode(llmfw.Batch([token])) == 0
        token = int(ctx.get_logits_ith(-1).argmax())
    # the first one-token decode builds a graph, the next four reuse it (n_kv stays at the 256 padding)
    assert (ctx.n_graph_builds, ctx.n_graph_reuses) == (2, 4)


def test_a_decode_graph_outlives_the_prompts_between_its_steps(model):
    """A server decodes one sequence's token, then another request's prompt, then the token again: the decode
    graph is kept beside the prompt's, so it is built once, not after every prompt."""
    ctx = new_ctx(model, n_seq_max=2)
    assert ctx.decode(llmfw.Batch(PROMPT_A)) == 0
    token = int(ctx.get_logits_ith(-1).argmax())
    assert ctx.decode(llmfw.Batch([token])) == 0
    builds = ctx.n_graph_builds
    assert ctx.decode(llmfw.Batch(PROMPT_B, seq_id=1)) == 0  # a prompt of another shape: a graph of its own
    assert ctx.n_graph_builds == builds + 1
    _, alone = decode_alone(model, PROMPT_A + [token, 17])
    assert ctx.decode(llmfw.Batch([17], pos=[len(PROMPT_A) + 1], seq_id=0)) == 0
    assert ctx.n_graph_builds == builds + 1  # the decode graph again, not rebuilt
    np.testing.assert_allclose(ctx.get_logits_ith(-1), alone[-1], atol=TOL)


def test_prompt_and_decode_graphs_have_one_structure(model):
    """Every graph selects its output rows through the ``out_ids`` input, also when every token is an output:
    a prompt wanting the last logits only and a one-token decode then differ in sizes only, so a backend that
    compiles a program per graph structure (onnx) keeps one. All-outputs logits equal the last-only ones."""
    ctx = new_ctx(model)
    assert ctx.decode(llmfw.Batch(PROMPT_A)) == 0
    last_only = ctx.get_logits_ith(-1)
    prompt_ops = [node.op for node in ctx._plan.graph.nodes]
    assert "out_ids" in ctx._plan.graph.inputs
    assert ctx.decode(llmfw.Batch([int(last_only.argmax())])) == 0
    assert "out_ids" in ctx._plan.graph.inputs
    assert [node.op for node in ctx._plan.graph.nodes] == prompt_ops
    ctx.memory.clear()
    assert ctx.decode(llmfw.Batch(PROMPT_A, logits=True)) == 0
    np.testing.assert_allclose(ctx.get_logits_ith(-1), last_only, atol=TOL)


def test_ubatch_split_matches_one_ubatch(model):
    tokens = list(range(300, 340))
    _, whole = decode_alone(model, tokens)
    ctx = new_ctx(model, n_ubatch=16)
    assert ctx.decode(llmfw.Batch(tokens, logits=True)) == 0
    assert np.abs(ctx.get_logits() - whole).max() <= TOL


# -- sequences -------------------------------------------------------------------------------------------------

def test_two_sequences_in_one_batch_match_each_alone(model):
    ctx_a, alone_a = decode_alone(model, PROMPT_A)
    ctx_b, alone_b = decode_alone(model, PROMPT_B)
    ctx = new_ctx(model, n_seq_max=2)
    seq_ids = [0] * len(PROMPT_A) + [1] * len(PROMPT_B)
    assert ctx.decode(llmfw.Batch(PROMPT_A + PROMPT_B, seq_id=seq_ids, logits=True)) == 0
    both = ctx.get_logits()
    assert np.abs(both[:len(PROMPT_A)] - alone_a).max() <= TOL
    assert np.abs(both[len(PROMPT_A):] - alone_b).max() <= TOL
    # one more token each, in one batch: each attends only to its own cached history
    assert ctx.decode(llmfw.Batch([30, 31], seq_id=[0, 1], logits=True)) == 0
    assert ctx_a.decode(llmfw.Batch([30])) == 0 and ctx_b.decode(llmfw.Batch([31])) == 0
    assert np.abs(ctx.get_logits_ith(0) - ctx_a.get_logits_ith(-1)).max() <= TOL
    assert np.abs(ctx.get_logits_ith(1) - ctx_b.get_logits_ith(-1)).max() <= TOL
    assert ctx.memory.seq_pos_max(0) == len(PROMPT_A) and ctx.memory.seq_pos_max(1) == len(PROMPT_B)


def test_seq_rm_and_redecode(model):
    ctx, full = decode_alone(model, PROMPT_B)
    assert ctx.memory.seq_rm(0, 4, -1)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (0, 3)
    assert ctx.decode(llmfw.Batch(PROMPT_B[4:], logits=True)) == 0  # positions continue at 4
    assert np.abs(ctx.get_logits() - full[4:]).max() <= TOL
    ctx.memory.seq_rm(-1)
    assert ctx.memory.seq_pos_max(0) == -1


def test_seq_cp_shares_history_and_seq_keep(model):
    _, alone = decode_alone(model, PROMPT_A + [30])
    ctx = new_ctx(model, n_seq_max=3)
    assert ctx.decode(llmfw.Batch(PROMPT_A)) == 0
    ctx.memory.seq_cp(0, 2)
    assert ctx.memory.seq_pos_max(2) == len(PROMPT_A) - 1 and ctx.memory.seq_pos_max(1) == -1
    # sequence 2 continues from the copied cells exactly like sequence 0 would
    assert ctx.decode(llmfw.Batch([30], seq_id=2)) == 0
    assert np.abs(ctx.get_logits_ith(-1) - alone[-1]).max() <= TOL
    ctx.memory.seq_cp(0, 1, 0, 3)  # a partial copy: positions 0..2
    assert (ctx.memory.seq_pos_min(1), ctx.memory.seq_pos_max(1)) == (0, 2)
    ctx.memory.seq_keep(2)
    assert ctx.memory.seq_pos_max(0) == -1 and ctx.memory.seq_pos_max(1) == -1
    assert ctx.memory.seq_pos_max(2) == len(PROMPT_A)
    assert ctx.memory.n_used == len(PROMPT_A) + 1
    ctx.memory.clear()
    assert ctx.memory.seq_pos_max(2) == -1 and ctx.memory.n_used == 0
    with pytest.raises(ContextError):
        ctx.memory.seq_cp(0, 3)


def test_seq_add_reropes_cached_keys(model):
    shift = 5
    ctx = new_ctx(model)
    assert ctx.decode(llmfw.Batch(PROMPT_B)) == 0
    ctx.memory.seq_add(0, 0, -1, shift)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (shift, shift + len(PROMPT_B) - 1)
    assert ctx.decode(llmfw.Batch([30])) == 0  # at position len + shift, after the K-shift
    shifted = ctx.get_logits_ith(-1)

    ref = new_ctx(model)  # the same tokens decoded at the shifted positions from the start
    assert ref.decode(llmfw.Batch(PROMPT_B, pos=list(range(shift, shift + len(PROMPT_B))))) == 0
    assert ref.decode(llmfw.Batch([30])) == 0
    expected = ref.get_logits_ith(-1)
    assert np.abs(shifted - expected).max() <= TOL

    # without re-roping K (shift discarded) the result is measurably different: the K-shift matters
    stale = new_ctx(model)
    assert stale.decode(llmfw.Batch(PROMPT_B)) == 0
    stale.memory.seq_add(0, 0, -1, shift)
    stale.memory.cells.shift[:] = 0
    assert stale.decode(llmfw.Batch([30])) == 0
    assert np.abs(stale.get_logits_ith(-1) - expected).max() > 10 * TOL


def test_seq_add_negative_drops_cells(model):
    ctx = new_ctx(model)
    assert ctx.decode(llmfw.Batch(PROMPT_B)) == 0
    ctx.memory.seq_rm(0, 0, 2)
    ctx.memory.seq_add(0, 2, -1, -2)  # llama.cpp's context shift: discard then move the rest down
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (0, len(PROMPT_B) - 3)
    assert ctx.decode(llmfw.Batch([30])) == 0
    assert ctx.memory.seq_pos_max(0) == len(PROMPT_B) - 2


def test_embeddings_input_matches_tokens(model):
    _, by_tokens = decode_alone(model, PROMPT_A)
    table = model.host_backend.weight("token_embd.weight")
    from llmfw.plugins.backends.numpy import get_rows

    embd = get_rows(table, np.array(PROMPT_A))
    ctx = new_ctx(model)
    assert ctx.decode(llmfw.Batch(embd=embd, logits=True)) == 0
    assert np.abs(ctx.get_logits() - by_tokens).max() <= TOL
    assert ctx.decode(llmfw.Batch(embd=np.zeros((2, 3), np.float32))) == -1


# -- loading ------------------------------------------------------------------------------------------------------

def test_load_cancelled_releases_everything(smollm2_path):
    seen = []

    def progress(fraction):
        seen.append(fraction)
        return len(seen) < 5

    maps = Path("/proc/self/maps")

    def mappings_of_the_file() -> int:  # models other tests keep alive may map it too (lookup tables)
        return maps.read_text().count(str(smollm2_path)) if maps.exists() else 0

    gc.collect()
    before = mappings_of_the_file()
    with pytest.raises(LoadCancelled):
        llmfw.load_model(smollm2_path, backend="numpy", progress=progress)
    assert len(seen) == 5 and seen[0] == 0.0 and seen == sorted(seen)
    gc.collect()
    assert mappings_of_the_file() <= before, "the cancelled load left the model file mapped"


def test_progress_reaches_one(smollm2_path):
    seen = []
    with llmfw.load_model(smollm2_path, backend="numpy", load_mode="read", progress=seen.append) as m:
        assert m.n_vocab == 49152
    assert seen[0] == 0.0 and seen[-1] == 1.0 and seen == sorted(seen)
    assert len(seen) > 200  # one report per tensor


def test_vocab_only_and_unknown_backend(smollm2_path):
    m = llmfw.load_model(smollm2_path, vocab_only=True)
    assert m.n_vocab == 49152 and not m.has_weight("token_embd.weight")
    with pytest.raises(ContextError, match="vocab_only"):
        m.new_context()
    with pytest.raises(UnknownBackend, match="numpy"):
        llmfw.load_model(smollm2_path, backend="no-such-backend")
    with pytest.raises(ModelError, match="placement"):
        llmfw.load_model(smollm2_path, backend="numpy", placement={99: "numpy"})
    with pytest.raises(ConfigError, match="not_a_field"):
        llmfw.load_model(smollm2_path, not_a_field=1)


def test_unknown_architecture_lists_known(tmp_path):
    path = write_tiny_llama(tmp_path / "odd.gguf", arch="not-a-real-arch")
    with pytest.raises(UnknownArchitecture, match="not-a-real-arch") as info:
        llmfw.load_model(path, backend="numpy")
    assert "llama" in str(info.value)


def test_shape_mismatch_and_missing_tensor(tmp_path):
    path = write_tiny_llama(tmp_path / "bad.gguf", q_shape=(16, 32))
    with pytest.raises(ModelError, match=r"blk\.0\.attn_q\.weight.*\[32, 16\].*\[32, 32\]"):
        llmfw.load_model(path, backend="numpy")
    path = write_tiny_llama(tmp_path / "missing.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'"):
        llmfw.load_model(path, backend="numpy")


def test_tiny_model_tied_head_and_kv_override(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    with llmfw.load_model(path, backend="numpy", kv_overrides={"llama.rope.freq_base": 500.0}) as m:
        assert m.hparams.rope_freq_base_train == 500.0
        assert m.has_weight("output.weight")  # tied to token_embd
        ctx = m.new_context(n_threads=1)
        assert ctx.n_ctx == 256  # n_ctx_train 128 padded to 256
        assert ctx.decode(llmfw.Batch([1, 2, 3], logits=True)) == 0
        logits = ctx.get_logits()
        assert logits.shape == (3, TINY_N_VOCAB) and np.isfinite(logits).all()


# -- placement across backends ----------------------------------------------------------------------------------

def test_layers_split_across_backends(smollm2_path, model):
    pytest.importorskip("torch")
    last = model.hparams.n_layer
    placement = {last - 2: "torch", last - 1: "torch", last: "torch"}  # two layers + the output head
    with llmfw.load_model(smollm2_path, backend="numpy", placement=placement) as mixed:
        assert mixed.layer_specs[:last - 2] == ["numpy"] * (last - 2) and mixed.layer_specs[-3:] == ["torch"] * 3
        assert mixed.weight_backend("token_embd.weight").name == "numpy"  # the embedding stays on the host
        assert mixed.weight_backend("output.weight").name == "torch"
        ctx = new_ctx(mixed)
        assert ctx.decode(llmfw.Batch(PROMPT_A, logits=True)) == 0, ctx.last_error
        assert [s.backend.name for s in ctx._plan.splits] == ["numpy", "torch"]  # one cut, one copy
        _, reference = decode_alone(model, PROMPT_A)
        logits = ctx.get_logits()
        assert np.array_equal(logits.argmax(-1), reference.argmax(-1))
        assert np.abs(logits - reference).max() < 0.5  # the torch backend's own weight form differs slightly
        ctx.memory.seq_add(0, 0, -1, 2)  # the K-shift runs on both backends
        assert ctx.decode(llmfw.Batch([30])) == 0, ctx.last_error


def test_n_gpu_layers_follows_llama_cpp(smollm2_path):
    from llmfw.core.errors import BackendUnavailable

    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        pytest.skip("CUDA present: placement is exercised by the torch backend's tests")
    with pytest.raises(BackendUnavailable):
        llmfw.load_model(smollm2_path, backend="numpy", n_gpu_layers=2)


@pytest.mark.parametrize("n_gpu_layers, n_blocks_offloaded, head_offloaded", [
    (0, 0, False), (1, 1, False), (30, 30, False), (31, 30, True), (99, 30, True), (-1, 30, True),
])
def test_gpu_layer_choice_matches_llama_cpp(n_gpu_layers, n_blocks_offloaded, head_offloaded):
    from llmfw.core.model import gpu_layers

    offloaded = gpu_layers(30, n_gpu_layers)
    assert sum(offloaded[:30]) == n_blocks_offloaded and offloaded[30] == head_offloaded
    assert offloaded[:30] == sorted(offloaded[:30])  # always the last blocks
