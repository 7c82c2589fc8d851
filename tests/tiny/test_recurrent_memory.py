"""The recurrent and hybrid memory modules (issue 34) on the random-weight files of LFM2 (short convolutions
beside attention), Granite 4.0-H dense and MoE (Mamba-2 beside attention), Nemotron-H (Mamba-2, attention and MLP
layers) and Qwen3.5 dense and MoE (Gated DeltaNet beside
gated attention): ubatch splitting by sequence, llama.cpp's seq_* semantics for a state that cannot be taken apart, a
seq_cp fork, saved state, the prompt cache and speculative decoding — on the numpy oracle; on the default onnx
backend (which runs the scans itself) the bar on whole prompts, in ubatches of 32 and with two sequences, and the
seq_cp fork; on the native backend (the dense hybrids, every op in its C kernels) the same, with each sequence's
logits the same bits however it is batched."""
from __future__ import annotations

import numpy as np
import pytest

from reference_gen.arch_testing import (SAME_LOGITS_ATOL, assert_clears_bar, decode_all, decode_two_sequences,
                                        fork_errors, longest, model_file, records, reference)

import llmfw
from llmfw.core.batch import Batch, BatchAllocator, split_equal
from llmfw.core.errors import ContextError, LogitsIndexError
from llmfw.core.generate import GenerationStats, generate
from llmfw.core.ir.graph import RECURRENT_OPS
from llmfw.core.runtime.recurrent import HybridMemory, RecurrentMemory
from llmfw.core.speculative import NgramDrafter

FAMILY = "lfm2"
#: every hybrid family with a reference: the generic checks run on each
HYBRIDS = ["lfm2", "granitehybrid", "granitehybrid-moe", "qwen35", "qwen35moe", "nemotron_h"]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("recurrent")


@pytest.fixture(scope="module")
def path(directory):
    return model_file(FAMILY, directory)


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request, directory):
    """(family, numpy-backend model, file) for each hybrid family."""
    file = model_file(request.param, directory)
    with llmfw.load_model(file, backend="numpy") as loaded:
        yield request.param, loaded, file


@pytest.fixture(scope="module")
def model(path):
    with llmfw.load_model(path, backend="numpy") as loaded:
        yield loaded


@pytest.fixture(scope="module")
def sequences():
    return [r["sequence"] for r in records(reference(FAMILY))]


def _last_logits(ctx, tokens, seq=0):
    assert ctx.decode(Batch(tokens, seq_id=seq)) == 0, ctx.last_error
    return ctx.get_logits_ith(-1)


# -- the split -------------------------------------------------------------------------------------------------
def test_split_equal_groups_tokens_by_sequence():
    allocator = BatchAllocator(n_vocab=100, n_embd=8, n_seq_max=3)
    batch = allocator.init(Batch([1, 2, 3, 4, 5, 6, 7], pos=[0, 0, 1, 1, 2, 3, 0], seq_id=[0, 1, 0, 1, 0, 0, 2],
                                 logits=True))
    ubatches = split_equal(batch, n_ubatch=6)
    # three sequences with 4, 2 and 1 tokens: one token each, then 1 each of seqs 0 and 1, then seq 0's last two
    assert [ub.seqs for ub in ubatches] == [(0, 1, 2), (0, 1), (0,)]
    assert [ub.tokens.tolist() for ub in ubatches] == [[1, 2, 7], [3, 4], [5, 6]]
    assert [ub.pos.tolist() for ub in ubatches] == [[0, 0, 0], [1, 1], [2, 3]]
    assert sorted(np.concatenate([ub.rows for ub in ubatches]).tolist()) == list(range(7))
    with pytest.raises(Exception, match="several sequences"):
        split_equal(allocator.init(Batch([1, 2], seq_id=[[0, 1], [0]])), 8)


def test_the_memory_is_chosen_by_the_architecture(model):
    ctx = model.new_context(n_ctx=512, n_seq_max=2)
    assert isinstance(ctx.memory, HybridMemory)
    assert ctx.memory.kv.layers == [2, 4] and sorted(ctx.memory.recurrent.layers) == [0, 1, 3]
    assert ctx.memory.recurrent.states[("conv", 0)].shape == (2, 2, 256)  # K-1 = 2 values of 256 channels
    assert "recurrent state for 3 layers" in ctx.memory.describe()


