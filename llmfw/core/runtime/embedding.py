"""Embeddings the way llama.cpp computes them (``llama_context`` with ``embeddings = true``).

Each text is tokenized like llama-cpp-python's ``Llama.embed`` does (``add_special=True``: the vocabulary's BOS
when it adds one; special token text not parsed). Texts are packed, one sequence each, into batches of at most
``n_batch`` tokens and ``n_seq_max`` sequences, decoded on an empty cache in an ``embeddings=True`` context:
the graph stops at the final hidden state after the output norm (llama.cpp's ``t_embd``) and the head is not
computed. Pooling (llama.cpp's ``llama_pooling_type``): ``mean`` over the sequence's tokens, ``cls`` the first
token, ``last`` the last token, ``none`` one vector per token. The default is the GGUF's
``{arch}.pooling_type`` (absent: ``none``, as llama.cpp). ``normalize`` divides each vector by its Euclidean
norm (llama.cpp's ``embd_normalize = 2``; a zero vector stays zero).

The server calls :func:`embed_texts` (vectors and token counts) through ``Model.embed`` or directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping, Protocol, Sequence

import numpy as np

from .batch import Batch, tokenize_prompt
from ..errors import ConfigError, ContextError

if TYPE_CHECKING:
    from ..tokenizer.vocab import Vocab
    from .context import Context


class EmbeddingModel(Protocol):
    """What embedding reads of a model (:class:`~.model.Model`, one module up, whose ``embed`` calls this)."""

    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def arch_name(self) -> str: ...

    @property
    def n_ctx_train(self) -> int: ...

    @property
    def vocab(self) -> Vocab: ...

    @property
    def n_vocab(self) -> int: ...

    def new_context(self, **kw: Any) -> Context: ...

Pooling = Literal["none", "mean", "cls", "last"]
#: llama.cpp's enum llama_pooling_type (RANK = 4 needs a classifier head: not supported)
POOLING_BY_ID: dict[int, str] = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
POOLINGS = ("none", "mean", "cls", "last")
#: most sequences one embedding decode holds (the KV cache's sequence bit mask limit)
MAX_SEQ_PER_BATCH = 64


@dataclass
class Embeddings:
    """What :func:`embed_texts` returns: one vector per text (``[n_embd]``; ``[n_tokens, n_embd]`` for
    ``pooling="none"``), the tokens of each text and the pooling used."""

    vectors: list[np.ndarray]
    n_tokens: list[int]
    pooling: str

    @property
    def total_tokens(self) -> int:
        return sum(self.n_tokens)


def model_pooling(model: EmbeddingModel) -> str:
    """The GGUF's ``{arch}.pooling_type`` as a name; ``none`` when absent (llama.cpp's default)."""
    value = model.metadata.get(f"{model.arch_name}.pooling_type")
    if value is None:
        return "none"
    name = POOLING_BY_ID.get(int(value))
    if name not in POOLINGS:
        raise ConfigError(f"the model's pooling_type {value} ({name or 'unknown'}) is not supported; "
                          f"pass pooling= one of {', '.join(POOLINGS)}")
    return name


def _resolve_pooling(model: EmbeddingModel, pooling: str | None) -> str:
    if pooling is None:
        return model_pooling(model)
    if pooling not in POOLINGS:
        raise ConfigError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


def _tokenize_all(model: EmbeddingModel, texts: Sequence[str | Sequence[int]], n_batch: int) -> list[list[int]]:
    all_tokens = []
    for i, text in enumerate(texts):
        if not isinstance(text, (str, list, tuple)):
            raise ConfigError(f"input {i} must be a string or a list of token ids, got {type(text).__name__}")
        tokens = tokenize_prompt(model, text, parse_special=False, add_special=True)
        if not tokens:
            raise ContextError(f"input {i} is empty: it has no tokens to embed")
        if len(tokens) > n_batch:
            raise ContextError(f"input {i} has {len(tokens)} tokens, more than the batch size {n_batch}; "
                               "shorten it or raise n_batch")
        all_tokens.append(tokens)
    return all_tokens


def _pack(all_tokens: list[list[int]], n_batch: int, n_seq_max: int) -> list[list[int]]:
    """Indices of the texts in each decode: in order, at most n_batch tokens and n_seq_max sequences."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, tokens in enumerate(all_tokens):
        if groups[-1] and (used + len(tokens) > n_batch or len(groups[-1]) >= n_seq_max):
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += len(tokens)
    return groups


def _pool(rows: np.ndarray, pooling: str) -> np.ndarray:
    if pooling == "mean":
        return np.asarray(rows.astype(np.float64).mean(axis=0), dtype=np.float32)
    if pooling == "cls":
        return np.array(rows[0])
    if pooling == "last":
        return np.array(rows[-1])
    return np.array(rows)


def _normalized(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)
    return (x / np.where(norm == 0, 1.0, norm)).astype(np.float32)


def _decode_group(ctx: Context, group: list[list[int]]) -> list[np.ndarray]:
    """Decode the texts of one group as sequences 0..n-1 of one batch; each one's per-token hidden states."""
    ctx.memory.clear()
    tokens = [t for seq in group for t in seq]
    pos = [p for seq in group for p in range(len(seq))]
    seq_id = [s for s, seq in enumerate(group) for _ in seq]
    code = ctx.decode(Batch(tokens, pos=pos, seq_id=seq_id, logits=True))
    if code != 0:
        raise ContextError(f"embedding decode failed with code {code}: {ctx.last_error}")
    rows = ctx.get_embeddings()
    bounds = np.cumsum([0] + [len(seq) for seq in group])
    return [rows[bounds[k]:bounds[k + 1]] for k in range(len(group))]


def embed_texts(model: EmbeddingModel, texts: str | Sequence[str | Sequence[int]], pooling: str | None = None,
                normalize: bool = True, n_batch: int | None = None,
                n_seq_max: int = MAX_SEQ_PER_BATCH) -> Embeddings:
    """Embeddings of ``texts`` (strings or token id lists) with their token counts; see the module docstring."""
    if isinstance(texts, str):
        texts = [texts]
    if not texts:
        raise ConfigError("no input to embed: give at least one text")
    pooling_name = _resolve_pooling(model, pooling)
    n_batch = int(n_batch or min(2048, model.n_ctx_train))
    if n_batch < 1 or not 1 <= n_seq_max <= MAX_SEQ_PER_BATCH:
        raise ConfigError(f"n_batch must be positive and n_seq_max in 1..{MAX_SEQ_PER_BATCH}")
    all_tokens = _tokenize_all(model, texts, n_batch)
    groups = _pack(all_tokens, n_batch, n_seq_max)
    n_ctx = max(sum(len(all_tokens[i]) for i in g) for g in groups)
    widest = max(len(g) for g in groups)
    vectors: list[np.ndarray] = []
    with model.new_context(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_seq_max=widest, embeddings=True) as ctx:
        for group in groups:
            for rows in _decode_group(ctx, [all_tokens[i] for i in group]):
                vector = _pool(rows, pooling_name)
                vectors.append(_normalized(vector) if normalize else vector)
    return Embeddings(vectors, [len(t) for t in all_tokens], pooling_name)
