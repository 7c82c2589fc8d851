"""DRY ("don't repeat yourself"): penalize tokens that would extend a repetition of earlier text.

A port of llama.cpp's llama_sampler_dry (itself from koboldcpp): sequence breakers (strings such as "\\n" or
":") cut repetitions; a token that would extend a repeat of length ``L >= allowed_length`` loses
``multiplier * base ** (L - allowed_length)`` from its logit.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from llmfw.sdk import Candidates, RingHistory, Sampler, SamplerEnv, SamplerError, SamplerParams, ids_lookup

MAX_BREAKER_CHARS = 40
MAX_BREAKER_TAIL_TOKENS = 20
FLOAT_MAX_LOG = 88.7228391

#: head token -> list of tail token sequences
Breakers = dict[int, list[list[int]]]


def _add_breaker(breakers: Breakers, head: int, tail: list[int]) -> None:
    tails = breakers.setdefault(head, [])
    if tail not in tails:
        tails.append(tail)


def _token_pieces(vocab: Any) -> list[bytes]:
    n: Any = getattr(vocab, "n_vocab", None) or getattr(vocab, "n_tokens", None)
    n = n() if callable(n) else n
    return [vocab.token_to_piece(t, special=True) for t in range(int(n))]


def breakers_from_strings(vocab: Any, strings: Iterable[str]) -> Breakers:
    """llama.cpp's get_overlapping_token_sequences for every breaker string.

    A token whose text contains the breaker is a one-token breaker; a token whose text *ends* with a prefix
    of the breaker becomes a head whose tail is the tokenization of the rest of the breaker.
    """
    breakers: Breakers = {}
    pieces: list[bytes] | None = None
    for text in strings:
        if not text:
            continue
        needle = text.encode("utf-8")[:MAX_BREAKER_CHARS]
        pieces = pieces if pieces is not None else _token_pieces(vocab)
        first = needle[:1]
        for token, word in enumerate(pieces):
            if needle in word:
                _add_breaker(breakers, token, [])
                continue
            pos = word.find(first)
            while pos != -1:
                matched = min(len(needle), len(word) - pos)
                if word[pos:pos + matched] == needle[:matched]:
                    rest = needle[matched:].decode("utf-8", errors="replace")
                    tail = list(vocab.tokenize(rest, add_special=False, parse_special=False))
                    _add_breaker(breakers, token, tail[:MAX_BREAKER_TAIL_TOKENS])
                pos = word.find(first, pos + 1)
    return breakers


class DRY(Sampler):
    name = "dry"

    def __init__(self, multiplier: float = 0.0, base: float = 1.75, allowed_length: int = 2,
                 penalty_last_n: int = -1, context_size: int = 4096,
                 breakers: Breakers | Sequence[Sequence[int]] | None = None):
        """``breakers``: a head -> tails mapping, or token sequences (as llama.cpp's test constructor);
        :meth:`from_params` derives them from strings through the vocabulary."""
        self.multiplier, self.base = float(multiplier), float(base)
        self.allowed_length, self.penalty_last_n = int(allowed_length), int(penalty_last_n)
        self.context_size = int(context_size)
        if isinstance(breakers, dict):
            self.breakers: Breakers = {int(h): [list(t) for t in tails] for h, tails in breakers.items()}
        else:
            self.breakers = {}
            for seq in breakers or ():
                if len(seq):
                    _add_breaker(self.breakers, int(seq[0]), [int(t) for t in seq[1:]])
        capacity = self.context_size if self.penalty_last_n == -1 else max(self.penalty_last_n, 0)
        self.history = RingHistory(capacity if self.enabled else 0)

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        enabled = params.dry_multiplier != 0.0 and params.dry_base >= 1.0 and params.dry_penalty_last_n != 0
        context_size = env.n_ctx_train or env.n_ctx or 4096
        breakers: Breakers = {}
        if enabled and params.dry_sequence_breakers:
            if env.vocab is None:
                raise SamplerError("dry: sequence breakers need the model's vocabulary; build the chain "
                                   "with a model")
            breakers = breakers_from_strings(env.vocab, params.dry_sequence_breakers)
        defaults = {"multiplier": params.dry_multiplier, "base": params.dry_base,
                    "allowed_length": params.dry_allowed_length, "penalty_last_n": params.dry_penalty_last_n,
                    "context_size": context_size, "breakers": breakers}
        return cls(**{**defaults, **options})

    @property
    def enabled(self) -> bool:
        return self.multiplier != 0.0 and self.base >= 1.0 and self.penalty_last_n != 0

    def accept(self, token: int) -> None:
        if self.enabled:
            self.history.push(token)

    def reset(self) -> None:
        self.history.clear()

    # -- the algorithm (steps as in llama.cpp) ---------------------------------------------------------
    def _repeat_limit(self, last: list[int], n: int) -> int:
        """Step 1: the nearest sequence breaker from the end limits how far back a repeat may reach."""
        for i in range(n):
            tails = self.breakers.get(last[-1 - i])
            if tails is None:
                continue
            longest = -1
            for tail in tails:
                seq_len = len(tail)
                if longest < seq_len <= i and all(tail[o] == last[-1 - (i - o - 1)] for o in range(seq_len)):
                    longest = seq_len
            if longest >= 0:
                return i - longest
        return n

    @staticmethod
    def _repeat_counts(last: list[int], n: int, rep_limit: int) -> list[int]:
        """Step 2: reverse Z-algorithm; counts[n-1-k] = length of the common suffix of the context and the
        context shifted back by k (capped at rep_limit)."""
        def rat(i: int) -> int:
            return last[-1 - i]

        counts = [0] * n
        end = n - 1
        lt = rt = 0
        for k in range(1, n):
            if k > rt:
                m = 0
                while m + k < n and rat(m) == rat(m + k):
                    m += 1
                counts[end - k] = min(m, rep_limit)
                if m > 0:
                    lt, rt = k, k + m - 1
            else:
                p = k - lt
                right_part_len = rt - k + 1
                if counts[end - p] < right_part_len:
                    counts[end - k] = min(counts[end - p], rep_limit)
                else:
                    i = rt + 1
                    while i < n and rat(i) == rat(i - k):
                        i += 1
                    counts[end - k] = min(i - k, rep_limit)
                    lt, rt = k, i - 1
        return counts

    def max_repeats(self) -> dict[int, int]:
        """token -> the longest repeat that emitting it next would extend (only repeats >= allowed)."""
        last = list(self.history.tokens)
        effective_last_n = self.context_size if self.penalty_last_n == -1 else max(self.penalty_last_n, 0)
        n = min(len(last), effective_last_n, self.context_size)
        if n <= self.allowed_length:
            return {}
        rep_limit = self._repeat_limit(last, n)
        if rep_limit < self.allowed_length:
            return {}
        counts = self._repeat_counts(last, n, rep_limit)
        result: dict[int, int] = {}
        for i in range(n - 1):  # step 3
            repeat_len = counts[i]
            if repeat_len >= self.allowed_length:
                token = last[-1 - (n - 2 - i)]
                if result.get(token, -1) < repeat_len:
                    result[token] = repeat_len
        return result

    def apply(self, cur: Candidates) -> None:
        if not self.enabled:
            return
        repeats = self.max_repeats()
        if not repeats:
            return
        max_exponent = int(FLOAT_MAX_LOG / math.log(self.base)) if self.base > 1.000001 else 0
        penalties: dict[int, float] = {}
        for token, length in repeats.items():  # step 4; single-token breakers are never penalized
            if [] in self.breakers.get(token, []):
                continue
            exponent = length - self.allowed_length
            if max_exponent > 0 and exponent > max_exponent:
                exponent = max_exponent
            penalties[token] = self.multiplier * self.base ** exponent
        positions, values = ids_lookup(cur.ids, penalties)
        if positions.size:
            logits = cur.logits.copy()
            logits[positions] = (logits[positions] - values).astype(logits.dtype)
            cur.logits = logits
        cur.sorted = False