def test_ubatches_of_32_clear_the_bar_and_match_one_ubatch(hybrid, score):
    family, model, _ = hybrid
    record = longest(reference(family))
    whole = decode_all(model, record["sequence"], n_ctx=512)
    split = decode_all(model, record["sequence"], n_ctx=512, n_ubatch=32)
    assert_clears_bar(score, record, split, f"{family} with n_ubatch 32")
    assert np.abs(whole - split).max() <= SAME_LOGITS_ATOL


def test_two_sequences_of_different_lengths_in_ubatches_of_32(hybrid, score):
    """An equal split of 29 + 86 tokens: both sequences share ubatches while the short one lasts."""
    family, model, _ = hybrid
    first, second = records(reference(family))[:2]
    logits_a, logits_b = decode_two_sequences(model, first["sequence"], second["sequence"], n_ctx=512, n_ubatch=32)
    assert_clears_bar(score, first, logits_a, f"{family}, sequence 0 of 2")
    assert_clears_bar(score, second, logits_b, f"{family}, sequence 1 of 2")
    assert np.abs(decode_all(model, second["sequence"], n_ctx=512) - logits_b).max() <= SAME_LOGITS_ATOL


def test_one_token_at_a_time_equals_the_whole_prompt(model, sequences):
    tokens = sequences[0][:20]
    whole = decode_all(model, tokens, n_ctx=512)
    ctx = model.new_context(n_ctx=512)
    stepped = np.stack([_last_logits(ctx, [t]) for t in tokens])
    assert np.abs(stepped - whole).max() <= SAME_LOGITS_ATOL


# -- sequence operations -----------------------------------------------------------------------------------------
def test_seq_cp_fork_decodes_like_each_sequence_alone(hybrid):
    """A prompt decoded once in sequence 0, copied to 1 (state and KV cells), then two different continuations
    decoded together in one batch: each gets the logits of decoding its whole sequence alone."""
    family, model, _ = hybrid
    assert max(fork_errors(model, family)) <= SAME_LOGITS_ATOL


def test_seq_rm_drops_a_whole_sequence_but_refuses_a_suffix(model, sequences):
    tokens = sequences[1][:30]
    ctx = model.new_context(n_ctx=512, n_seq_max=2)
    assert ctx.decode(Batch(tokens)) == 0
    # a suffix would need the state after position 19, which is gone: refused, nothing changes
    assert ctx.memory.seq_rm(0, 20, -1) is False
    assert ctx.memory.seq_pos_max(0) == 29 and len(ctx.seq_tokens[0]) == 30
    assert ctx.memory.kv.seq_pos_max(0) == 29  # the KV part was left alone too
    follower = sequences[1][30]
    reference_logits = decode_all(model, tokens + [follower], n_ctx=512)[-1]
    assert np.abs(_last_logits(ctx, [follower]) - reference_logits).max() <= SAME_LOGITS_ATOL
    # ranges that hold none of the state's positions remove nothing
    assert ctx.memory.seq_rm(0, 40, -1) is True and ctx.memory.seq_pos_max(0) == 30
    # positions absorbed before the last one cannot be taken out of the state either (llama.cpp refuses too)
    for p0, p1 in ((5, 10), (0, 10), (0, 30)):
        assert ctx.memory.seq_rm(0, p0, p1) is False
        assert ctx.memory.kv.seq_pos_min(0) == 0 and len(ctx.seq_tokens[0]) == 31
    assert ctx.memory.seq_rm(1, -1, -1) is True  # an empty sequence
    # every sequence, part of the range: refused; the whole range: everything goes
    assert ctx.memory.seq_rm(-1, 5, -1) is False
    assert ctx.memory.seq_rm(0, -1, -1) is True
    assert ctx.memory.seq_pos_max(0) == -1 and ctx.seq_tokens[0] == []
    assert not ctx.memory.recurrent.states[("conv", 0)].any()
    # the sequence starts over from a zero state
    assert np.abs(_last_logits(ctx, tokens[:10]) - decode_all(model, tokens[:10], n_ctx=512)[-1]).max() \
        <= SAME_LOGITS_ATOL


