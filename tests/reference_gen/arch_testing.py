"""Test helpers for the random-weight architecture models: rebuild a model file, check it is the one llama.cpp
measured, and run llmfw's decode the ways the tests compare (whole sequence, small ubatches, two sequences).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling modules double as scripts
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from arch_files import DATA_DIR, build_model_file, sha256_of
from arch_specs import SPECS, prompt_text, reference_name

import llmfw

#: issue 6's bar for random-weight models (their logits are flatter than a trained model's)
BAR = {"top1": 0.90, "top5": 0.98, "mean_lp_err": 0.20}
#: the same tokens decoded in different batch shapes may differ only by float rounding
SAME_LOGITS_ATOL = 1e-3


def reference(name: str) -> dict:
    """llama.cpp's numbers for model ``name`` (``tests/data/arch/<name>.json``)."""
    return json.loads((DATA_DIR / reference_name(name)).read_text(encoding="utf-8"))


def model_file(name: str, directory: Path) -> Path:
    """Build model ``name`` in ``directory`` and check it is byte for byte the file llama.cpp measured."""
    path = build_model_file(name, directory)
    expected = reference(name)["sha256"]
    found = sha256_of(path)
    if found != expected:
        raise AssertionError(
            f"{path.name}: sha256 {found} differs from the measured file's {expected}. The builder, the vocab "
            "files or the quantizer changed: regenerate the references (tests/reference_gen/README.md)")
    return path


def records(ref: dict, n_ctx: int | None = None) -> list[dict]:
    return [r for r in ref["prompts"] if n_ctx is None or r["n_ctx"] == n_ctx]


def longest(ref: dict) -> dict:
    return max(ref["prompts"], key=lambda r: len(r["sequence"]))


def decode_all(model, sequence: list[int], *, n_ctx: int, n_ubatch: int = 512, n_batch: int = 2048) -> np.ndarray:
    """Teacher-forced logits [len(sequence), n_vocab]: the whole sequence in one decode call."""
    ctx = model.new_context(n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=max(n_batch, len(sequence)))
    rc = ctx.decode(llmfw.Batch(sequence, logits=True))
    assert rc == 0, f"decode returned {rc}: {ctx.last_error}"
    return ctx.get_logits().copy()


def decode_two_sequences(model, seq_a: list[int], seq_b: list[int], *, n_ctx: int,
                         n_ubatch: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Both sequences in one batch (seq ids 0 and 1, interleaved token by token); each one's logits rows."""
    order = sorted([(i, 0) for i in range(len(seq_a))] + [(i, 1) for i in range(len(seq_b))])
    tokens = [(seq_a, seq_b)[s][i] for i, s in order]
    ctx = model.new_context(n_ctx=2 * n_ctx, n_seq_max=2, n_ubatch=n_ubatch, n_batch=len(tokens))
    rc = ctx.decode(llmfw.Batch(tokens, pos=[i for i, _ in order], seq_id=[s for _, s in order], logits=True))
    assert rc == 0, f"decode returned {rc}: {ctx.last_error}"
    logits = ctx.get_logits()
    rows = np.array([s for _, s in order])
    return logits[rows == 0].copy(), logits[rows == 1].copy()


def fork_errors(model, name: str) -> tuple[float, float]:
    """A prompt (40 tokens of the model's second reference sequence) decoded in sequence 0, copied to sequence 1
    with ``seq_cp``, then two different 6-token continuations decoded together in one batch: the max |logits|
    difference of each continuation from decoding its whole sequence alone."""
    sequences = [r["sequence"] for r in records(reference(name))]
    prompt, tail_a, tail_b = sequences[1][:40], sequences[1][40:46], sequences[2][40:46]
    ctx = model.new_context(n_ctx=1024, n_seq_max=2)
    assert ctx.decode(llmfw.Batch(prompt, seq_id=0)) == 0
    ctx.memory.seq_cp(0, 1, -1, -1)
    assert ctx.memory.seq_pos_max(1) == len(prompt) - 1 and ctx.seq_tokens[1] == prompt
    tokens = [t for pair in zip(tail_a, tail_b) for t in pair]
    assert ctx.decode(llmfw.Batch(tokens, seq_id=[0, 1] * len(tail_a), logits=True)) == 0, ctx.last_error
    forked = ctx.get_logits()
    alone_a = decode_all(model, prompt + tail_a, n_ctx=512)[len(prompt):]
    alone_b = decode_all(model, prompt + tail_b, n_ctx=512)[len(prompt):]
    return float(np.abs(forked[0::2] - alone_a).max()), float(np.abs(forked[1::2] - alone_b).max())


def shift_error(model, prompt: list[int], follower: int, delta: int) -> float:
    """max |logits| difference, for ``follower``, between decoding ``prompt`` then shifting it by ``delta``
    positions (``seq_add``: the K-shift re-ropes the cached keys) and decoding it at those positions directly."""
    shifted = model.new_context(n_ctx=512)
    assert shifted.decode(llmfw.Batch(prompt)) == 0
    shifted.memory.seq_add(0, 0, -1, delta)
    assert shifted.decode(llmfw.Batch([follower])) == 0
    direct = model.new_context(n_ctx=512)
    assert direct.decode(llmfw.Batch(prompt, pos=list(range(delta, delta + len(prompt))))) == 0
    assert direct.decode(llmfw.Batch([follower])) == 0
    return float(np.abs(shifted.get_logits_ith(-1) - direct.get_logits_ith(-1)).max())


def assert_clears_bar(score, record: dict, logits: np.ndarray, what: str) -> dict:
    result = score(record, logits)
    failed = [k for k, limit in BAR.items() if (result[k] > limit if k == "mean_lp_err" else result[k] < limit)]
    assert not failed, f"{what}, prompt {record['name']!r} (n_ctx {record['n_ctx']}): {result} misses {BAR}"
    return result


def check_tokenization(model, record: dict) -> None:
    ids = model.vocab.tokenize(prompt_text(record["name"]), add_special=True, parse_special=True)
    assert ids == record["prompt_ids"], f"prompt {record['name']!r}: llmfw {ids} != llama.cpp {record['prompt_ids']}"


__all__ = ["BAR", "SAME_LOGITS_ATOL", "SPECS", "assert_clears_bar", "check_tokenization", "decode_all",
           "decode_two_sequences", "fork_errors", "longest", "model_file", "records", "reference", "shift_error"]
