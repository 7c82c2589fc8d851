"""Gemma-3-270M (arch ``gemma3``, sliding window 512 on 5 of every 6 layers) on the numpy backend against
llama.cpp's reference outputs.

Teacher forcing: each prompt's ``sequence`` is decoded with logits for every token, in batches of 512 tokens
(the same ubatches as one big batch: 512, 512, 172 for the 1,196-token prompt), once with n_ubatch 512 and
once with n_ubatch 64, side by side; every prompt must clear the bar of the reference README (top1 ≥ 0.93,
top5 ≥ 0.98, mean_lp_err ≤ 0.25) with both, and the two must agree within 1e-3. Batching by 512 keeps memory
modest: Gemma's head has 262,144 rows, so the 1,196 logits rows alone would be 1.25 GB of float32; each batch
is scored as it comes (with the reference ``score`` on that slice of positions) and the parts are combined.

The long prompt crosses the window: local layers keep only their bounded cache (1,024 / 768 cells), the global
ones the whole context; one-token decode steps past the window give the same logits as batched decoding.
Greedy decoding reproduces llama.cpp's continuations (or diverges only where llama.cpp's own top two logits
were within 0.1), and so does ``llmfw run``. Slow tests run the teacher forcing on the torch backend too.

Contexts use ``n_threads=1`` (BLAS threads spinning on a shared CPU make small matmuls much slower).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llmfw
from llmfw.core.errors import ModelError
from llmfw.core.memory import ISWA_BASE_CACHE, ISWA_SWA_CACHE
from support.scores import BAR, CONFIDENT_GAP, combine_scores

ROOT = Path(__file__).resolve().parents[2]
UBATCH_TOL = 1e-3
N_BATCH = 512
N_CTX = 2048
UBATCH_SIZES = (512, 64)
#: cells of the local (sliding-window) cache per n_ubatch: pad256(min(n_ctx, 512 + n_ubatch))
SWA_CELLS = {512: 1024, 64: 768}
LONG = 4  # the 1,196-token prompt
TAIL = 17  # logits rows kept from teacher forcing: the last prompt token's and the 16 continuation tokens


@pytest.fixture(scope="module")
def model(shared_models):
    return shared_models.get("gemma3", "numpy")


def teacher_forced(model, record, score, ubatch_sizes=UBATCH_SIZES) -> dict:
    """Decode ``record["sequence"]`` with each n_ubatch side by side: scores, the max logit difference between
    them, what the caches looked like at the end, the last TAIL logits rows and the last size's context (its
    cache holds the whole sequence)."""
    sequence, positions = record["sequence"], record["positions"]
    contexts = {u: model.new_context(n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=u, n_threads=1) for u in ubatch_sizes}
    parts: dict[int, list] = {u: [] for u in ubatch_sizes}
    max_diff = 0.0
    tail = None
    for start in range(0, len(sequence), N_BATCH):
        chunk = sequence[start:start + N_BATCH]
        sub = {"positions": positions[start:start + len(chunk)]}
        logits = {}
        for u, ctx in contexts.items():
            assert ctx.decode(llmfw.Batch(chunk, logits=True)) == 0, ctx.last_error
            logits[u] = ctx.get_logits()
            parts[u].append((score(sub, logits[u]), sub["positions"]))
        first, *others = logits.values()
        max_diff = max([max_diff] + [float(np.abs(first - other).max()) for other in others])
        tail = logits[ubatch_sizes[-1]][-TAIL:].copy()
        del logits, first, others
    caches = {u: cache_facts(ctx) for u, ctx in contexts.items()}
    for u in ubatch_sizes[:-1]:
        contexts.pop(u).close()
    return {"scores": {u: combine_scores(p) for u, p in parts.items()}, "max_diff": max_diff, "caches": caches,
            "tail_logits": tail, "context": contexts[ubatch_sizes[-1]]}


def cache_facts(ctx) -> dict:
    memory = ctx.memory
    return {
        "cells": {part.name: part.n_cells for part in memory.parts},
        "used": {part.name: part.n_used for part in memory.parts},
        "pos_min": {part.name: part.seq_pos_min(0) for part in memory.parts},
        "storage_cells": {key: value.k.shape[1] for key, value in ctx.kv_storage.items()},
        "nbytes": memory.nbytes,
    }


@pytest.fixture(scope="module")
def forced(model, gemma3_ref, score):
    """index → teacher-forced results, computed once per prompt for every test that asks."""
    runs: dict[int, dict] = {}

    def get(index: int) -> dict:
        if index not in runs:
            runs[index] = teacher_forced(model, gemma3_ref["prompts"][index], score)
            if index != LONG:
                del runs[index]["context"]  # only the long prompt's cache is used again
        return runs[index]

    return get


def test_hyperparameters_follow_llama_cpp(model):
    hp = model.hparams
    assert model.arch.name == "gemma3" and model.arch.rope_type == "neox" and model.arch.memory == "kv_cache_iswa"
    assert (hp.n_layer, hp.n_embd, hp.n_head(0), hp.n_head_kv(0), hp.n_embd_head_k) == (18, 640, 4, 1, 256)
    assert hp.n_swa == 512 and hp.swa_type == "standard"
    assert [il for il in range(18) if not hp.is_swa(il)] == [5, 11, 17]
    assert hp.f_attention_scale == pytest.approx(1 / 16)
    local, global_ = model.arch.rope_params(hp, 0), model.arch.rope_params(hp, 5)
    assert (local.freq_base, global_.freq_base) == (10000.0, 1e6)
    assert local.mode == global_.mode == "neox" and local.n_dims == 256
    assert hp.f_final_logit_softcapping == 0 and hp.f_attn_logit_softcapping == 0
    assert model.has_weight("output.weight")  # tied to token_embd
    # the converter stored Gemma's (1 + w): norm weights are centred near 1, not 0
    attn_norm = model.weight_backend("blk.0.attn_norm.weight").weight("blk.0.attn_norm.weight")
    assert float(np.median(attn_norm)) > 0.5


@pytest.mark.parametrize("override, message", [
    ({"gemma3.attention.key_length": 0}, "n_embd_head_k"),
    ({"gemma3.attention.layer_norm_rms_epsilon": 0.0}, "layer_norm_rms_epsilon must be > 0"),
    ({"gemma3.attention.value_length": 128}, "key_length 256 != value_length 128"),
])
def test_bad_header_values_are_model_errors(gemma3_path, override, message):
    with pytest.raises(ModelError, match=message):
        llmfw.load_model(gemma3_path, vocab_only=True, kv_overrides=override)


@pytest.mark.parametrize("n_ubatch", UBATCH_SIZES)
@pytest.mark.parametrize("index", range(5))
def test_teacher_forced_logits_clear_the_bar(forced, gemma3_ref, index, n_ubatch):
    result = forced(index)["scores"][n_ubatch]
    n = len(gemma3_ref["prompts"][index]["sequence"])
    print(f"\nprompt {index} ({n} tokens) n_ubatch {n_ubatch}: {result}")
    assert result["n"] == n
    for key in ("top1", "top5"):
        assert result[key] >= BAR[key], (index, n_ubatch, result)
    assert result["mean_lp_err"] <= BAR["mean_lp_err"], (index, n_ubatch, result)


@pytest.mark.parametrize("index", range(5))
def test_ubatch_64_matches_ubatch_512(forced, index):
    diff = forced(index)["max_diff"]
    print(f"\nprompt {index}: max |logits(n_ubatch 512) - logits(n_ubatch 64)| = {diff:.2e}")
    assert diff <= UBATCH_TOL


@pytest.mark.parametrize("n_ubatch", UBATCH_SIZES)
def test_local_layers_keep_only_the_window(forced, gemma3_ref, n_ubatch):
    facts = forced(LONG)["caches"][n_ubatch]
    n = len(gemma3_ref["prompts"][LONG]["sequence"])
    swa_cells = SWA_CELLS[n_ubatch]
    print(f"\nn_ubatch {n_ubatch}: cells {facts['cells']}, used {facts['used']}, KV bytes {facts['nbytes']:,}")
    assert facts["cells"] == {ISWA_BASE_CACHE: N_CTX, ISWA_SWA_CACHE: swa_cells}
    # the backend's storage has exactly those rows: 15 local layers bounded by the window, 3 global ones full
    for (cache, il), cells in facts["storage_cells"].items():
        assert cells == (N_CTX if il in (5, 11, 17) else swa_cells), (cache, il)
        assert cache == (ISWA_BASE_CACHE if il in (5, 11, 17) else ISWA_SWA_CACHE)
    assert len(facts["storage_cells"]) == 18
    # past the window the local cache has let go of the oldest positions; the global one holds all
    assert facts["used"][ISWA_BASE_CACHE] == n and facts["pos_min"][ISWA_BASE_CACHE] == 0
    assert facts["used"][ISWA_SWA_CACHE] <= swa_cells < n
    assert facts["pos_min"][ISWA_SWA_CACHE] > 0
    assert facts["nbytes"] == 4 * 512 * (3 * N_CTX + 15 * swa_cells)


def greedy_continuation(model, record, **ctx_kw) -> list[int]:
    prompt = record["prompt_ids"]
    n_new = len(record["sequence"]) - len(prompt)
    ctx = model.new_context(n_threads=1, **ctx_kw)
    assert ctx.decode(llmfw.Batch(prompt)) == 0, ctx.last_error
    generated: list[int] = []
    while len(generated) < n_new:
        token = int(ctx.get_logits_ith(-1).argmax())
        generated.append(token)
        if model.vocab.is_eog(token):
            break
        assert ctx.decode(llmfw.Batch([token])) == 0, ctx.last_error
    ctx.close()
    return generated


def test_greedy_continuation_reproduces_llama_cpp(model, gemma3_ref):
    """The 48 greedy tokens after "def fibonacci(n):" are llama.cpp's (diverging at one of llama.cpp's own
    near-ties would be fine too). The other short prompts part at near-ties: prompt 3 at its 4th token
    (llama.cpp's margin 0.049), prompt 2 at its 9th (0.087), prompt 0 at its 16th (0.114, the one confident
    top1 miss of its teacher forcing); ``llmfw run`` below checks prompt 0's first 12."""
    record = gemma3_ref["prompts"][1]
    prompt = record["prompt_ids"]
    expected = record["sequence"][len(prompt):]
    generated = greedy_continuation(model, record, n_ctx=N_CTX)
    print(f"\n{model.vocab.detokenize(generated)!r}")
    for i, (got, want) in enumerate(zip(generated, expected)):
        if got != want:
            top = record["positions"][len(prompt) + i - 1]["top_logits"]
            margin = top[0] - top[1]
            assert margin < CONFIDENT_GAP, \
                f"diverged at continuation token {i}: {got} != {want} (llama.cpp's margin {margin:.3f})"
            return
    assert generated == expected
    assert model.vocab.detokenize(generated) == record["continuation_text"]


