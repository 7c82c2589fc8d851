"""``generate``: the decode loop — prompt → batch → decode → sample → detokenize, streamed as text pieces.

KV-cache reuse: the context owns, per sequence, the list of tokens that are in its KV cache
(``Context.seq_tokens``; :func:`cached_tokens`); ``generate`` uses sequence 0, the serving engine one per slot.
A new call tokenizes the *whole* prompt it is given (for a chat: the whole rendered conversation), keeps the
longest common prefix with that record, removes the divergent tail from the cache (``memory.seq_rm``) and
decodes only the rest. So a multi-turn chat that re-renders the conversation each
turn only pays for the new turn. (llama.cpp's server does the same with ``cache_prompt``.)

Tokenization: a ``str`` prompt is tokenized with ``parse_special=True`` (special-token text such as
``<|im_start|>`` becomes the special token, as ``llama-cli`` does) and ``add_special=True`` (the vocabulary's
own BOS/EOS flags; the BOS, if any, is then the first token of every full prompt and matches the cache). A
``list[int]`` prompt is used as is.

Streaming: token pieces go through an incremental UTF-8 decoder, so a character split across tokens is
emitted whole. Stop strings are never emitted: text that could still become a stop string is held back
until it cannot.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence

from ..errors import ContextError, LLMFWError
from ..runtime.batch import tokenize_prompt as tokenize_prompt  # its home before embedding needed it
from .sampling import Sampler, SamplerChain

if TYPE_CHECKING:
    from ..runtime.context import Context
    from ..tokenizer.vocab import Vocab


@dataclass
class GenerationStats:
    """Filled in by :func:`generate` when passed as ``stats=``: counts, timings and why it stopped."""

    n_prompt: int = 0          # tokens in the prompt
    n_cached: int = 0          # prompt tokens found in the KV cache (not decoded again)
    n_prompt_decoded: int = 0  # prompt tokens decoded by this call
    t_prompt: float = 0.0      # seconds spent decoding them
    n_generated: int = 0       # tokens sampled
    t_generate: float = 0.0    # seconds from the first sample to the end
    stop_reason: str = ""      # "eog" (also: the grammar is complete), "stop", "max_tokens", "context_full"
    #                            ("interrupted": set by the CLI)
    tokens: list[int] = field(default_factory=list)  # the sampled tokens
    n_drafted: int = 0         # speculative decoding: tokens drafted ...
    n_accepted: int = 0        # ... and accepted
    n_verify_batches: int = 0  # ... and the batches that verified them

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt_decoded / self.t_prompt if self.t_prompt > 0 else 0.0

    @property
    def generate_tps(self) -> float:
        return self.n_generated / self.t_generate if self.t_generate > 0 else 0.0

    def summary(self) -> str:
        return (f"prompt: {plural(self.n_prompt_decoded, 'token')} in {self.t_prompt:.2f} s "
                f"({self.prompt_tps:.1f} tok/s, {self.n_cached} cached) | generation: "
                f"{plural(self.n_generated, 'token')} in {self.t_generate:.2f} s ({self.generate_tps:.1f} tok/s) | "
                f"stop: {self.stop_reason}"
                + (f" | draft: {self.n_accepted}/{self.n_drafted} accepted ({100 * self.acceptance_rate:.0f}%)"
                   if self.n_drafted else ""))


def plural(n: int, noun: str) -> str:
    """``1 token``, ``0 tokens``, ``2 tokens``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# -- the record of what is in each context's cache -------------------------------------------------------------
def _record(ctx: Context, seq: int = 0) -> list[int]:
    """The context's own list of the tokens whose KV is cached for ``seq`` (``Context.seq_tokens``)."""
    return ctx.seq_tokens[seq]


def cached_tokens(ctx: Context, seq: int = 0) -> list[int]:
    """The tokens known to be in ``ctx``'s KV cache for sequence ``seq`` (a copy)."""
    return list(_record(ctx, seq))


def forget_cache(ctx: Context, seq: int = 0) -> None:
    """Clear sequence ``seq`` of the cache and so its record (the next call decodes its whole prompt)."""
    ctx.memory.seq_rm(seq, -1, -1)


