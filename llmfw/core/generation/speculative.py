"""Speculative decoding drafters: guesses of the next tokens that ``generate`` verifies in one batch.

``generate(..., draft=drafter)`` asks the drafter, after each sampled token, for up to ``n_max`` tokens that
might follow; it decodes the sampled token and the draft as one batch with every row an output, samples
each row in order and keeps the draft while the samples equal it (llama.cpp's
``common_sampler_sample_and_accept_n``). The first differing sample becomes the next token and the cache cells
of the rejected draft are removed with ``memory.seq_rm``. Every emitted token is sampled from the target
model's logits at its own position, exactly one sample per token, so greedy output is the non-speculative
output; only rounding differences between a batched and a one-token decode can matter.

Drafters:

* :class:`NgramDrafter` — llama.cpp's ``ngram-simple`` (``common_ngram_simple_draft``, "prompt lookup"): the
  last ``size_n`` tokens (the history's last ``size_n - 1`` and the sampled one) are searched backwards in the
  history; the tokens that followed the most recent earlier occurrence are the draft (at most ``n_max``, and no
  draft when fewer than ``size_n`` follow). No second model; it pays off on input-grounded text (repeat, edit,
  quote).
* :class:`DraftModelDrafter` — a small model with the same vocabulary drafts ``n_max`` tokens greedily in its
  own context (llama.cpp's ``--model-draft``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import ConfigError
from .generate import Drafter as Drafter  # the contract generate() drafts through, defined where it is used
from .generate import _decode, _prepare_prompt

if TYPE_CHECKING:
    from ..runtime.model import Model

#: llama.cpp's default --draft-max
DEFAULT_DRAFT_MAX = 16
#: the lookup n-gram; llama.cpp's ngram-simple defaults to 12, prompt-lookup decoding usually uses 3 — shorter
#: n-grams find a match sooner in a short prompt and the target model rejects a bad guess at no loss of output
DEFAULT_NGRAM_N = 3


class NgramDrafter:
    """Prompt-lookup drafts: llama.cpp's ``common_ngram_simple_draft`` with ``size_mgram = n_max``."""

    def __init__(self, n_max: int = DEFAULT_DRAFT_MAX, size_n: int = DEFAULT_NGRAM_N):
        if not 1 <= n_max <= 1024 or not 1 <= size_n <= 1024:
            raise ConfigError(f"draft_max and the n-gram size must be in 1..1024, got {n_max} and {size_n}")
        self.n_max = n_max
        self.size_n = size_n

    def draft(self, history: Sequence[int], sampled: int, limit: int | None = None) -> list[int]:
        n, m = self.size_n, self.n_max
        cur_len = len(history)
        if cur_len <= n + m + 1:
            return []
        tokens = np.asarray(history, dtype=np.int64)
        pattern = np.append(tokens[cur_len - n + 1:], sampled)
        match = _last_match(tokens, pattern, cur_len - n - 1)
        if match <= 0:
            return []
        copy = min(m, cur_len - (match + n))
        if copy < n:
            return []
        if limit is not None:
            copy = min(copy, limit)
        return [int(t) for t in tokens[match + n:match + n + copy]]


def _last_match(tokens: np.ndarray, pattern: np.ndarray, start: int) -> int:
    """The largest j in 1..start with tokens[j:j+len(pattern)] == pattern, else 0 (position 0 never matches,
    as in llama.cpp)."""
    n = pattern.size
    if start < 1:
        return 0
    windows = np.lib.stride_tricks.sliding_window_view(tokens[1:start + n], n)
    hits = np.flatnonzero((windows == pattern).all(axis=1))
    return int(hits[-1]) + 1 if hits.size else 0


def check_same_vocab(target: Model, draft: Model) -> None:
    """llama.cpp's rule for a draft model: the same vocabulary (size, special tokens, every token's text)."""
    tv, dv = target.vocab, draft.vocab
    if target.n_vocab != draft.n_vocab:
        raise ConfigError(f"the draft model's vocabulary has {draft.n_vocab} tokens, the target's {target.n_vocab}: "
                          "speculative decoding needs the same vocabulary")
    for name in ("bos_id", "eos_id"):
        if getattr(tv, name, None) != getattr(dv, name, None):
            raise ConfigError(f"the draft model's {name} differs from the target's: not the same vocabulary")
    if tv.model == dv.model and tv.tokens == dv.tokens and tv.token_attrs == dv.token_attrs:
        return  # the same tokenizer, token texts and attributes give the same pieces: skip the per-token walk
    for token in range(target.n_vocab):
        if tv.token_to_piece(token, special=True) != dv.token_to_piece(token, special=True):
            raise ConfigError(f"token {token} differs between the draft and the target model: not the same "
                              "vocabulary")


class DraftModelDrafter:
    """Greedy drafts of ``n_max`` tokens from a second (small) model in its own context."""

    def __init__(self, target: Model, draft_model: Model, n_max: int = DEFAULT_DRAFT_MAX, n_ctx: int = 0):
        if not 1 <= n_max <= 1024:
            raise ConfigError(f"draft_max must be in 1..1024, got {n_max}")
        check_same_vocab(target, draft_model)
        self.n_max = n_max
        self.ctx = draft_model.new_context(n_ctx=n_ctx)

    def draft(self, history: Sequence[int], sampled: int, limit: int | None = None) -> list[int]:
        prefix = [*history, sampled]
        if len(prefix) + self.n_max > self.ctx.n_ctx or limit == 0:
            return []
        n_keep, rest = _prepare_prompt(self.ctx, prefix, self.ctx.n_ctx)
        record = self.ctx.seq_tokens[0]
        _decode(self.ctx, rest, n_keep, self.ctx.n_batch)
        wanted = self.n_max if limit is None else min(self.n_max, limit)
        drafted: list[int] = []
        while True:
            token = int(np.argmax(self.ctx.get_logits_ith(-1)))
            drafted.append(token)
            if len(drafted) >= wanted:
                return drafted
            _decode(self.ctx, [token], len(record), 1)
