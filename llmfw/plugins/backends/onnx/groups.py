"""Which KV cells each row of a batch attends: the op-by-op attention's ``cells`` input.

The core's mask is ``[T, n_kv]`` over the unified cache: with several sequences decoding together (the server's
case) their cells interleave, so every token would score, mask and copy all ``n_kv`` cells although it sees only
its own sequence's. The attention instead gathers, per row group, the cells it lists (``cells [S, L]``; the
groups are ``S`` consecutive blocks of ``T / S`` rows) and masks them with ``[T, L]``:

- one group (``S = 1``) listing cells ``0 .. L-1`` (in a few big blocks) under the core's own mask cut to its
  first L columns: a plain prefix, the form of every batch of one sequence (prompt chunks, speculative verify
  batches: their rows get the bits of one-token decodes, see tests/reference/test_onnx_fused.py). L is the last cell any
  row sees, padded to :data:`CELL_PAD`, not the core's ``n_kv`` (padded to 256 like llama.cpp's): a one-token
  decode early in a context copies and scores the cells it sees, not a whole 256-cell block;
- one group per row (``S = T``) listing the cells that row sees (blocks of one cell; padded to :data:`CELL_PAD`
  with cell 0, masked off): a batch of a few rows of which none sees every cell another one sees — tokens of
  different sequences.
"""
from __future__ import annotations

import math

import numpy as np

from llmfw.core.runtime.memory import pad_to

F32 = np.float32
#: a per-row cell list's length is a multiple of this (fewer distinct shapes: bindings are kept per shape)
CELL_PAD = 32
#: per-row cell lists for batches of at most this many rows (a prompt chunk runs as one group)
MAX_ROW_GROUPS = 64


def attention_cells(mask: np.ndarray, n_cells: int) -> tuple[np.ndarray, np.ndarray]:
    """(the mask the graph reads ``[T, L]``, the cells ``[S, L/B]`` int64, blocks of B cells) for the core's mask
    ``[T, n_kv]`` over a cache of ``n_cells`` cells."""
    n_rows, n_kv = mask.shape
    visible = mask != -np.inf
    if 1 < n_rows <= MAX_ROW_GROUPS:
        counts = visible.sum(axis=1)
        width = min(n_kv, pad_to(int(counts.max()), CELL_PAD))
        # only when fewer cells are gathered than one plain prefix copies
        if n_rows * width <= n_kv and not _rows_share_a_sequence(visible, counts):
            return _per_row(mask, visible, counts, width)
    return _prefix(mask, visible, n_cells)


def _prefix(mask: np.ndarray, visible: np.ndarray, n_cells: int) -> tuple[np.ndarray, np.ndarray]:
    """One group over cells ``0 .. L-1``, L the last cell a row sees padded to :data:`CELL_PAD` (at most
    ``n_kv``): the columns past it are masked for every row, and a row's bits do not depend on how many masked
    cells follow the ones it sees (tests/reference/test_onnx_groups.py), so they are neither copied nor scored."""
    n_kv = mask.shape[1]
    seen = np.flatnonzero(visible.any(axis=0))
    width = min(n_kv, max(CELL_PAD, pad_to(int(seen[-1]) + 1 if seen.size else 0, CELL_PAD)))
    if width < n_kv:
        mask = np.ascontiguousarray(mask[:, :width])
    return mask, prefix_blocks(width, n_cells)


def prefix_blocks(n_kv: int, n_cells: int) -> np.ndarray:
    """Cells 0 .. n_kv-1 as ``[1, n_kv/B]`` blocks of B cells, B the largest that divides both ``n_kv`` and the
    cache (usually ``n_kv`` itself or 256: as cheap to gather as a Slice)."""
    block = math.gcd(n_kv, n_cells) or 1
    return np.arange(n_kv // block, dtype=np.int64)[np.newaxis]


def _rows_share_a_sequence(visible: np.ndarray, counts: np.ndarray) -> bool:
    """Whether a row sees every cell another row sees (a causal run of one sequence, a non-causal batch; ``counts``
    the cells each row sees): such rows keep the one-group form, so their bits do not depend on the batch they
    came in."""
    shared = visible.astype(F32) @ visible.T.astype(F32)  # [T, T] cells both rows see (exact: counts < 2**24)
    smaller = np.minimum(counts[:, None], counts[None, :])
    np.fill_diagonal(shared, -1.0)
    return bool((shared == smaller).any())


def _per_row(mask: np.ndarray, visible: np.ndarray, counts: np.ndarray,
             width: int) -> tuple[np.ndarray, np.ndarray]:
    """One group per row: its visible cells in cache order, then cell 0 masked off up to ``width``."""
    n_rows = mask.shape[0]
    rows, cols = np.nonzero(visible)                   # row-major: each row's cells ascending
    slots = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
    cells = np.zeros((n_rows, width), dtype=np.int64)
    compact = np.full((n_rows, width), -np.inf, dtype=F32)
    cells[rows, slots] = cols
    compact[rows, slots] = mask[rows, cols]
    return compact, cells
