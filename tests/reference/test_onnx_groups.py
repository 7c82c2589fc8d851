"""The op-by-op attention's row groups (llmfw/plugins/backends/onnx/groups.py): a batch of tokens of different
sequences attends per row over the cells each row sees; a batch of one sequence keeps the plain prefix.

A sequence decoding among others then gets, bit for bit, the logits it gets decoding alone: its cells are
gathered into the first slots, where they lie when it is the cache's only sequence, and the rest is masked off.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from reference_gen.arch_files import build_model_file

import llmfw
from llmfw.plugins.backends.onnx.fused import causal_mask
from llmfw.plugins.backends.onnx.groups import CELL_PAD, MAX_ROW_GROUPS, attention_cells, prefix_blocks

NEG = -np.inf


def _interleaved_mask(n_seqs: int, steps: int, n_kv: int) -> np.ndarray:
    """One decode token per sequence after ``steps`` steps of all of them: cell 4*step + s is sequence s's."""
    mask = np.full((n_seqs, n_kv), NEG, np.float32)
    for s in range(n_seqs):
        mask[s, s:n_seqs * (steps + 1):n_seqs] = 0.0
    return mask


# -- the per-call grouping ------------------------------------------------------------------------------------

def test_tokens_of_different_sequences_get_a_group_each_over_the_cells_they_see():
    mask = _interleaved_mask(4, 9, 256)                      # 10 cells per sequence, 40 used
    graph_mask, cells = attention_cells(mask, 768)
    assert cells.shape == (4, CELL_PAD) and graph_mask.shape == (4, CELL_PAD)
    for s in range(4):
        np.testing.assert_array_equal(cells[s, :10], np.arange(s, 40, 4))
        assert (graph_mask[s, :10] == 0).all() and (graph_mask[s, 10:] == NEG).all()
        assert (cells[s, 10:] == 0).all()                    # padding: a valid cell, masked off


def test_a_finite_mask_value_moves_with_its_cell():
    mask = _interleaved_mask(2, 3, 256)
    mask[1, 5] = -2.5
    graph_mask, cells = attention_cells(mask, 768)
    assert cells[1, 2] == 5 and graph_mask[1, 2] == np.float32(-2.5)


def test_sequences_sharing_a_prompt_still_get_a_group_each():
    mask = np.full((2, 256), NEG, np.float32)
    mask[:, :20] = 0.0                                       # the prompt, copied to both (seq_cp)
    mask[0, 20], mask[1, 21] = 0.0, 0.0                      # each one's own new token
    graph_mask, cells = attention_cells(mask, 768)
    assert cells.shape == (2, 32)
    np.testing.assert_array_equal(cells[0, :21], np.arange(21))
    np.testing.assert_array_equal(cells[1, :21], [*range(20), 21])


@pytest.mark.parametrize("case", ["one_row", "one_sequence", "non_causal", "same_sequence_inside",
                                  "too_wide", "too_many_rows", "a_row_sees_nothing"])
