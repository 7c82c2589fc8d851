"""The dense random-weight families on the native backend (issue 32: every family of tests/data/arch/ runs entirely
in llmfw's own kernels): every split of a prompt is native's, every prompt clears llama.cpp's bar, and ubatches
of 32 and (for the sliding-window families, whose window cache wraps) one token at a time give the whole
prompt's bits (batch invariance). The MoE families are held on native in test_arch_moe.py,
the hybrids in test_recurrent_memory.py."""
from __future__ import annotations

import numpy as np
import pytest

from reference_gen.arch_specs import MOE_MODELS, SPECS
from reference_gen.arch_testing import assert_clears_bar, decode_all, longest, model_file, records, reference

import llmfw

from support.native import kernels_or_skip

kernels_or_skip()

HYBRIDS = {"lfm2", "granitehybrid", "qwen35", "nemotron_h"}
DENSE = sorted(set(SPECS) - set(MOE_MODELS.values()) - HYBRIDS)
UBATCH = 32
#: families with sliding-window layers: their window cache is a ring whose cells wrap (in ubatches of 32, or one
#: token at a time), so cell order is not position order there; the native attention sums by position
WINDOWED = {"gemma2", "gemma4"}


@pytest.fixture(scope="module", params=DENSE)
def native_family(request, tmp_path_factory):
    """(family, its native-backend model), built once per family."""
    if request.param == "olmo":  # its architecture comes from the example plugin package
        pytest.importorskip("llmfw_olmo")
    path = model_file(request.param, tmp_path_factory.mktemp("native-arch"))
    with llmfw.load_model(path, backend="native") as model:
        yield request.param, model


def test_every_prompt_clears_the_bar_on_native_alone(native_family, score):
    family, model = native_family
    ref = reference(family)
    for record in records(ref):
        with model.new_context(n_ctx=record["n_ctx"]) as ctx:
            assert ctx.decode(llmfw.Batch(record["sequence"], logits=True)) == 0, ctx.last_error
            assert {split.backend.name for split in ctx._plan.splits} == {"native"}, family
            assert_clears_bar(score, record, ctx.get_logits().copy(), f"{family} on native")


def test_ubatches_of_32_give_the_whole_prompts_bits(native_family, score):
    family, model = native_family
    record = longest(reference(family))
    whole = decode_all(model, record["sequence"], n_ctx=record["n_ctx"])
    split = decode_all(model, record["sequence"], n_ctx=record["n_ctx"], n_ubatch=UBATCH)
    assert np.array_equal(whole, split), family


@pytest.mark.parametrize("native_family", sorted(WINDOWED), indirect=True)
def test_one_token_at_a_time_past_the_window_gives_the_whole_prompts_bits(native_family):
    """One token per decode (and one thread) keeps a window cache of 256 cells, which the longest prompt wraps:
    every row, those whose window spans the wrap included, has the bits of the whole prompt in one ubatch."""
    family, model = native_family
    record = longest(reference(family))
    sequence = record["sequence"]
    whole = decode_all(model, sequence, n_ctx=record["n_ctx"])
    with model.new_context(n_ctx=record["n_ctx"], n_ubatch=1, n_threads=1) as ctx:
        assert ctx.memory.swa.n_cells < len(sequence), "the window cache must wrap for this test to hold"
        rows = []
        for pos, token in enumerate(sequence):
            assert ctx.decode(llmfw.Batch([token], pos=[pos], logits=True)) == 0, ctx.last_error
            rows.append(ctx.get_logits()[0].copy())
    assert np.array_equal(whole, np.stack(rows)), family
