"""The onnx backend's fused decoder ops: GroupQueryAttention (for batches whose KV cells are one causal run) and
SkipSimplifiedLayerNormalization, checked against the op-by-op translation they replace.

With float activations in MatMulNBits (``accuracy_level = 0``) both forms compute the same values up to summation
order, so every logit row of a session that goes through prompt chunks, decodes past a sliding window, a
speculative rollback (``seq_rm``), a copied sequence and a two-sequence batch (which must fall back to the
op-by-op attention) agrees with the op-by-op session's to float rounding.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from reference_gen.arch_files import build_model_file

import llmfw
from llmfw.plugins.backends.onnx.fused import causal_mask, is_causal_run

NEG = -np.inf


# -- the per-call check ---------------------------------------------------------------------------------------

def test_a_contiguous_causal_run_fits():
    mask = causal_mask(5, 3, 16, 0)
    assert is_causal_run(np.arange(5, 8), mask, 0)
    assert mask[0, 5] == 0 and mask[0, 6] == NEG and mask[2, 7] == 0 and mask[2, 8] == NEG
    assert is_causal_run(np.array([9]), causal_mask(9, 1, 16, 0), 0)


def test_a_windowed_mask_fits_only_its_window():
    mask = causal_mask(40, 1, 64, 32)
    assert mask[0, 8] == NEG and mask[0, 9] == 0 and mask[0, 40] == 0
    assert is_causal_run(np.array([40]), mask, 32)
    assert not is_causal_run(np.array([40]), mask, 0)
    assert not is_causal_run(np.array([40]), mask, 31)


@pytest.mark.parametrize("case", ["gap", "reordered", "other_sequence_visible", "own_cell_hidden", "past_n_kv",
                                  "empty", "rows_mismatch", "finite_bias", "row_hidden"])
def test_other_batches_do_not_fit(case):
    kv_idx, mask = np.arange(4, 7), causal_mask(4, 3, 16, 0)
    if case == "gap":
        kv_idx = np.array([4, 5, 7])
    elif case == "reordered":
        kv_idx = np.array([5, 4, 6])
    elif case == "other_sequence_visible":
        mask = mask.copy()
        mask[1, 10] = 0.0
    elif case == "own_cell_hidden":
        mask = mask.copy()
        mask[2, 0] = NEG
    elif case in ("finite_bias", "row_hidden"):
        mask = mask.copy()
        mask[1, 2] = -1.0 if case == "finite_bias" else NEG
        if case == "row_hidden":
            mask[1, :] = NEG
    elif case == "past_n_kv":
        kv_idx, mask = np.arange(14, 17), causal_mask(14, 3, 16, 0)[:, :16]
    elif case == "empty":
        kv_idx, mask = np.zeros(0, np.int64), np.zeros((0, 16), np.float32)
    else:
        mask = mask[:2]
    assert not is_causal_run(kv_idx, mask, 0)


# -- fused vs op by op on random-weight models ----------------------------------------------------------------

def _session_logits(path, fused: bool, gqa_session: bool = False) -> tuple[list[np.ndarray], tuple[int, int, int]]:
    """Logit rows of one scripted session, and the sessions built and runs of each attention branch."""
    options = {"fused_attention": fused, "gqa_session": gqa_session}
    with llmfw.load_model(path, backend="onnx", backend_options={"onnx": options}) as model:
        backend = model.backends["onnx"]
        backend.accuracy_level = 0
        ctx = model.new_context(n_ctx=256, n_seq_max=2, n_ubatch=16, n_batch=64)
        rows: list[np.ndarray] = []

        def decode(batch: llmfw.Batch) -> None:
            assert ctx.decode(batch) == 0, ctx.last_error
            rows.append(ctx.get_logits().copy())

        decode(llmfw.Batch(list(range(3, 43)), logits=True))          # 40 tokens: chunks of 16 past the window
        for token in range(50, 58):
            decode(llmfw.Batch([token]))
        ctx.memory.seq_rm(0, 45, -1)                                  # speculative rollback of 3 tokens
        for token in range(60, 63):
            decode(llmfw.Batch([token], pos=[45 + token - 60]))
        ctx.memory.seq_cp(0, 1, -1, -1)
        decode(llmfw.Batch([70, 71], pos=[48, 48], seq_id=[0, 1], logits=True))  # two sequences: op by op
        decode(llmfw.Batch([72], pos=[49], seq_id=[1]))
        forms = backend.sessions_built, backend.gqa_runs, backend.op_by_op_runs
        ctx.close()
    return rows, forms


@pytest.mark.parametrize("gqa_session", [False, True], ids=["if_per_layer", "gqa_session"])
@pytest.mark.parametrize("name", ["gemma2", "llama-rope-yarn"])
def test_fused_attention_matches_op_by_op(tmp_path, name, gqa_session):
    path = build_model_file(name, tmp_path)
    fused, (sessions, gqa_runs, op_by_op_runs) = _session_logits(path, True, gqa_session)
    plain, plain_forms = _session_logits(path, False)
    # the single-sequence batches run GQA, the two-sequence one does not: in one session (an If per layer), or
    # in a session of each form
    assert sessions == (2 if gqa_session else 1) and gqa_runs >= 10 and op_by_op_runs >= 1
    assert plain_forms == (1, 0, 0)
    for step, (got, want) in enumerate(zip(fused, plain)):
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-3 * max(1.0, float(np.abs(want).max())), step


def _two_contexts(path, fused: bool) -> np.ndarray:
    """Logits of a 300-token prompt in a second context of 512 cells after one of 256 on the same model."""
    with llmfw.load_model(path, backend="onnx", backend_options={"onnx": {"fused_attention": fused}}) as model:
        model.backends["onnx"].accuracy_level = 0
        small = model.new_context(n_ctx=32, n_ubatch=16)
        assert small.decode(llmfw.Batch(list(range(3, 23)), logits=True)) == 0, small.last_error
        small.close()
        large = model.new_context(n_ctx=512, n_ubatch=128, n_batch=512)
        assert large.decode(llmfw.Batch(list(range(3, 303)), logits=True)) == 0, large.last_error
        logits = large.get_logits().copy()
        large.close()
    return logits


def test_a_larger_context_gets_rotary_tables_of_its_own_size(tmp_path):
    path = build_model_file("llama-rope-yarn", tmp_path)
    got, want = _two_contexts(path, True), _two_contexts(path, False)
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, float(np.abs(want).max()))


@pytest.mark.usefixtures("onnx_batch_invariance_premise")
def test_default_attention_gives_every_row_the_same_bits_whatever_the_batch(smollm2_path):
    """What speculative decoding stands on: a verify batch of k tokens must give the logits k one-token decodes
    give, bit for bit (ORT's GroupQueryAttention does not: hence ``fused_attention`` is off by default)."""
    prompt, extra = list(range(300, 320)), [500, 501, 502, 503]
    with llmfw.load_model(smollm2_path, backend="onnx") as model:
        assert model.backends["onnx"].onnx_options.fused_attention is False

        def logits(chunks):
            ctx = model.new_context(n_ctx=128)
            rows, pos = [], 0
            for chunk in chunks:
                batch = llmfw.Batch(chunk, pos=list(range(pos, pos + len(chunk))), logits=[True] * len(chunk))
                assert ctx.decode(batch) == 0
                rows += [np.array(ctx.get_logits_ith(i)) for i in range(len(chunk))]
                pos += len(chunk)
            ctx.close()
            return np.array(rows[-len(extra):])

        np.testing.assert_array_equal(logits([prompt, extra]), logits([prompt] + [[t] for t in extra]))