def test_one_token_steps_past_the_window_match_batched_decoding(gemma3_ref, forced):
    """The long prompt's cache (n_ubatch 64, the last size: the local cache full at 768 cells) minus its last 17 positions
    (seq_rm on both caches), then those tokens fed back one at a time, give the logits the batched decode gave:
    one-token steps past the window see the same cells as the batch did."""
    record = gemma3_ref["prompts"][LONG]
    prompt, sequence = record["prompt_ids"], record["sequence"]
    run = forced(LONG)
    ctx = run["context"]
    assert ctx.memory.seq_rm(0, len(prompt) - 1, -1)
    assert [p.seq_pos_max(0) for p in ctx.memory.parts] == [len(prompt) - 2] * 2
    rows = []
    for token in sequence[len(prompt) - 1:]:
        assert ctx.decode(llmfw.Batch([token])) == 0, ctx.last_error
        rows.append(ctx.get_logits_ith(-1))
    assert ctx.memory.swa.n_used == ctx.memory.swa.n_cells == SWA_CELLS[64]
    assert ctx.memory.seq_pos_max(0) == len(sequence) - 1
    diff = float(np.abs(np.stack(rows) - run["tail_logits"]).max())
    print(f"\nmax |one-token steps - batched| = {diff:.2e}")
    assert diff <= UBATCH_TOL


