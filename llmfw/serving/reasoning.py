"""Thinking apart from the answer: the split of a reply into reasoning and content, and the thinking budget.

Reasoning models write their thinking between tags before the answer — ``<think>…</think>`` (DeepSeek-R1 and its
distills, Qwen3, QwQ, Granite), ``<|START_THINKING|>…<|END_THINKING|>`` (Command R7B). llama-server's
``--reasoning-format deepseek`` (the default) returns that text as ``reasoning_content``, ``none`` leaves it in
the content. Some templates open the tag themselves at the end of the prompt (DeepSeek-R1, Qwen3 with thinking
on): the reply then starts *inside* the thinking (:func:`starts_inside_thinking`).

:class:`ReasoningSplitter` does the split as text arrives, holding back what may be the start of a tag, so a
stream's ``delta.reasoning_content`` pieces and ``delta.content`` pieces join up to exactly what the whole reply's
:func:`split_reasoning` gives. :class:`ThinkingBudget` is a sampler that, once the thinking has run for its
budget of tokens, forces the closing tag (llama-server's ``--reasoning-budget``; 0 closes it at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.generation.sampling import Candidates, Sampler


@dataclass(frozen=True)
class ThinkingTags:
    """The pair a family thinks between; ``after``: markers dropped from the start of the answer (in order,
    each when present); ``special``: the tags are control tokens, which the reply's text must show."""

    open: str
    close: str
    after: tuple[str, ...] = ()
    special: bool = False


THINK = ThinkingTags("<think>", "</think>")
COMMAND_R = ThinkingTags("<|START_THINKING|>", "<|END_THINKING|>", special=True)
#: gpt-oss: the analysis channel is the thinking, the final channel the answer
HARMONY = ThinkingTags("<|channel|>analysis<|message|>", "<|end|>",
                       after=("<|start|>assistant", "<|channel|>final<|message|>"), special=True)


def thinking_tags_for(template: str | None) -> ThinkingTags:
    """The tags a chat template's model thinks between (``<think>`` unless the template shows another pair)."""
    if template and COMMAND_R.open in template:
        return COMMAND_R
    if template and "<|channel|>" in template and "analysis" in template:
        return HARMONY
    return THINK