def test_seq_keep_and_clear(model, sequences):
    ctx = model.new_context(n_ctx=512, n_seq_max=3)
    for seq in range(3):
        assert ctx.decode(Batch(sequences[0][:5 + seq], seq_id=seq)) == 0
    ctx.memory.seq_keep(1)
    assert [ctx.memory.seq_pos_max(s) for s in range(3)] == [-1, 5, -1]
    assert not ctx.memory.recurrent.states[("conv", 1)][[0, 2]].any()
    assert ctx.memory.recurrent.states[("conv", 1)][1].any()
    ctx.memory.clear()
    assert [ctx.memory.seq_pos_max(s) for s in range(3)] == [-1, -1, -1]


def test_a_token_in_two_sequences_is_a_bad_batch(model):
    ctx = model.new_context(n_ctx=512, n_seq_max=2)
    assert ctx.decode(Batch([1, 2, 3], seq_id=[[0, 1], [0], [1]])) == -1
    assert "several sequences" in ctx.last_error and "seq_cp" in ctx.last_error


def test_an_abort_keeps_the_rows_computed_in_batch_order(model, sequences):
    """Two sequences split by sequence (a ubatch of 4 + 4 tokens, then the rest); aborted before the second
    ubatch, the context keeps exactly the first ubatch's rows, each readable at its own batch index."""
    seq_a, seq_b = sequences[0][:6], sequences[1][:10]
    order = sorted([(i, 0) for i in range(len(seq_a))] + [(i, 1) for i in range(len(seq_b))])
    tokens = [(seq_a, seq_b)[s][i] for i, s in order]
    answers = iter([False, True])
    ctx = model.new_context(n_ctx=512, n_seq_max=2, n_ubatch=8, abort_callback=lambda: next(answers, True))
    assert ctx.decode(Batch(tokens, pos=[i for i, _ in order], seq_id=[s for _, s in order], logits=True)) == 2
    assert ctx.n_outputs == 8
    alone = {0: decode_all(model, seq_a, n_ctx=512), 1: decode_all(model, seq_b, n_ctx=512)}
    for index, (i, s) in enumerate(order):
        if i < 4:
            assert np.abs(ctx.get_logits_ith(index) - alone[s][i]).max() <= SAME_LOGITS_ATOL
        else:
            with pytest.raises(LogitsIndexError, match="not marked for output"):
                ctx.get_logits_ith(index)


# -- saved state, the prompt cache, speculative decoding ------------------------------------------------------------
def test_saved_state_restores_the_recurrent_state(model, sequences, tmp_path):
    tokens, follower = sequences[1][:30], sequences[1][30]
    ctx = model.new_context(n_ctx=512, n_seq_max=2)
    assert ctx.decode(Batch(tokens)) == 0
    path = tmp_path / "lfm2.state"
    ctx.state_save_file(path)
    want = _last_logits(ctx, [follower])
    fresh = model.new_context(n_ctx=512, n_seq_max=2)
    assert fresh.state_load_file(path) == tokens
    assert fresh.memory.seq_pos_max(0) == 29
    assert np.abs(_last_logits(fresh, [follower]) - want).max() <= SAME_LOGITS_ATOL
    with pytest.raises(ContextError, match="context shape|arrays"):
        model.new_context(n_ctx=512, n_seq_max=3).state_load_file(path)  # other state rows
    corrupt = tmp_path / "corrupt.state"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF  # a byte of the last recurrent state
    corrupt.write_bytes(bytes(data))
    with pytest.raises(ContextError, match="checksum"):
        fresh.state_load_file(corrupt)


def test_prompt_cache_reuses_a_state_only_when_it_can(model, sequences):
    """A prompt that extends what the state has absorbed continues from it; one that diverges inside it cannot
    roll the state back, so the sequence starts over — the same tokens either way as from a fresh context."""
    def run(ctx, prompt):
        stats = GenerationStats()
        "".join(generate(ctx, prompt, max_tokens=6, stats=stats, add_special=False))
        return stats.tokens, stats.n_cached

    first = sequences[1][:40]
    ctx = model.new_context(n_ctx=512)
    generated, _ = run(ctx, first)
    absorbed = list(ctx.seq_tokens[0])
    assert absorbed[:40] == first and ctx.memory.seq_pos_max(0) == len(absorbed) - 1
    longer = first + generated + sequences[2][:5]
    out_longer, cached = run(ctx, longer)
    assert cached == len(absorbed)  # nothing decoded twice
    assert out_longer == run(model.new_context(n_ctx=512), longer)[0]
    other = first[:20] + sequences[2][:10]  # diverges at position 20, inside the state
    out_other, cached = run(ctx, other)
    assert cached == 0
    assert out_other == run(model.new_context(n_ctx=512), other)[0]


