"""The native backend on the real models: llama.cpp's reference prompts within the bar, greedy tokens equal to
llama.cpp's up to its first close call, the tg path (one token per decode), and the kernels' construction
property on a whole model (every ISA path gives the same logits, bit for bit)."""
from __future__ import annotations

import numpy as np
import pytest

import llmfw
from llmfw.core.backend import WeightSource
from llmfw.core.errors import ModelError
from llmfw.core.quants import GGMLType

from support.native import kernels_or_skip
from support.scores import assert_within_bar, teacher_forced_logits

kernels_or_skip()
SHORT = 1000  # the reference files' long prompts (2,700 tokens) are for the slow suites


@pytest.fixture(scope="module")
def smollm2_native(smollm2_path):
    model = llmfw.load_model(smollm2_path, backend="native")
    yield model
    model.close()


@pytest.fixture(scope="module")
def gemma3_native(gemma3_path):
    model = llmfw.load_model(gemma3_path, backend="native")
    yield model
    model.close()


def check_prompts(model, ref: dict, score, confident_prefix) -> None:
    for index, record in enumerate(ref["prompts"]):
        if len(record["sequence"]) > SHORT:
            continue
        logits = teacher_forced_logits(model, record["sequence"])
        assert_within_bar(score(record, logits), f"prompt {index}")
        start, n_sure = len(record["prompt_ids"]) - 1, confident_prefix(record)
        greedy = logits[start:start + n_sure].argmax(axis=-1).tolist()
        assert greedy == record["sequence"][start + 1:start + 1 + n_sure], f"prompt {index}: greedy tokens"


def test_smollm2_prompts_within_bar_and_greedy_as_llama_cpp(smollm2_native, smollm2_ref, score, confident_prefix):
    check_prompts(smollm2_native, smollm2_ref, score, confident_prefix)


def test_gemma3_prompts_within_bar_and_greedy_as_llama_cpp(gemma3_native, gemma3_ref, score, confident_prefix):
    check_prompts(gemma3_native, gemma3_ref, score, confident_prefix)


def test_smollm2_token_by_token_decode_within_bar(smollm2_native, smollm2_ref, score):
    record = smollm2_ref["prompts"][0]
    prompt, sequence = record["prompt_ids"], record["sequence"]
    ctx = smollm2_native.new_context(n_ctx=512)
    assert ctx.decode(llmfw.Batch(tokens=prompt, logits=True)) == 0
    rows = [ctx.get_logits()]
    for token in sequence[len(prompt):]:
        assert ctx.decode(llmfw.Batch(tokens=[token])) == 0
        rows.append(ctx.get_logits_ith(-1)[None, :])
    ctx.close()
    assert_within_bar(score(record, np.concatenate(rows)), "token by token")


def test_logits_kept_from_a_decode_stay_as_they_were_after_the_next(smollm2_native):
    """The native backend writes each step's logits into a new array that the context keeps as it is (no copy): an
    array a caller kept is never written again, whether the next decode has one row or several, and its rows are
    the batch's outputs in order."""
    ctx = smollm2_native.new_context(n_ctx=256, n_seq_max=2)
    assert ctx.decode(llmfw.Batch(tokens=[1, 2, 3], logits=True)) == 0
    first = ctx.get_logits()
    kept = first.copy()
    assert ctx.decode(llmfw.Batch(tokens=[4], pos=[3])) == 0
    second = ctx.get_logits()
    assert ctx.decode(llmfw.Batch(tokens=[5, 6], pos=[4, 0], seq_id=[0, 1], logits=[True, True])) == 0
    third = ctx.get_logits()
    assert np.array_equal(first, kept) and first.shape == (3, ctx.n_vocab) and second.shape == (1, ctx.n_vocab)
    assert not np.shares_memory(first, second) and not np.shares_memory(second, third)
    assert np.array_equal(third[0], ctx.get_logits_ith(0)) and np.array_equal(third[1], ctx.get_logits_ith(1))
    ctx.close()


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_a_sequence_gives_the_same_logits_bit_for_bit_alone_token_by_token_and_beside_another(which, smollm2_native,
                                                                                              gemma3_native):
    """Batch invariance on a whole model: the native ops compute each row alone in a fixed order (the numpy ops
    this backend still uses are elementwise), so neither the batch, nor its neighbours, nor the thread count
    changes a bit of a sequence's logits."""
    model = smollm2_native if which == "smollm2" else gemma3_native
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(100, 5000, 20)]
    other = [int(t) for t in rng.integers(100, 5000, 9)]

    def decode(batches, n_threads=2):
        ctx = model.new_context(n_ctx=256, n_seq_max=2, n_threads=n_threads)
        rows = []
        for batch, keep in batches:
            assert ctx.decode(batch) == 0
            rows.append(ctx.get_logits()[keep].copy())
        ctx.close()
        return np.concatenate(rows)

    together = decode([(llmfw.Batch(tokens=tokens, logits=True), slice(None))])
    one_by_one = decode([(llmfw.Batch(tokens=[t], logits=True), slice(None)) for t in tokens], n_threads=1)
    beside = decode([(llmfw.Batch(tokens=other + tokens, seq_id=[1] * len(other) + [0] * len(tokens),
                                  pos=list(range(len(other))) + list(range(len(tokens))), logits=True),
                      slice(len(other), None))], n_threads=3)
    assert np.array_equal(one_by_one, together)
    assert np.array_equal(beside, together)


