"""`llmfw run` end to end: greedy by default (llama.cpp's reference continuation), flags, config, errors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import llmfw_in_process

ROOT = Path(__file__).resolve().parents[2]


def llmfw(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmfw.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--top-p", "1.5"], "sampling.top_p"),
    (["--top-k", "-1"], "sampling.top_k: must be >= 0"),
    (["--sampler-seq", "kq"], "unknown letter 'q'"),
    (["--sampler-seq", "top_k,nope"], "unknown sampler 'nope'"),
    (["--mirostat", "3"], "sampling.mirostat"),
    (["--config", "/nonexistent.yaml"], "cannot read"),
])
@pytest.mark.fast
def test_bad_flags_are_one_line_errors(args, message):
    result = llmfw_in_process("run", "hi", "--no-progress", *args)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.fast
def test_help_documents_greedy_default_and_flags():
    result = llmfw_in_process("run", "--help")
    assert result.returncode == 0
    for flag in ("--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--seed", "--sampler-seq",
                 "--chat", "--config", "-n"):
        assert flag in result.stdout
    assert "Greedy unless a sampling flag is given" in result.stdout


@pytest.mark.slow
def test_greedy_run_prints_llama_cpp_continuation(smollm2_path, smollm2_ref, confident_prefix):
    """With no sampling flag, `llmfw run` is greedy: its text is llama.cpp's up to llama.cpp's first close call."""
    import llmfw as lf

    ref = smollm2_ref["prompts"][0]
    n = confident_prefix(ref)
    assert n >= 5
    vocab = lf.load_model(smollm2_path, vocab_only=True).vocab
    expected = vocab.detokenize(ref["sequence"][len(ref["prompt_ids"]):len(ref["prompt_ids"]) + n])
    result = llmfw("run", "-m", str(smollm2_path), ref["prompt"], "-n", str(n), "--no-progress")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"  # the prompt is not echoed
    assert f"prompt: {len(ref['prompt_ids'])} tokens" in result.stderr
    assert f"generation: {n} tokens" in result.stderr and "tok/s" in result.stderr


@pytest.mark.slow
def test_config_with_chat_and_flags_override(smollm2_path):
    result = llmfw("run", "--config", "examples/smollm2-chat.yaml", "-m", str(smollm2_path), "-n", "2",
                   "--seed", "3", "--no-progress", "-v", "Say hi.")
    assert result.returncode == 0, result.stderr
    assert "sampler chain: penalties -> dry -> top_n_sigma -> top_k" in result.stderr
    assert "generation: 2 tokens" in result.stderr or "stop: eog" in result.stderr
