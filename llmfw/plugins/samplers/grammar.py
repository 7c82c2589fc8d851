"""The ``grammar`` sampler: constrained decoding through llguidance (see :mod:`llmfw.core.generation.grammar`).

It goes first in the chain, as in llama.cpp, so truncation samplers never leave only forbidden tokens: every
candidate the grammar cannot accept next is dropped (dropping rather than setting ``-inf`` keeps the later
samplers' statistics — mirostat's, top-n-sigma's — over allowed tokens only). End-of-generation tokens survive
only where the grammar may end; :meth:`done` tells :func:`llmfw.generate` that the grammar is complete, so
generation stops there. Prompt tokens do not advance the grammar (llama.cpp's ``accept_grammar = false``): a
new prompt starts the grammar afresh, so a chat answers every turn under the grammar.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from llmfw.sdk import Candidates, GrammarError, Sampler, SamplerEnv, SamplerError, SamplerParams
from llmfw.core.generation.grammar import GrammarMatcher, GrammarSpec


class Grammar(Sampler):
    """Keep only the tokens ``spec`` accepts next; advance on :meth:`accept`."""

    name = "grammar"

    def __init__(self, spec: GrammarSpec, vocab: Any, compiled: str | None = None):
        if vocab is None:
            raise SamplerError("the grammar sampler needs the model's vocabulary (build the chain with model=)")
        self.matcher = GrammarMatcher(spec, vocab, compiled)
        self._ids: np.ndarray | None = None  # 0..n_vocab-1, to recognise candidates still in vocabulary order

    @classmethod
    def from_params(cls, params: SamplerParams, env: SamplerEnv, options: dict[str, Any]) -> Sampler:
        spec = params.grammar_spec()
        if spec is None:
            raise SamplerError("the grammar sampler needs sampling.grammar, sampling.json_schema or sampling.regex")
        return cls(spec, env.vocab, params.compiled_grammar())

    def apply(self, cur: Candidates) -> None:
        allowed = self.matcher.allowed()
        positions = self._allowed_positions(cur, allowed)
        if positions.size == cur.size:
            return
        if positions.size == 0:
            raise GrammarError("no candidate token fits the grammar here (an earlier sampler removed them all, "
                               "or the grammar needs a token this model lacks)")
        cur.take(positions)  # a subset in the same order: ``sorted`` stays true if it was

    def _allowed_positions(self, cur: Candidates, allowed: np.ndarray) -> np.ndarray:
        n = allowed.size
        if cur.size >= n and np.array_equal(cur.ids[:n], self._identity(n)):
            return np.flatnonzero(allowed)  # the usual case, first in the chain: position == token id
        inside = cur.ids < n
        keep = np.zeros(cur.size, dtype=bool)
        keep[inside] = allowed[cur.ids[inside]]
        return np.flatnonzero(keep)

    def _identity(self, n: int) -> np.ndarray:
        if self._ids is None or self._ids.size != n:
            self._ids = np.arange(n, dtype=np.int32)
        return self._ids

    def accept(self, token: int) -> None:
        if not self.matcher.is_stopped:
            self.matcher.consume(token)

    def accept_prompt(self, token: int) -> None:
        if self.matcher.n_consumed:
            self.matcher.reset()

    def reset(self) -> None:
        self.matcher.reset()

    def done(self) -> bool:
        return self.matcher.is_stopped

    def __repr__(self) -> str:
        return f"<Grammar {self.matcher.spec.describe()}>"