def test_speculative_decoding_declines_clearly(model):
    ctx = model.new_context(n_ctx=512)
    assert not ctx.memory.can_drop_suffix(4) and ctx.memory.can_drop_suffix(0)
    with pytest.raises(ContextError, match="speculative decoding is not available for 'lfm2'"):
        generate(ctx, "The capital of France is", max_tokens=4, draft=NgramDrafter(4, 2))


def test_pure_recurrent_memory_has_no_kv_cache(model):
    memory = RecurrentMemory(model, n_seq_max=2)
    assert memory.cache_names == [] and memory.allocate(lambda il: None) == {}
    with pytest.raises(ContextError, match="recurrent state, not a KV cache"):
        memory.cache_of_layer(0)


# -- the default backend -------------------------------------------------------------------------------------------
def every_prompt_clears_the_bar(score, family, loaded, backend):
    for record in records(reference(family)):
        assert_clears_bar(score, record, decode_all(loaded, record["sequence"], n_ctx=record["n_ctx"]),
                          f"{backend} {family}")


def two_sequences_clear_the_bar(score, family, loaded, backend):
    """The family's first two prompts as two sequences in ubatches of 32, each against the bar: both prompts
    and their logits."""
    first, second = records(reference(family))[:2]
    logits_a, logits_b = decode_two_sequences(loaded, first["sequence"], second["sequence"], n_ctx=512,
                                              n_ubatch=32)
    assert_clears_bar(score, first, logits_a, f"{backend} {family}, sequence 0 of 2")
    assert_clears_bar(score, second, logits_b, f"{backend} {family}, sequence 1 of 2")
    return (first, logits_a), (second, logits_b)


@pytest.fixture(scope="module")
def onnx_hybrid(hybrid):
    """(family, onnx-backend model) for each hybrid family."""
    family, _, file = hybrid
    with llmfw.load_model(file, backend="onnx") as loaded:
        yield family, loaded


def test_onnx_runs_the_recurrent_ops_itself(onnx_hybrid, caplog):
    """The scans and convolutions have onnx kernels: none is left to the host backend with a warning."""
    family, onnx_model = onnx_hybrid
    ctx = onnx_model.new_context(n_ctx=512, n_seq_max=2)
    with caplog.at_level("WARNING", logger="llmfw.core.exec.scheduler"):
        assert ctx.decode(Batch([1, 2, 3, 4], seq_id=[0, 0, 1, 1], pos=[0, 1, 0, 1])) == 0, ctx.last_error
    placed = {n.op: s.backend.name for s in ctx._plan.splits for n in s.nodes if n.op in RECURRENT_OPS}
    assert {"ssm_conv", "conv_window"} <= placed.keys() and set(placed.values()) == {"onnx"}, f"{family}: {placed}"
    assert not [r for r in caplog.records if "lacks op" in r.getMessage()]


def test_onnx_clears_the_bar_on_every_prompt(onnx_hybrid, score):
    every_prompt_clears_the_bar(score, *onnx_hybrid, "onnx")


def test_onnx_clears_the_bar_in_ubatches_of_32_and_two_sequences(onnx_hybrid, score):
    """Ubatches of 32 against the bar. Not against the whole prompt's logits: qwen35's whole prompt runs the
    gated delta rule in chunks, its ubatches of 32 step by step, and MatMulNBits' int8 activations turn the two
    forms' float32 rounding differences into visible logit differences on these random weights (the numpy
    tests hold the two to SAME_LOGITS_ATOL)."""
    family, onnx_model = onnx_hybrid
    record = longest(reference(family))
    split = decode_all(onnx_model, record["sequence"], n_ctx=512, n_ubatch=32)
    assert_clears_bar(score, record, split, f"onnx {family} with n_ubatch 32")
    two_sequences_clear_the_bar(score, family, onnx_model, "onnx")


#: onnx's forked rows ride in a two-row matmul, the lone ones in a one-row matmul: MatMulNBits quantizes its
#: activations to int8 per row block, and its kernels may order a row's sums differently by row count, so the two
#: differ by more than float32 rounding (nemotron_h's random weights showed 0.017); a wrong fork (the state not
#: copied, the wrong cells) differs by whole units
ONNX_FORK_ATOL = 0.05