def synced_record(ctx: Context, seq: int = 0) -> list[int]:
    """The record, trimmed to what the cache really holds (someone may have decoded or removed tokens)."""
    record = _record(ctx, seq)
    n_in_cache = int(ctx.memory.seq_pos_max(seq)) + 1  # -1 when empty
    if n_in_cache < len(record):
        del record[max(n_in_cache, 0):]
    elif n_in_cache > len(record):
        ctx.memory.seq_rm(seq, len(record), -1)
    return record


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reuse_cached_prefix(ctx: Context, tokens: list[int], seq: int = 0) -> int:
    """Keep the longest cached prefix of ``tokens`` in sequence ``seq`` (at least the last prompt token is
    left to decode, for its logits), drop the rest of the sequence; return how many tokens are kept."""
    record = synced_record(ctx, seq)
    common = common_prefix_length(record, tokens)
    if common == len(tokens):
        common -= 1  # the last prompt token must be decoded again to get its logits
    # the memory's sequence operations cut the record too (``Memory.records``)
    if common < len(record) and ctx.memory.seq_rm(seq, common, -1) is False:
        # this memory cannot drop a tail (llama.cpp: recurrent state); start the sequence over
        ctx.memory.seq_rm(seq, -1, -1)
        common = 0
    return common


def accept_prompt_tokens(chain: SamplerChain, tokens: Sequence[int]) -> None:
    """Feed prompt tokens to each sampler of the chain (not the chain's history: that holds sampled tokens
    only), so repetition penalties see the prompt, as llama-cli does; a grammar sampler starts afresh."""
    for t in tokens:
        chain.accept_prompt(t)


# -- helpers ---------------------------------------------------------------------------------------------------
class Drafter(Protocol):
    """Proposes tokens to follow ``history + [sampled]`` (``history``: the tokens in the target's cache)."""

    n_max: int

    def draft(self, history: Sequence[int], sampled: int, limit: int | None = None) -> list[int]: ...


class TextStream:
    """Token bytes → text, holding back incomplete UTF-8 and anything that may start a stop string."""

    def __init__(self, vocab: Vocab, stop: Sequence[str], special: bool = False):
        from ..tokenizer.vocab import StreamingDetokenizer

        self.detokenizer = StreamingDetokenizer(vocab, special)
        self.stop = [s for s in stop if s]
        self.pending = ""
        self.stopped = False
        #: the stop string found (None until one is)
        self.stopped_by: str | None = None

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def feed(self, token: int) -> str:
        text = self.pending + self.detokenizer.feed(token)
        found = [(i, s) for s, i in ((s, text.find(s)) for s in self.stop) if i >= 0]
        if found:
            cut, self.stopped_by = min(found)
            self.stopped, self.pending = True, ""
            return text[:cut]
        keep = self._held_back(text)
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        text, self.pending = self.pending + self.detokenizer.flush(), ""
        return text


def _decode(ctx: Context, tokens: list[int], start_pos: int, n_batch: int, logits: bool | None = None) -> None:
    """Decode ``tokens`` at positions ``start_pos...`` of sequence 0 in chunks of ``n_batch`` (the context's
    record of the sequence grows with each decode); ``logits`` as in :class:`Batch` (None: the last token's)."""
    from ..runtime.batch import Batch

    for begin in range(0, len(tokens), n_batch):
        chunk = tokens[begin:begin + n_batch]
        pos0 = start_pos + begin
        code = ctx.decode(Batch(chunk, pos=list(range(pos0, pos0 + len(chunk))), seq_id=0, logits=logits))
        if code != 0:
            reason = ctx.last_error or ""
            raise ContextError(f"decode failed with code {code} at position {pos0}"
                               + (f": {reason}" if reason else ""))


