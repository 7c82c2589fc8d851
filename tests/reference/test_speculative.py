"""Speculative decoding: prompt-lookup (n-gram) drafts and a draft model, verified in one batch.

The proof that matters: greedy output with drafting equals greedy output without it, on every reference
prompt of both real models (the drafts are really made and partly rejected, so both paths are exercised).
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmfw.core.errors import ConfigError
from llmfw.core.generate import GenerationStats, generate
from llmfw.core.pipeline import Pipeline
from llmfw.core.speculative import DraftModelDrafter, NgramDrafter
from support.cli import llmfw_in_process


def llama_cpp_ngram_simple(tokens: list[int], sampled: int, n: int, m: int) -> list[int]:
    """common_ngram_simple_draft (common/ngram-map.cpp) transcribed loop for loop."""
    cur_len = len(tokens)
    if cur_len <= n + m + 1:
        return []
    pattern = tokens[cur_len - n + 1:] + [sampled]
    match_pos = 0
    for j in range(cur_len - n - 1, 0, -1):
        if all(tokens[j + k] == pattern[k] for k in range(len(pattern))):
            match_pos = j
            break
    if match_pos == 0:
        return []
    copy_max = min(m, cur_len - (match_pos + n))
    if copy_max < n:
        return []
    return tokens[match_pos + n:match_pos + n + copy_max]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.integers(0, 3), st.integers(1, 5), st.integers(1, 8))
def test_ngram_drafts_are_llama_cpps(tokens, sampled, n, m):
    assert NgramDrafter(m, n).draft(tokens, sampled) == llama_cpp_ngram_simple(tokens, sampled, n, m)


def test_ngram_draft_copies_what_followed_the_last_occurrence():
    history = [1, 2, 3, 4, 5, 6, 7, 9, 9, 1, 2, 3, 4, 8, 8, 8, 8, 1, 2]
    assert NgramDrafter(4, 3).draft(history, 3) == [4, 8, 8, 8]  # the later "1 2 3" wins over the first one
    assert NgramDrafter(4, 3).draft(history, 7) == []             # "1 2 7" never occurred


def test_ngram_draft_is_cut_to_the_limit():
    history = [1, 2, 3, 4, 5, 6, 7, 9, 9, 1, 2, 3, 4, 8, 8, 8, 8, 1, 2]
    assert NgramDrafter(4, 3).draft(history, 3, limit=2) == [4, 8]


@pytest.mark.parametrize("kw", [{"n_max": 0}, {"size_n": 0}, {"n_max": 5000}])
def test_bad_drafter_settings_are_config_errors(kw):
    with pytest.raises(ConfigError):
        NgramDrafter(**kw)


def _greedy(ctx, prompt_ids, n, draft=None):
    stats = GenerationStats()
    text = "".join(generate(ctx, prompt_ids, max_tokens=n, stats=stats, draft=draft))
    return text, stats


@pytest.mark.usefixtures("onnx_batch_invariance_premise")
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_greedy_output_is_unchanged_by_ngram_drafting_on_every_reference_prompt(
        which, request, shared_models):
    ref = request.getfixturevalue(f"{which}_ref")
    model = shared_models.get(which)
    ctx = model.new_context(n_ctx=4096)
    drafted = rejected = 0
    for record in ref["prompts"]:
        n = len(record["sequence"]) - len(record["prompt_ids"])
        plain_text, plain = _greedy(ctx, record["prompt_ids"], n)
        spec_text, spec = _greedy(ctx, record["prompt_ids"], n, NgramDrafter(8, 2))
        assert spec.tokens == plain.tokens, record["prompt"][:40]
        assert spec_text == plain_text
        assert spec.n_accepted <= spec.n_drafted
        drafted += spec.n_drafted
        rejected += spec.n_drafted - spec.n_accepted
        # after the rollback the cache holds exactly the prompt and the emitted tokens (minus the last)
        assert int(ctx.memory.seq_pos_max(0)) + 1 == len(ctx.seq_tokens[0])
    assert drafted > 0 and rejected > 0  # both the accept and the rollback paths ran


def test_draft_model_mode_with_the_same_model_accepts_everything(shared_models, smollm2_ref):
    model = shared_models.get("smollm2")
    record = smollm2_ref["prompts"][1]
    n = 12
    plain_text, plain = _greedy(model.new_context(n_ctx=256), record["prompt_ids"], n)
    drafter = DraftModelDrafter(model, model, n_max=4, n_ctx=256)
    spec_text, spec = _greedy(model.new_context(n_ctx=256), record["prompt_ids"], n, drafter)
    assert spec.tokens == plain.tokens and spec_text == plain_text
    assert spec.n_drafted > 0 and spec.n_accepted == spec.n_drafted
    assert spec.n_verify_batches <= n // 4 + 1  # 4 drafted + 1 sampled per batch: few target decodes


def test_draft_model_with_another_vocabulary_is_refused(shared_models):
    target = shared_models.get("smollm2", vocab_only=True)
    draft = shared_models.get("gemma3", vocab_only=True)
    with pytest.raises(ConfigError, match="vocabulary"):
        DraftModelDrafter(target, draft)


def test_yaml_speculative_section():
    pipeline = Pipeline.from_dict({"speculative": {"draft_max": 6, "ngram_n": 4}})
    drafter = pipeline.make_drafter(model=object())
    assert isinstance(drafter, NgramDrafter) and (drafter.n_max, drafter.size_n) == (6, 4)
    assert Pipeline.from_dict({}).make_drafter(model=object()) is None
    with pytest.raises(ConfigError, match="speculative"):
        Pipeline.from_dict({"speculative": {"draft_maxx": 3}})
    with pytest.raises(ConfigError, match="draft_max"):
        Pipeline.from_dict({"speculative": {"draft_max": -1}})


def test_run_draft_max_flag_drafts_and_reports_acceptance(smollm2_path):
    # a continuation that repeats its prompt, so prompt lookup drafts (on any backend: the text is unambiguous)
    prompt = "1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3,"
    cmd = [sys.executable, "-m", "llmfw.cli", "run", "-m", str(smollm2_path), "--no-progress", "-n", "12", prompt]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    spec = subprocess.run(cmd[:4] + ["--draft-max", "8"] + cmd[4:], capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "accepted" in spec.stderr and "accepted" not in plain.stderr
    bad = llmfw_in_process(*cmd[3:4], "--draft-max", "0", *cmd[4:])
    assert bad.returncode != 0 and "draft-max" in bad.stderr