def test_onnx_seq_cp_fork_decodes_like_each_sequence_alone(onnx_hybrid):
    family, onnx_model = onnx_hybrid
    assert max(fork_errors(onnx_model, family)) <= ONNX_FORK_ATOL


def test_granitehybrid_reads_its_experts_and_shared_expert_width(directory):
    """One family, two FFN kinds: the MoE file's routed experts and shared-expert width, the dense file's SwiGLU;
    expert counts that do not fit are a clear error."""
    from llmfw.core.errors import ModelError

    with llmfw.load_model(model_file("granitehybrid-moe", directory), backend="numpy") as moe:
        assert (moe.hparams.n_expert, moe.hparams.n_expert_used, moe.hparams.n_ff_shexp) == (8, 2, 512)
    dense = model_file("granitehybrid", directory)
    with llmfw.load_model(dense, backend="numpy") as model:
        assert (model.hparams.n_expert, model.hparams.n_ff_shexp) == (0, 0)
    with pytest.raises(ModelError, match="expert_used_count"):
        llmfw.load_model(dense, backend="numpy", kv_overrides={"granitehybrid.expert_count": 4})


def test_nemotron_h_keeps_memory_only_for_its_mamba_and_attention_layers(directory):
    with llmfw.load_model(model_file("nemotron_h", directory), backend="numpy") as model:
        ctx = model.new_context(n_ctx=512)
        assert ctx.memory.kv.layers == [2] and sorted(ctx.memory.recurrent.layers) == [0, 3]


def test_nemotron_h_squares_its_relu(directory, tmp_path):
    """The MLP is ffn_down(relu(ffn_up(h))²): ffn_up (and its bias) doubled and ffn_down quartered leave the
    logits as they were; a plain ReLU would halve the MLPs' output."""
    from reference_gen.variant_files import float_tensor, write_variant

    path = model_file("nemotron_h", directory)
    edits = {}
    for il in (1, 4):
        for name, factor in (("ffn_up.weight", 2.0), ("ffn_up.bias", 2.0), ("ffn_down.weight", 0.25)):
            edits[f"blk.{il}.{name}"] = float_tensor(path, f"blk.{il}.{name}") * np.float32(factor)
    sequence = records(reference("nemotron_h"))[1]["sequence"]
    with llmfw.load_model(path, backend="numpy") as model:
        want = decode_all(model, sequence, n_ctx=512)
    with llmfw.load_model(write_variant(path, tmp_path / "scaled.gguf", replace=edits), backend="numpy") as model:
        assert np.abs(decode_all(model, sequence, n_ctx=512) - want).max() <= SAME_LOGITS_ATOL


def test_nemotron_h_without_its_mlp_bias_fails_the_bar(directory, tmp_path, score):
    from reference_gen.arch_testing import BAR
    from reference_gen.variant_files import write_variant

    path = model_file("nemotron_h", directory)
    edits = {f"blk.{il}.ffn_up.bias": np.zeros(512, np.float32) for il in (1, 4)}
    record = longest(reference("nemotron_h"))
    with llmfw.load_model(write_variant(path, tmp_path / "nobias.gguf", replace=edits), backend="numpy") as model:
        result = score(record, decode_all(model, record["sequence"], n_ctx=512))
    assert result["top1"] < BAR["top1"] or result["mean_lp_err"] > BAR["mean_lp_err"], result


def test_qwen35_and_qwen35moe_each_refuse_the_others_files(directory):
    """llama.cpp's two model classes: experts make a file qwen35moe's, a dense file is qwen35's."""
    from llmfw.core.errors import ModelError

    with pytest.raises(ModelError, match="qwen35moe's"):
        llmfw.load_model(model_file("qwen35", directory), backend="numpy", kv_overrides={"qwen35.expert_count": 8})
    with pytest.raises(ModelError, match="expert_count must be > 1"):
        llmfw.load_model(model_file("qwen35moe", directory), backend="numpy",
                         kv_overrides={"qwen35moe.expert_count": 0})