@pytest.mark.slow
def test_llmfw_run_continues_like_llama_cpp(gemma3_path, gemma3_ref, model):
    record = gemma3_ref["prompts"][0]
    n = 12
    expected = model.vocab.detokenize(record["sequence"][len(record["prompt_ids"]):len(record["prompt_ids"]) + n])
    result = subprocess.run(
        [sys.executable, "-m", "llmfw.cli", "run", "-m", str(gemma3_path), "--backend", "numpy", "-n", str(n),
         "--no-progress", record["prompt"]],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=900)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


# -- the torch backend ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_model(gemma3_path):
    pytest.importorskip("torch")
    with llmfw.load_model(gemma3_path, backend="torch") as m:
        yield m


@pytest.mark.slow
@pytest.mark.parametrize("index", range(5))
def test_torch_backend_clears_the_bar(torch_model, gemma3_ref, score, index):
    """The same graph and iSWA cache on the torch backend (its own weight forms and kernels), n_ubatch 512."""
    run = teacher_forced(torch_model, gemma3_ref["prompts"][index], score, ubatch_sizes=(512,))
    result = run["scores"][512]
    print(f"\ntorch prompt {index}: {result}; cells {run['caches'][512]['cells']}")
    for key in ("top1", "top5"):
        assert result[key] >= BAR[key], (index, result)
    assert result["mean_lp_err"] <= BAR["mean_lp_err"], (index, result)
    assert run["caches"][512]["storage_cells"][(ISWA_SWA_CACHE, 0)] == SWA_CELLS[512]
    run["context"].close()
