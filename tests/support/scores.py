"""Scores of llama.cpp's ``compare.py`` combined across slices of one long prompt."""
from __future__ import annotations

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