def test_gemma3_rows_past_its_window_ring_have_the_whole_prompts_bits(gemma3_native):
    """Gemma 3's sliding-window cache keeps n_swa + n_ubatch cells (768 in ubatches of 64), a ring this prompt
    wraps: ubatches of 64 then one token at a time give the rows past the window the bits of the whole prompt
    in one ubatch, whose cache does not wrap (the native attention sums the cells by position, not by cell)."""
    tokens = [int(t) for t in np.random.default_rng(1).integers(100, 5000, 820)]
    kept = 700  # the rows compared: their windows span the ring's wrap (logits of every row would be 0.9 GB)

    def decode(n_ubatch: int, together: int) -> tuple[np.ndarray, bool]:
        ctx = gemma3_native.new_context(n_ctx=1024, n_ubatch=n_ubatch, n_batch=1024)
        assert ctx.decode(llmfw.Batch(tokens[:together], logits=[i >= kept for i in range(together)])) == 0
        rows = [ctx.get_logits().copy()]
        for pos in range(together, len(tokens)):
            assert ctx.decode(llmfw.Batch([tokens[pos]], pos=[pos], logits=True)) == 0
            rows.append(ctx.get_logits().copy())
        wrapped = ctx.memory.swa.n_cells < len(tokens)
        ctx.close()
        return np.concatenate(rows), wrapped

    whole, whole_wrapped = decode(1024, len(tokens))
    pieces, pieces_wrapped = decode(64, 790)
    assert (whole_wrapped, pieces_wrapped) == (False, True)
    assert np.array_equal(pieces, whole)


def test_every_isa_path_gives_the_same_logits(smollm2_path, smollm2_ref):
    """The kernels' paths differ in instructions, never in results (csrc/native.h), so forcing the portable C
    path changes no bit of a model's logits."""
    tokens = smollm2_ref["prompts"][2]["prompt_ids"][:12]
    logits = {}
    for isa in kernels_or_skip().available_isas():
        model = llmfw.load_model(smollm2_path, backend="native", backend_options={"native": {"isa": isa}})
        assert model.backends["native"].isa == isa
        ctx = model.new_context(n_ctx=64)
        assert ctx.decode(llmfw.Batch(tokens=tokens, logits=True)) == 0
        logits[isa] = ctx.get_logits().copy()
        model.close()
    for isa, values in logits.items():
        assert np.array_equal(values, logits["scalar"]), isa


def test_a_weight_type_without_a_kernel_is_declined_with_the_reason():
    from llmfw.plugins.backends.native import NativeBackend

    backend = NativeBackend()
    source = WeightSource("blk.0.ffn_up.weight", "blk.0.ffn_up.weight", int(GGMLType.IQ2_XXS), (256, 4),
                          np.zeros(4 * 66, dtype=np.uint8), frozenset({"mul_mat"}))
    with pytest.raises(ModelError, match="no kernel for IQ2_XXS weights"):
        backend.load_weight(source)


def test_weights_are_counted_in_their_repacked_size(smollm2_native):
    backend = smollm2_native.backends["native"]
    # the matrices as loaded (a fused matrix "a+b+c" shares its parts' bytes, the tied head its embedding's: counted
    # once)
    distinct = {id(h): h for name, h in backend.weights.items() if hasattr(h, "packed") and "+" not in name}
    packed = sum(h.packed.nbytes for h in distinct.values())
    assert backend.weights["output.weight"] is backend.weights["token_embd.weight"]
    assert packed > 50 * 2**20  # SmolLM2-135M's matrices, 4-8 bits a weight
    assert packed <= backend.weight_nbytes() < 2 * packed


def native_without(op: str, name: str, priority: int = 0) -> type:
    """The native backend as a build without ``op``'s kernel would be (every op of the core's graphs has one now;
    a plugin architecture's own op would not)."""
    from llmfw.plugins.backends.native import NativeBackend
    from llmfw.plugins.backends.native.runtime import NATIVE_OPS

    return type(name.replace("-", "_"), (NativeBackend,), {"name": name, "supported_ops": NATIVE_OPS - {op},
                                                          "default_priority": {"cpu": priority} if priority else {}})


def test_a_model_with_an_op_without_a_kernel_is_declined_at_load_naming_the_op(tmp_path):
    from llmfw.core.plugins import registry, reset_plugin_manager
    from reference_gen.arch_testing import model_file

    reset_plugin_manager()
    try:
        registry("backends").register("native-no-experts", native_without("mul_mat_id", "native-no-experts"))
        with pytest.raises(ModelError, match="cannot run qwen3moe.gguf: the native backend has no kernel for op "
                                             "'mul_mat_id'"):
            llmfw.load_model(model_file("qwen3moe", tmp_path), backend="native-no-experts")
    finally:
        reset_plugin_manager()


def test_a_default_that_declines_a_model_is_skipped_for_the_next_by_priority(tmp_path):
    """The highest-priority backend is the default only for the models it can run: for another it is skipped,
    with its reason, for the next by priority — before any weight is converted."""
    from llmfw.core.plugins import registry, reset_plugin_manager
    from reference_gen.arch_testing import model_file

    moe, dense = model_file("qwen3moe", tmp_path), model_file("qwen3", tmp_path)
    reset_plugin_manager()
    try:
        registry("backends").register("native-first", native_without("mul_mat_id", "native-first", 5000))
        with llmfw.load_model(dense) as model:
            assert model.backend_choice.startswith("native-first (the default")
        with llmfw.load_model(moe) as model:
            assert not model.backend_choice.startswith("native-first")
            assert "skipped native-first: declines this model: the native backend has no kernel for op " \
                   "'mul_mat_id'" in model.backend_choice
            ctx = model.new_context(n_ctx=64)
            assert ctx.decode(llmfw.Batch(tokens=[1, 2, 3], logits=True)) == 0
    finally:
        reset_plugin_manager()