def test_qwen35_refuses_rope_sections_it_cannot_run(directory):
    """Interleaved M-RoPE sections that leave a rotated pair on the fourth (non-text) axis are refused clearly."""
    from llmfw.core.errors import ModelError
    from llmfw.plugins.architectures.qwen35 import imrope_text_axes_cover

    assert imrope_text_axes_cover([11, 11, 10, 0], 64) and imrope_text_axes_cover([6, 5, 5, 0], 32)
    assert not imrope_text_axes_cover([4, 4, 4, 4], 32)
    with llmfw.load_model(model_file("qwen35", directory), backend="numpy") as model:
        unsupported = model.hparams.model_copy(update={"rope_sections": [4, 4, 4, 4]})
        with pytest.raises(ModelError, match="dimension_sections"):
            model.arch.check_hparams(unsupported)  # what loading such a file runs


# -- the native backend ------------------------------------------------------------------------------------------
#: the hybrid families the native backend runs entirely (the MoE ones with its MoE ops)
NATIVE_HYBRIDS = ["lfm2", "granitehybrid", "qwen35", "nemotron_h", "qwen35moe", "granitehybrid-moe"]


@pytest.fixture(scope="module", params=NATIVE_HYBRIDS)
def native_hybrid(request, directory):
    """(family, native-backend model, file) for each hybrid family the native kernels cover."""
    from support.native import kernels_or_skip

    kernels_or_skip()
    file = model_file(request.param, directory)
    with llmfw.load_model(file, backend="native") as loaded:
        yield request.param, loaded, file


def test_native_runs_every_op_itself(native_hybrid):
    """The convolutions and scans have native kernels: every split of a two-sequence ubatch is native's."""
    family, native_model, _ = native_hybrid
    ctx = native_model.new_context(n_ctx=512, n_seq_max=2)
    assert ctx.decode(Batch([1, 2, 3, 4], seq_id=[0, 0, 1, 1], pos=[0, 1, 0, 1])) == 0, ctx.last_error
    ops = {n.op for s in ctx._plan.splits for n in s.nodes}
    scans = ops & {"ssm_scan", "gated_delta"}  # LFM2 has convolutions only
    assert {"ssm_conv", "conv_window"} <= ops and (scans or family == "lfm2"), ops
    assert {s.backend.name for s in ctx._plan.splits} == {"native"}, family


def test_native_clears_the_bar_on_every_prompt(native_hybrid, score):
    every_prompt_clears_the_bar(score, *native_hybrid[:2], "native")


def test_native_ubatches_of_32_and_two_sequences_give_each_sequence_its_own_bits(native_hybrid, score):
    """Batch invariance: a sequence's logits are the same bits in one ubatch, in ubatches of 32, one token at a
    time and beside another sequence (the scans step token by token whatever the ubatch; every row is computed
    alone), and they clear the bar."""
    family, native_model, _ = native_hybrid
    record = longest(reference(family))
    whole = decode_all(native_model, record["sequence"], n_ctx=512)
    split = decode_all(native_model, record["sequence"], n_ctx=512, n_ubatch=32)
    assert_clears_bar(score, record, split, f"native {family} with n_ubatch 32")
    assert np.array_equal(whole, split)
    ctx = native_model.new_context(n_ctx=512)
    stepped = np.stack([_last_logits(ctx, [t]) for t in record["sequence"][:12]])
    assert np.array_equal(stepped, whole[:12])
    for prompt, logits in two_sequences_clear_the_bar(score, family, native_model, "native"):
        assert np.array_equal(decode_all(native_model, prompt["sequence"], n_ctx=512), logits)


def test_native_isa_paths_give_the_same_bits(native_hybrid):
    """The matmuls' instruction sets sum in one order; the recurrent kernels have one path for every CPU."""
    from support.native import kernels_or_skip

    family, native_model, file = native_hybrid
    sequence = longest(reference(family))["sequence"]
    expected = decode_all(native_model, sequence, n_ctx=512)
    for isa in kernels_or_skip().available_isas():
        with llmfw.load_model(file, backend="native",
                              backend_options={"native": {"isa": isa}}) as loaded:
            assert np.array_equal(decode_all(loaded, sequence, n_ctx=512), expected), isa


def test_native_seq_cp_fork_decodes_like_each_sequence_alone(native_hybrid):
    """The same bits: a forked row sees the same cells in the same order as the row decoded alone, and every
    row (matmul, attention, scan) is computed alone."""
    family, native_model, _ = native_hybrid
    assert max(fork_errors(native_model, family)) == 0.0