def test_other_batches_keep_the_plain_prefix(case):
    if case == "one_row":
        mask = _interleaved_mask(4, 9, 256)[:1]
    elif case == "one_sequence":                             # a prompt chunk, a speculative verify batch
        mask = causal_mask(30, 4, 256, 0)
    elif case == "non_causal":                               # every row sees the same cells
        mask = np.where(np.arange(256) < 12, 0.0, NEG).astype(np.float32)[None].repeat(3, axis=0)
    elif case == "same_sequence_inside":                     # two tokens of sequence 0 next to sequence 1's
        mask = _interleaved_mask(2, 5, 256)
        mask = np.vstack([mask, mask[:1]])
        mask[2, 12] = 0.0
    elif case == "too_wide":                                 # 2 rows × 224 cells gather more than 256
        mask = np.full((2, 256), NEG, np.float32)
        mask[:, :200] = 0.0
        mask[0, 200], mask[1, 201] = 0.0, 0.0
    elif case == "too_many_rows":
        mask = _interleaved_mask(MAX_ROW_GROUPS + 1, 0, 256)
    else:                                                    # seen as inside every row: no savings to make
        mask = _interleaved_mask(3, 2, 256)
        mask[1] = NEG
    graph_mask, cells = attention_cells(mask, 768)
    seen = np.flatnonzero((mask != NEG).any(axis=0))
    width = -(-(seen[-1] + 1) // CELL_PAD) * CELL_PAD            # the prefix ends after the last cell a row sees
    np.testing.assert_array_equal(graph_mask, mask[:, :width])
    np.testing.assert_array_equal(cells, prefix_blocks(width, 768))


@pytest.mark.parametrize(("last_seen", "width"), [(-1, 32), (0, 32), (31, 32), (32, 64), (200, 224), (255, 256)])
def test_a_plain_prefix_ends_after_the_last_cell_a_row_sees(last_seen, width):
    mask = np.full((3, 256), NEG, np.float32)
    if last_seen >= 0:
        mask[1, :last_seen + 1] = 0.0
    graph_mask, cells = attention_cells(mask, 768)
    assert graph_mask.shape == (3, width) and graph_mask.flags.c_contiguous
    np.testing.assert_array_equal(graph_mask, mask[:, :width])
    np.testing.assert_array_equal(cells, prefix_blocks(width, 768))
    if width == 256:
        assert graph_mask is mask                                 # nothing to cut: no copy


@pytest.mark.parametrize(("n_kv", "n_cells", "blocks"), [(256, 256, 1), (512, 768, 2), (768, 768, 1), (96, 160, 3)])
def test_a_plain_prefix_is_gathered_in_blocks_that_divide_it_and_the_cache(n_kv, n_cells, blocks):
    np.testing.assert_array_equal(prefix_blocks(n_kv, n_cells), np.arange(blocks)[None])


# -- on real models --------------------------------------------------------------------------------------------

#: sequence s joins at step JOIN * s; all decode until STEPS
STEPS, JOIN = 10, 2


def _decoded_together(model, n_seqs: int) -> dict[int, list[np.ndarray]]:
    """Each sequence's logit rows when the sequences decode in one batch per step (a late joiner included)."""
    ctx = model.new_context(n_ctx=256, n_seq_max=n_seqs, n_batch=n_seqs)
    rows: dict[int, list[np.ndarray]] = {s: [] for s in range(n_seqs)}
    for step in range(STEPS):
        seqs = [s for s in range(n_seqs) if step >= JOIN * s]
        batch = llmfw.Batch([100 + 10 * s + step for s in seqs], pos=[step - JOIN * s for s in seqs],
                            seq_id=seqs, logits=True)
        assert ctx.decode(batch) == 0, ctx.last_error
        for i, s in enumerate(seqs):
            rows[s].append(np.array(ctx.get_logits_ith(i)))
    ctx.close()
    return rows


def _decoded_alone(model, s: int) -> list[np.ndarray]:
    ctx = model.new_context(n_ctx=256)
    rows = []
    for pos in range(STEPS - JOIN * s):
        assert ctx.decode(llmfw.Batch([100 + 10 * s + JOIN * s + pos], pos=[pos])) == 0, ctx.last_error
        rows.append(np.array(ctx.get_logits_ith(0)))
    ctx.close()
    return rows


def _assert_each_sequence_decodes_as_if_alone(path) -> None:
    with llmfw.load_model(path, backend="onnx") as model:
        together = _decoded_together(model, 3)
        for s in range(3):
            np.testing.assert_array_equal(np.array(together[s]), np.array(_decoded_alone(model, s)), err_msg=f"{s}")


@pytest.mark.usefixtures("onnx_batch_invariance_premise")
def test_a_sequence_decoding_among_others_gets_the_bits_it_gets_alone(smollm2_path):
    _assert_each_sequence_decodes_as_if_alone(smollm2_path)


@pytest.mark.usefixtures("onnx_batch_invariance_premise")
def test_so_does_one_behind_a_sliding_window_with_a_softcap(tmp_path):
    _assert_each_sequence_decodes_as_if_alone(build_model_file("gemma2", tmp_path))


@pytest.mark.usefixtures("onnx_batch_invariance_premise")
def test_so_does_one_of_gemma3_whose_key_heads_are_scored_in_slices(gemma3_path):
    _assert_each_sequence_decodes_as_if_alone(gemma3_path)


@pytest.mark.usefixtures("onnx_batch_invariance_premise")
def test_so_does_one_with_a_query_head_per_kv_head(tmp_path):
    _assert_each_sequence_decodes_as_if_alone(build_model_file("olmo", tmp_path))  # olmo: 4 heads, 4 KV heads


@pytest.mark.usefixtures("onnx_batch_invariance_premise")
@pytest.mark.parametrize("row_padding", ["auto", "always"])
@pytest.mark.parametrize("name", ["olmo", "qwen2"])
def test_one_token_steps_get_the_bits_of_the_same_rows_in_longer_batches(tmp_path, name, row_padding):
    """What speculative decoding needs (its verify batch must reproduce plain greedy steps), on families with one
    query head per KV head (olmo: MLAS's one-row kernel) and grouped heads (qwen2). Not asserted for a sliding
    window smaller than the context: there a batch's tokens may take other cells of the window's ring than
    one-token steps (cells its own tokens still see are not reused, as in llama.cpp), and the cells' order is
    the order of the attention's sums. ``always`` pads every block product to two rows, as ``auto`` does on a
    CPU whose one-row kernel rounds otherwise (AVX2 without AVX-512), so that path is checked on every CPU."""
    tokens = [(37 * i) % 900 + 10 for i in range(300)]

    def rows(path, chunks):
        with llmfw.load_model(path, backend="onnx", backend_options={"onnx": {"row_padding": row_padding}}) as model:
            ctx, start, out = model.new_context(n_ctx=512, n_batch=64), 0, []
            for size in chunks:
                batch = llmfw.Batch(tokens[start:start + size], pos=list(range(start, start + size)),
                                    logits=[True] * size)
                assert ctx.decode(batch) == 0, ctx.last_error
                out += [np.array(ctx.get_logits_ith(i)) for i in range(size)]
                start += size
            ctx.close()
            return np.array(out)

    path = build_model_file(name, tmp_path)
    prompt = 270                                             # past 256: the cells span two blocks of the cache
    steps = rows(path, [64] * 4 + [prompt - 256] + [1] * 12)
    batches = rows(path, [64] * 4 + [prompt - 256] + [4, 3, 5])
    np.testing.assert_array_equal(steps[prompt:], batches[prompt:])


def test_contexts_of_other_cache_sizes_share_the_session_and_get_the_same_bits(smollm2_path):
    """A plain prefix is gathered in blocks dividing this context's cache: 512 cells of a 512-cell cache in one,
    of a 1280-cell one in two of 256 — the same model (one session), the same logits."""
    prompt = list(range(300, 600))
    with llmfw.load_model(smollm2_path, backend="onnx") as model:
        logits = []
        for n_ctx in (512, 1280):
            ctx = model.new_context(n_ctx=n_ctx, n_batch=512)
            assert ctx.decode(llmfw.Batch(prompt)) == 0, ctx.last_error
            logits.append(np.array(ctx.get_logits_ith(-1)))
            ctx.close()
        assert model.backends["onnx"].sessions_built == 1
    np.testing.assert_array_equal(logits[0], logits[1])


def test_padding_a_one_row_product_changes_no_more_than_its_rounding(tmp_path):
    """The extra row only moves a product onto MLAS's many-row kernel (and changes which of ORT's fusions apply):
    with and without it the logits agree to the kernels' 8-bit activation rounding, not to a different answer."""
    path = build_model_file("qwen2", tmp_path)
    tokens = [(37 * i) % 900 + 10 for i in range(24)]
    logits = {}
    for mode in ("never", "always"):
        with llmfw.load_model(path, backend="onnx", backend_options={"onnx": {"row_padding": mode}}) as model:
            assert model.backends["onnx"].pads_one_row_products is (mode == "always")
            ctx = model.new_context(n_ctx=64)
            steps = []
            for pos, token in enumerate(tokens):
                assert ctx.decode(llmfw.Batch([token], pos=[pos])) == 0
                steps.append(np.array(ctx.get_logits_ith(-1)))
            logits[mode] = np.array(steps)
    np.testing.assert_allclose(logits["always"], logits["never"], rtol=0, atol=0.25)
    assert (logits["always"].argmax(-1) == logits["never"].argmax(-1)).mean() >= 0.9