def starts_inside_thinking(prompt: str, tags: ThinkingTags) -> bool:
    """True when the rendered prompt ends with an open thinking tag: the reply begins with thinking."""
    text = prompt.rstrip()
    return text.endswith(tags.open)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Splits streamed reply text into ``("reasoning", text)`` and ``("content", text)`` pieces.

    The thinking is the text between the tags — from the start when ``inside`` (the prompt opened the tag), or
    from an open tag at the start of the reply (blanks before it allowed). Text after the closing tag is
    content, blanks right after the tag dropped (llama.cpp trims them). A reply that never opens a tag is all
    content; one cut short inside the thinking is all reasoning."""

    def __init__(self, tags: ThinkingTags, inside: bool = False):
        self.tags = tags
        self._state = "thinking" if inside else "start"
        self._buffer = ""
        #: True once the reply is known to think (the prompt opened the tag, or the reply did)
        self.thinks = inside

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        out: list[tuple[str, str]] = []
        while True:
            state, size = self._state, len(self._buffer)
            piece = getattr(self, f"_step_{self._state}")()
            if piece is not None and piece[1]:
                out.append(piece)
            if (state, size) == (self._state, len(self._buffer)):
                return _joined(out)

    def finish(self) -> list[tuple[str, str]]:
        """The text held back: what it was heading for (an unfinished tag is reported as the text it is)."""
        rest, self._buffer = self._buffer, ""
        if not rest:
            return []
        kind = "reasoning" if self._state == "thinking" else "content"
        if self._state == "after":
            rest = rest.lstrip()
        return [(kind, rest)] if rest else []

    # -- states ----------------------------------------------------------------------------------------------
    def _step_start(self) -> tuple[str, str] | None:
        text = self._buffer.lstrip()
        if text.startswith(self.tags.open):
            self._buffer, self._state = text[len(self.tags.open):], "thinking"
            self.thinks = True
            return None
        if not text or self.tags.open.startswith(text):
            return None  # blanks, or the tag so far: undecided
        self._state = "content"
        return None

    def _step_thinking(self) -> tuple[str, str] | None:
        at = self._buffer.find(self.tags.close)
        if at >= 0:
            thought, self._buffer = self._buffer[:at], self._buffer[at + len(self.tags.close):]
            self._state = "after"
            return ("reasoning", thought)
        keep = _partial_tag(self._buffer, self.tags.close)
        thought = self._buffer[:len(self._buffer) - keep]
        self._buffer = self._buffer[len(thought):]
        return ("reasoning", thought)

    def _step_after(self) -> tuple[str, str] | None:
        text = self._buffer.lstrip()
        for marker in self.tags.after:  # the answer's own markers (Harmony's final channel)
            if marker.startswith(text):
                self._buffer = text
                return None  # the marker may be arriving
            if text.startswith(marker):
                text = text[len(marker):].lstrip()
        self._buffer = text
        if text:
            self._state = "content"
        return None

    def _step_content(self) -> tuple[str, str] | None:
        text, self._buffer = self._buffer, ""
        return ("content", text)


def _joined(pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, text in pieces:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


def split_reasoning(text: str, tags: ThinkingTags, inside: bool = False) -> tuple[str | None, str]:
    """(the reasoning, or None when the reply has none; the content) of a whole reply."""
    splitter = ReasoningSplitter(tags, inside)
    pieces = splitter.feed(text) + splitter.finish()
    reasoning = [t for kind, t in pieces if kind == "reasoning"]
    content = "".join(t for kind, t in pieces if kind == "content")
    if not splitter.thinks:
        return None, content
    return "".join(reasoning).strip(), content


class ThinkingBudget(Sampler):
    """Forces the closing tag once the thinking has used ``budget`` tokens (0: as soon as thinking starts).

    It follows the reply's text (the pieces of the accepted tokens) to know when thinking is open, counts the
    tokens inside, and past the budget leaves only the next token of the closing tag as a candidate. Placed
    after a grammar sampler: when the grammar does not allow that token, the grammar wins (nothing is forced)."""

    name = "thinking_budget"

    def __init__(self, vocab: Any, tags: ThinkingTags, budget: int, inside: bool = False):
        self.vocab = vocab
        self.tags = tags
        self.budget = budget
        self.close_tokens = [int(t) for t in vocab.tokenize(tags.close, add_special=False, parse_special=True)]
        self.inside = inside
        self.used = 0
        self.forcing: list[int] = []
        self._tail = ""  # the last characters of the reply, to spot a tag split over tokens

    def apply(self, cur: Candidates) -> None:
        if not self.forcing and self.inside and self.used >= self.budget:
            self.forcing = list(self.close_tokens)
        if not self.forcing:
            return
        forced = self.forcing[0]
        keep = cur.ids == forced
        if not np.any(keep & np.isfinite(cur.logits)):
            self.forcing = []  # a grammar before this sampler forbids the tag: it decides
            return
        cur.logits = np.where(keep, cur.logits, np.float32(-np.inf)).astype(np.float32)
        cur.sorted = False

    def accept(self, token: int) -> None:
        if self.forcing and token == self.forcing[0]:
            self.forcing.pop(0)
        piece = self.vocab.token_to_piece(int(token), special=True).decode("utf-8", errors="replace")
        self._tail = (self._tail + piece)[-64:]
        if self.inside:
            self.used += 1
            if self._tail.endswith(self.tags.close):
                self.inside, self.forcing = False, []
        elif self._tail.endswith(self.tags.open):
            self.inside, self.used = True, 0

    def accept_prompt(self, token: int) -> None:
        """The prompt only tells whether the reply starts inside thinking (given at construction)."""

    def reset(self) -> None:
        self.used, self.forcing, self._tail = 0, [], ""


@dataclass(frozen=True)
class ReasoningSetup:
    """How one chat request's replies are split and budgeted: the tags, whether the reply starts inside the
    thinking, whether to split at all (``--reasoning-format``) and the budget (-1: none)."""

    tags: ThinkingTags
    inside: bool
    split: bool
    budget: int

    def splitter(self) -> ReasoningSplitter | None:
        return ReasoningSplitter(self.tags, self.inside) if self.split else None

    def budget_sampler(self, vocab: Any) -> list[Sampler]:
        return [ThinkingBudget(vocab, self.tags, self.budget, self.inside)] if self.budget >= 0 else []


def reasoning_setup(template: str, prompt: str, reasoning_format: str, budget: int) -> ReasoningSetup:
    tags = thinking_tags_for(template)
    return ReasoningSetup(tags, starts_inside_thinking(prompt, tags), reasoning_format != "none", budget)
