"""The bar a backend's scores against llama.cpp's reference logits must clear (``compare.py``'s scores, combined
across slices of one long prompt where one is cut), and the teacher-forced logits they are computed from."""
from __future__ import annotations

import numpy as np

import llmfw

#: compare.py's: llama.cpp's top-1 must beat its top-2 by this much to count for top1
CONFIDENT_GAP = 0.1


def combine_scores(parts: list[tuple[dict, list[dict]]]) -> dict:
    """One score from per-slice scores: each slice's shares weighted by what compare.py divides by."""
    n = sum(r["n"] for r, _ in parts)
    n_ids = [sum(len(p["top_ids"]) for p in positions) for _, positions in parts]
    confident = [sum(p["top_logits"][0] - p["top_logits"][1] >= CONFIDENT_GAP for p in positions)
                 for _, positions in parts]
    return {
        "n": n,
        "top1": sum(r["top1"] * c for (r, _), c in zip(parts, confident)) / max(sum(confident), 1),
        "top5": sum(r["top5"] * r["n"] for r, _ in parts) / n,
        "max_lp_err": max(r["max_lp_err"] for r, _ in parts),
        "mean_lp_err": sum(r["mean_lp_err"] * k for (r, _), k in zip(parts, n_ids)) / sum(n_ids),
    }


#: the correctness bar on the real models (tests/data/reference/README.md)
BAR = {"top1": 0.93, "top5": 0.98, "mean_lp_err": 0.25}


def assert_within_bar(scores: dict, label: str) -> None:
    assert scores["top1"] >= BAR["top1"], (label, scores)
    assert scores["top5"] >= BAR["top5"], (label, scores)
    assert scores["mean_lp_err"] <= BAR["mean_lp_err"], (label, scores)


def teacher_forced_logits(model, sequence: list[int], n_ubatch: int = 512) -> np.ndarray:
    """Logits of every position when the whole sequence is decoded as one batch (split into ubatches)."""
    ctx = model.new_context(n_ctx=max(512, len(sequence) + 16), n_batch=max(512, len(sequence)), n_ubatch=n_ubatch)
    assert ctx.decode(llmfw.Batch(tokens=sequence, logits=True)) == 0, ctx.last_error
    logits = ctx.get_logits()
    ctx.close()
    return logits
