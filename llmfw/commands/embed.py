"""`llmfw embed -m MODEL TEXT...`: embeddings as JSON on stdout (llama.cpp pooling; see core/runtime/embedding.py).

The JSON has the shape of an OpenAI embeddings response: ``{"object": "list", "model": ..., "pooling": ...,
"data": [{"object": "embedding", "index": i, "embedding": [...]}, ...], "usage": {"prompt_tokens": n,
"total_tokens": n}}``; with ``--pooling none`` each ``embedding`` is a list of per-token vectors.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .model_arg import model_option, names_a_model
from .perplexity import load_tool_model


def check_texts(texts: tuple[str, ...], model: str | None) -> None:
    """``llmfw embed smollm2 hello`` would embed the word "smollm2": without -m, a first text that names a model
    while more texts follow is a usage error that shows the -m spelling."""
    if model is None and len(texts) > 1 and names_a_model(texts[0]):
        rest = " ".join(repr(t) for t in texts[1:])
        raise click.UsageError(f"{texts[0]!r} names a model, and every argument is a text to embed: "
                               f"llmfw embed -m {texts[0]} {rest}")


@click.command("embed")
@click.argument("texts", nargs=-1, required=True)
@model_option
@click.option("--pooling", type=click.Choice(["none", "mean", "cls", "last"]), default=None,
              help="Pooling (default: the GGUF's pooling_type; none when it has none).")
@click.option("--no-normalize", is_flag=True, help="Do not divide each vector by its Euclidean norm.")
@click.option("-b", "--batch-size", "n_batch", type=click.IntRange(min=1), default=None,
              help="Most tokens per decode (and per text).")
@click.option("--backend", default=None, help="numpy, torch, torch:cuda, onnx (default: fastest).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def embed_cmd(texts: tuple[str, ...], model: str | None, pooling: str | None, no_normalize: bool,
              n_batch: int | None, backend: str | None, no_progress: bool) -> None:
    """Embed each TEXT ('-' reads one text from stdin) with -m MODEL and print the vectors as JSON."""
    from ..core.runtime.embedding import embed_texts

    check_texts(texts, model)
    inputs = [sys.stdin.read() if text == "-" else text for text in texts]
    llm = load_tool_model(model, backend, not no_progress)
    result = embed_texts(llm, inputs, pooling, not no_normalize, n_batch)
    data = [{"object": "embedding", "index": i, "embedding": vector.tolist()}
            for i, vector in enumerate(result.vectors)]
    click.echo(json.dumps({"object": "list", "model": Path(str(llm.path)).name, "pooling": result.pooling,
                           "data": data, "usage": {"prompt_tokens": result.total_tokens,
                                                   "total_tokens": result.total_tokens}}))
