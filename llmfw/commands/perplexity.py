"""`llmfw perplexity -m MODEL -f FILE`: llama-perplexity's estimate of a text file (see core/generation/perplexity.py).

stdout gets what llama-perplexity prints: the running estimate after each chunk (``[1]18.6062,[2]16.3901,...``)
and, as the last line, ``Final estimate: PPL = X +/- Y``; the progress bar and the set-up go to stderr.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .model_arg import model_option
from .progress import ProgressBar


def load_tool_model(model: str | None, backend: str | None, show_progress: bool) -> Any:
    """The model named on a tool's command line (catalog name or path), loaded with progress bars."""
    from ..app.pipeline import Pipeline
    from .run import load_model_with_progress

    data: dict[str, Any] = {"backend": backend}
    if model:
        data["model"] = model
    return load_model_with_progress(Pipeline.from_dict(data, "<command line>"), show_progress)


def read_text_file(path: str) -> str:
    from ..core.errors import ConfigError

    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the text file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: the file is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


@click.command("perplexity")
@model_option
@click.option("-f", "--file", "file", required=True, help="The text file to score.")
@click.option("-c", "--ctx-size", "n_ctx", type=click.IntRange(min=4), default=512, show_default=True,
              help="Chunk length in tokens (llama-perplexity's n_ctx).")
@click.option("-b", "--batch-size", "n_batch", type=click.IntRange(min=1), default=None,
              help="Tokens per decode (default: n_ctx).")
@click.option("--chunks", "n_chunks", type=int, default=-1, show_default=True,
              help="Score only the first K chunks (-1 = all).")
@click.option("--backend", default=None, help="numpy, torch, torch:cuda, onnx (default: fastest).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def perplexity_cmd(model: str | None, file: str, n_ctx: int, n_batch: int | None, n_chunks: int,
                   backend: str | None, no_progress: bool) -> None:
    """Perplexity of FILE, computed exactly as llama-perplexity does."""
    from ..core.generation.perplexity import perplexity_of_tokens, perplexity_tokens

    if n_chunks == 0 or n_chunks < -1:
        raise click.BadParameter("must be a positive number of chunks or -1 (all)", param_hint="--chunks")
    text = read_text_file(file)
    llm = load_tool_model(model, backend, not no_progress)
    tokens = perplexity_tokens(llm, text)
    batch = n_batch or n_ctx
    click.echo(f"perplexity: tokenized {len(tokens)} tokens; calculating over "
               f"{len(tokens) // n_ctx if n_chunks < 0 else min(n_chunks, len(tokens) // n_ctx)} chunks, "
               f"n_ctx={n_ctx}, batch_size={min(batch, n_ctx)}", err=True)
    with llm.new_context(n_ctx=n_ctx, n_batch=min(batch, n_ctx), n_ubatch=min(batch, n_ctx)) as ctx, \
            ProgressBar("perplexity", enabled=None if not no_progress else False) as bar:
        def on_chunk(done: int, total: int, ppl: float) -> None:
            bar.update(done / total, f"chunk {done}/{total} PPL {ppl:.4f}")
            click.echo(f"[{done}]{ppl:.4f},", nl=False)

        result = perplexity_of_tokens(ctx, tokens, n_ctx, batch, n_chunks, on_chunk)
    click.echo("")
    click.echo(result.final_line())