def _prepare_prompt(ctx: Context, tokens: list[int], n_ctx: int) -> tuple[int, list[int]]:
    """Reuse the cache: return (tokens kept from the cache, tokens still to decode)."""
    if not tokens:
        raise ContextError("the prompt is empty: nothing to generate from (give at least one token)")
    if len(tokens) > n_ctx:
        padding = ctx.n_ctx_padding_note()
        raise ContextError(f"the prompt has {len(tokens)} tokens but the context holds {n_ctx}"
                           + (f" ({padding})" if padding else "") + "; use a larger n_ctx or a shorter prompt")
    common = reuse_cached_prefix(ctx, tokens, 0)
    return common, tokens[common:]


def generate(ctx: Context, prompt: str | Sequence[int], sampler: Sampler | None = None,
             max_tokens: int | None = None, stop: str | Sequence[str] | None = None, *,
             parse_special: bool = True, add_special: bool = True, accept_prompt: bool = True,
             stats: GenerationStats | None = None, special: bool = False,
             draft: Drafter | None = None) -> Iterator[str]:
    """Stream the continuation of ``prompt`` as text pieces.

    ``sampler``: a :class:`SamplerChain` (or any Sampler that selects); None = greedy.
    ``max_tokens``: at most this many sampled tokens (None = until an end-of-generation token, a stop
    string or a full context). ``stop``: strings that end the generation (not emitted).
    ``accept_prompt``: feed the newly decoded prompt tokens to the sampler's history (like llama-cli, so
    repetition penalties see the prompt). ``stats``: a :class:`GenerationStats` to fill in. ``special``: render
    control tokens (llama.cpp's ``token_to_piece(special=True)``, llama-cli ``--special``); by default they
    print as nothing, as in llama-cli. User-defined tokens (Gemma-3's ``<start_of_image>``) always print, as
    in llama.cpp.
    ``draft``: a drafter (:mod:`llmfw.core.generation.speculative`) for speculative decoding; the drafted / accepted
    counts land in ``stats.n_drafted`` / ``stats.n_accepted``.
    """
    model = ctx.model
    chain = sampler if sampler is not None else SamplerChain.greedy()
    if not isinstance(chain, SamplerChain):
        chain = SamplerChain([chain])
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if max_tokens is not None and max_tokens < 0:
        raise LLMFWError(f"max_tokens must be >= 0 or None, got {max_tokens}")
    stats = stats if stats is not None else GenerationStats()
    n_ctx, n_batch = ctx.n_ctx, ctx.n_batch
    if draft is not None and not ctx.memory.can_drop_suffix(draft.n_max):
        raise ContextError(f"speculative decoding is not available for {ctx.model.arch_name!r}: its "
                           f"{type(ctx.memory).__name__} keeps a recurrent state that cannot drop a rejected draft "
                           "(llama.cpp's recurrent memory cannot roll back either); generate without a draft")

    tokens = tokenize_prompt(model, prompt, parse_special=parse_special, add_special=add_special)
    n_keep, new_tokens = _prepare_prompt(ctx, tokens, n_ctx)
    loop = _Loop(ctx, chain, _record(ctx, 0), TextStream(model.vocab, stops, special), stats, max_tokens, n_ctx, draft)
    stats.n_prompt, stats.n_cached = len(tokens), n_keep
    return _stream(loop, n_keep, new_tokens, n_batch, accept_prompt)


#: OpenAI's ``finish_reason`` for each :func:`stop_reason`
FINISH_REASONS = {"eog": "stop", "stop": "stop", "max_tokens": "length", "context_full": "length"}


def stop_reason(text: TextStream, chain: SamplerChain, n_generated: int, max_tokens: int | None, n_cached: int,
                n_ctx: int) -> str:
    """Why generation ends after a sampled token was fed to ``text`` ("" if it goes on), for ``generate`` and the
    serving engine alike: a stop string, the grammar complete (nothing else may follow: "eog"), the token limit,
    or no cell left for the token (``n_cached`` tokens in a context of ``n_ctx``). An end-of-generation token
    ends it before it is fed."""
    if text.stopped:
        return "stop"
    if chain.done():
        return "eog"
    if max_tokens is not None and n_generated >= max_tokens:
        return "max_tokens"
    if n_cached >= n_ctx:
        return "context_full"
    return ""


