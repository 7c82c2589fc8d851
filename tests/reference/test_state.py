"""Saved prompt state: ctx.state_save_file / state_load_file and `llmfw run --prompt-cache`.

Logits after a load must equal logits without one, bit for bit on the numpy backend; a file that does not fit
(another model, another context shape, truncated, corrupt) must raise a ContextError that names the problem
and leave the context exactly as it was.
"""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from llmfw import Batch
from llmfw.core.errors import ContextError, LLMFWError
from llmfw.core.sampling import SamplerChain, SamplerParams

TEXT = "The keepers wrote everything down, and every light was inspected every year. " * 4


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request, shared_models):
    return shared_models.get(request.param, "numpy")


def _decode(ctx, tokens, start=0, seq=0):
    assert ctx.decode(Batch(tokens, pos=list(range(start, start + len(tokens))), seq_id=seq)) == 0
    return ctx.get_logits()[-1].copy()


def _tokens(model):
    return model.vocab.tokenize(TEXT, add_special=True, parse_special=False)


def test_logits_after_a_load_are_bit_exact(model, tmp_path):
    tokens = _tokens(model)
    head, tail = tokens[:-3], tokens[-3:]
    saved = model.new_context(n_ctx=256, n_seq_max=2)
    _decode(saved, head)
    _decode(saved, head[:5], seq=1)                       # a second sequence is saved too
    saved.state_save_file(tmp_path / "s.bin", head)
    expected = _decode(saved, tail, len(head))
    expected_seq1 = _decode(saved, tail, 5, seq=1)

    fresh = model.new_context(n_ctx=256, n_seq_max=2)
    assert fresh.state_load_file(tmp_path / "s.bin") == head
    assert fresh.seq_tokens[0] == head
    assert fresh.memory.seq_pos_max(0) == len(head) - 1 and fresh.memory.seq_pos_max(1) == 4
    assert np.array_equal(_decode(fresh, tail, len(head)), expected)
    assert np.array_equal(_decode(fresh, tail, 5, seq=1), expected_seq1)


def test_sampler_rng_is_restored(model, tmp_path):
    tokens = _tokens(model)[:20]
    ctx = model.new_context(n_ctx=256)
    _decode(ctx, tokens)
    chain = SamplerChain.from_params(SamplerParams(seed=1234), model=model)
    for _ in range(3):
        chain.sample(ctx, -1)
    ctx.state_save_file(tmp_path / "s.bin", tokens, sampler=chain)
    expected = [chain.sample(ctx, -1) for _ in range(8)]
    other = SamplerChain.from_params(SamplerParams(seed=99), model=model)
    model.new_context(n_ctx=256).state_load_file(tmp_path / "s.bin", sampler=other)
    assert [other.sample(ctx, -1) for _ in range(8)] == expected


def _corrupt(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, message", [
    ("truncate", "truncated"), ("flip", "checksum"), ("magic", "magic"), ("version", "version"),
    ("empty", "truncated"), ("header", "header"),
])
def test_bad_files_raise_and_leave_the_context_unchanged(model, tmp_path, damage, message):
    tokens = _tokens(model)
    source = model.new_context(n_ctx=256)
    _decode(source, tokens[:16])
    path = tmp_path / "s.bin"
    source.state_save_file(path, tokens[:16])
    size = path.stat().st_size
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:size - 100])
    elif damage == "flip":
        _corrupt(path, size - 100, b"\xff\x00\xff")
    elif damage == "magic":
        _corrupt(path, 0, b"GGUF")
    elif damage == "version":
        _corrupt(path, 8, b"\x07")
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "header":
        _corrupt(path, 20, b"\x00\x00")

    victim = model.new_context(n_ctx=256)
    _decode(victim, tokens[:12])
    victim.seq_tokens[0] = tokens[:12]
    with pytest.raises(ContextError, match=message):
        victim.state_load_file(path)
    assert victim.seq_tokens[0] == tokens[:12]
    assert victim.memory.seq_pos_max(0) == 11
    reference = model.new_context(n_ctx=256)
    _decode(reference, tokens[:12])
    assert np.array_equal(_decode(victim, tokens[12:14], 12), _decode(reference, tokens[12:14], 12))


def test_other_model_or_context_shape_is_refused(smollm2_path, gemma3_path, tmp_path):
    import llmfw

    smol = llmfw.load_model(smollm2_path, backend="numpy")
    ctx = smol.new_context(n_ctx=256)
    _decode(ctx, [1, 2, 3])
    ctx.state_save_file(tmp_path / "s.bin")
    with pytest.raises(ContextError, match="context shape"):
        smol.new_context(n_ctx=512).state_load_file(tmp_path / "s.bin")
    with pytest.raises(ContextError, match="another model"):
        llmfw.load_model(gemma3_path, backend="numpy").new_context(n_ctx=256).state_load_file(tmp_path / "s.bin")
    with pytest.raises(ContextError, match="cannot read"):
        ctx.state_load_file(tmp_path / "missing.bin")
    with pytest.raises(LLMFWError):
        ctx.state_save_file(tmp_path / "no" / "such" / "dir.bin")


def _run(model_path, cache, prompt):
    cmd = [sys.executable, "-m", "llmfw.cli", "run", "-m", str(model_path), "--backend", "numpy", "--no-progress",
           "-n", "6", "--prompt-cache", str(cache), prompt]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    line = re.search(r"prompt cache .*: (\d+) tokens loaded, (\d+) reused, (\d+) decoded", result.stderr)
    return result.stdout, tuple(int(g) for g in line.groups())


def test_prompt_cache_decodes_only_what_differs(smollm2_path, tmp_path):
    cache = tmp_path / "prompt.bin"
    prompt = "Lighthouses guide ships. " * 20
    first_out, (loaded, reused, decoded) = _run(smollm2_path, cache, prompt)
    assert loaded == 0 and reused == 0 and decoded > 100
    again_out, (loaded2, reused2, decoded2) = _run(smollm2_path, cache, prompt)
    assert again_out == first_out
    assert loaded2 == decoded and reused2 == decoded - 1 and decoded2 == 1  # only the last token, for its logits
    longer_out, (loaded3, reused3, decoded3) = _run(smollm2_path, cache, prompt + "Fog is their enemy.")
    # the trailing space of the old prompt joins the new word's token, so one old token is decoded again
    assert loaded3 == decoded and decoded - 1 <= reused3 <= decoded and 1 < decoded3 < 10
