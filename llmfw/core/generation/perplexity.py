"""Perplexity exactly as ``llama-perplexity`` computes it (``tools/perplexity/perplexity.cpp``, ``perplexity()``).

The whole text is tokenized once (``add_special=True`` — the BOS when the vocabulary adds one —, special
token text *not* parsed), cut into ``len(tokens) // n_ctx`` chunks of ``n_ctx`` tokens (a tail shorter than a
chunk is dropped). Each chunk is decoded on an empty cache in batches of ``n_batch``; when the vocabulary adds
a BOS, the chunk's first token is replaced by the BOS (llama.cpp does so for every chunk, not only the first).
Only the second half is scored: logits at positions ``first = n_ctx // 2 .. n_ctx - 2`` predict the next
token, so ``n_ctx - 1 - first`` tokens per chunk. After each chunk the running estimate ``exp(mean NLL)`` is
reported; the final line is ``Final estimate: PPL = X +/- Y`` with ``Y = PPL * sqrt(var(NLL) / (count - 1))``
(llama.cpp's standard error of the mean NLL, propagated to PPL).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..runtime.batch import Batch
from ..errors import ContextError, LLMFWError

if TYPE_CHECKING:
    from ..runtime.context import Context, ContextModel
    from ..runtime.model import Model

#: called after every chunk with (chunks done, chunks in all, running PPL)
ChunkCallback = Callable[[int, int, float], None]


@dataclass
class PerplexityResult:
    """The outcome of :func:`perplexity_of_tokens`: the final estimate and the running one after each chunk."""

    ppl: float
    stderr: float
    n_chunks: int
    n_ctx: int
    n_scored: int                                 # tokens whose NLL was summed
    running: list[float] = field(default_factory=list)

    def final_line(self) -> str:
        """llama-perplexity's last line, formatted as it prints it."""
        return f"Final estimate: PPL = {self.ppl:.4f} +/- {self.stderr:.5f}"


@dataclass
class _NllSums:
    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, nll: np.ndarray) -> None:
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())
        self.count += int(nll.size)

    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    def stderr(self) -> float:
        mean, mean2 = self.nll / self.count, self.nll2 / self.count
        var = mean2 - mean * mean
        if var <= 0 or self.count < 2:
            raise LLMFWError("unexpected non-positive variance of log(prob); the text is too short or degenerate")
        return math.sqrt(var / (self.count - 1)) * math.exp(mean)


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64 (llama.cpp's ``log_softmax`` sums exp in double)."""
    rows = logits.astype(np.float64)
    peak = rows.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(rows - peak).sum(axis=1)) + peak[:, 0]
    return np.asarray(log_sum - rows[np.arange(rows.shape[0]), targets])


def perplexity_tokens(model: Model, text: str) -> list[int]:
    """The text tokenized as llama-perplexity does: with the vocabulary's BOS, special tokens not parsed."""
    return list(model.vocab.tokenize(text, add_special=True, parse_special=False))


def perplexity_of_tokens(ctx: Context, tokens: list[int], n_ctx: int, n_batch: int | None = None,
                         n_chunks: int | None = None, on_chunk: ChunkCallback | None = None) -> PerplexityResult:
    """Perplexity of ``tokens`` on ``ctx`` (which must hold at least ``n_ctx`` cells; its cache is cleared)."""
    n_ctx, n_batch = _check_sizes(ctx, tokens, n_ctx, n_batch)
    n_chunk = len(tokens) // n_ctx if n_chunks is None or n_chunks < 0 else min(n_chunks, len(tokens) // n_ctx)
    if n_chunk < 1:
        raise ContextError("--chunks must be positive")
    bos = _bos_to_insert(ctx.model)
    first = n_ctx // 2
    sums, running = _NllSums(), []
    for i in range(n_chunk):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        logits = _chunk_logits(ctx, chunk, first, n_batch)
        sums.add(token_nll(logits[:-1], np.asarray(chunk[first + 1:], dtype=np.int64)))
        running.append(sums.ppl())
        if on_chunk is not None:
            on_chunk(i + 1, n_chunk, running[-1])
    return PerplexityResult(sums.ppl(), sums.stderr(), n_chunk, n_ctx, sums.count, running)


def _check_sizes(ctx: Context, tokens: list[int], n_ctx: int, n_batch: int | None) -> tuple[int, int]:
    if n_ctx < 4:
        raise ContextError(f"n_ctx must be at least 4 for a perplexity, got {n_ctx}")
    if n_ctx > ctx.n_ctx:
        raise ContextError(f"n_ctx {n_ctx} is larger than the context's {ctx.n_ctx} cells")
    if len(tokens) < 2 * n_ctx:
        raise ContextError(f"you need at least 2*n_ctx = {2 * n_ctx} tokens to calculate a perplexity; the "
                           f"text has {len(tokens)} (llama-perplexity's rule)")
    batch = min(n_batch or ctx.n_batch, n_ctx, ctx.n_batch)
    if batch < 1:
        raise ContextError(f"n_batch must be positive, got {batch}")
    return n_ctx, batch


def _bos_to_insert(model: ContextModel) -> int | None:
    vocab = model.vocab
    return int(vocab.bos_id) if getattr(vocab, "add_bos", False) and vocab.bos_id is not None else None


def _chunk_logits(ctx: Context, chunk: list[int], first: int, n_batch: int) -> np.ndarray:
    """Decode one chunk on an empty cache; logits of positions ``first..`` (llama.cpp outputs only those)."""
    ctx.memory.clear()
    rows: list[np.ndarray] = []
    for begin in range(0, len(chunk), n_batch):
        part = chunk[begin:begin + n_batch]
        pos = np.arange(begin, begin + len(part), dtype=np.int32)
        want = pos >= first
        if not want.any():
            want[-1] = True  # a decode needs an output; this row is dropped below
        code = ctx.decode(Batch(part, pos=pos, seq_id=0, logits=want.tolist()))
        if code != 0:
            raise ContextError(f"decode failed with code {code}: {ctx.last_error}")
        logits = ctx.get_logits()
        rows.append(logits[pos[want] >= first])
    return np.concatenate(rows, axis=0)


def perplexity(model: Model, text: str, n_ctx: int = 512, n_batch: int | None = None, n_chunks: int | None = None,
               on_chunk: ChunkCallback | None = None) -> tuple[float, float]:
    """``llmfw.perplexity(model, text, n_ctx=512) -> (ppl, stderr)``: llama-perplexity's estimate of ``text``."""
    tokens = perplexity_tokens(model, text)
    with model.new_context(n_ctx=n_ctx, n_batch=max(n_batch or n_ctx, 1), n_ubatch=max(n_batch or n_ctx, 1)) as ctx:
        result = perplexity_of_tokens(ctx, tokens, n_ctx, n_batch, n_chunks, on_chunk)
    return result.ppl, result.stderr