@dataclass
class _Loop:
    """The state of one generation: what ``_stream`` and its speculative step share."""

    ctx: Context
    chain: SamplerChain
    record: list[int]
    text: TextStream
    stats: GenerationStats
    max_tokens: int | None
    n_ctx: int
    drafter: Drafter | None = None

    def emit(self, token: int, n_cached: int | None = None) -> tuple[str, bool]:
        """Count a sampled token; returns (text to yield, whether generation ends here). ``n_cached``: the
        tokens in the cache that count against n_ctx (default: the record's length)."""
        stats = self.stats
        stats.n_generated += 1
        stats.tokens.append(token)
        if self.ctx.model.vocab.is_eog(token):
            stats.stop_reason = "eog"
            return "", True
        piece = self.text.feed(token)
        stats.stop_reason = stop_reason(self.text, self.chain, stats.n_generated, self.max_tokens,
                                        len(self.record) if n_cached is None else n_cached, self.n_ctx)
        return piece, bool(stats.stop_reason)

    def draft_for(self, token: int) -> list[int]:
        """The drafter's guess after ``token``, cut to what the limits and the context leave room for."""
        if self.drafter is None:
            return []
        room = self.drafter.n_max
        if self.max_tokens is not None:
            room = min(room, self.max_tokens - self.stats.n_generated)
        room = max(min(room, self.n_ctx - len(self.record) - 1), 0)
        return list(self.drafter.draft(self.record, token, room))[:room] if room else []


def _stream(loop: _Loop, n_keep: int, new_tokens: list[int], n_batch: int, accept_prompt: bool) -> Iterator[str]:
    ctx, chain, stats = loop.ctx, loop.chain, loop.stats
    t0 = time.perf_counter()
    _decode(ctx, new_tokens, n_keep, n_batch)
    stats.t_prompt, stats.n_prompt_decoded = time.perf_counter() - t0, len(new_tokens)
    if accept_prompt:
        accept_prompt_tokens(chain, new_tokens)

    t_start = time.perf_counter()
    try:
        if loop.max_tokens is not None and loop.max_tokens <= 0:
            stats.stop_reason = "max_tokens"
        else:
            token = chain.sample(ctx, -1)
            while True:
                piece, done = loop.emit(token)
                if piece:
                    yield piece
                if done:
                    break
                draft = loop.draft_for(token)
                if not draft:
                    _decode(ctx, [token], len(loop.record), 1)
                    token = chain.sample(ctx, -1)
                    continue
                pieces, next_token = _verify(loop, token, draft)
                for piece in pieces:
                    yield piece
                if next_token is None:
                    break
                token = next_token
        rest = "" if loop.text.stopped else loop.text.flush()
        if rest:
            yield rest
    finally:
        stats.t_generate = time.perf_counter() - t_start


def _verify(loop: _Loop, token: int, draft: list[int]) -> tuple[list[str], int | None]:
    """Decode ``token`` + ``draft`` in one batch, emit the accepted draft; returns the text and the next token
    (None when generation ended inside the draft). The cells after the kept tokens are removed (and with them
    the rejected guesses from the context's record)."""
    ctx, stats = loop.ctx, loop.stats
    pos0 = len(loop.record)
    batch = [token, *draft]
    _decode(ctx, batch, pos0, len(batch), logits=True)
    n_kept = pos0 + 1  # the token; each accepted guess adds one
    stats.n_drafted += len(draft)
    stats.n_verify_batches += 1
    pieces: list[str] = []
    next_token: int | None = None
    for i, guess in enumerate(draft):
        sampled = loop.chain.sample(ctx, i)
        if sampled != guess:
            next_token = sampled
            break
        stats.n_accepted += 1
        n_kept += 1
        piece, done = loop.emit(guess, n_kept)
        pieces.append(piece)
        if done:
            break
    else:
        next_token = loop.chain.sample(ctx, len(draft))
    if stats.stop_reason:
        next_token = None
    ctx.memory.seq_rm(0, n_kept, -1)
    return pieces, next_token

