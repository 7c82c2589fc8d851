"""`llmfw run --prompt-cache FILE`: llama-cli's ``--prompt-cache`` — the KV state after the prompt is saved to
FILE, and a later run with the same FILE loads it and decodes only the prompt tokens that differ."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click


def prime_prompt_cache(pipeline: Any, model: Any, ctx: Any, prompt: str | None, path: str) -> Any:
    """Load FILE (when it exists), decode what the cache lacks of the prompt, save FILE unless it already held
    exactly this prompt. Returns the priming's GenerationStats (``n_prompt_decoded`` = tokens decoded)."""
    from ..core.generation.generate import GenerationStats, generate

    file = Path(path)
    text = prompt if prompt is not None else pipeline.config.generation.prompt
    n_loaded = len(ctx.state_load_file(file)) if file.exists() else 0
    stats = GenerationStats()
    tok = pipeline.config.tokenizer
    for _ in generate(ctx, pipeline.render_prompt(text, model), max_tokens=0, parse_special=tok.parse_special,
                      add_special=tok.add_special, accept_prompt=False, stats=stats):
        pass
    unchanged = n_loaded == stats.n_prompt and stats.n_cached == stats.n_prompt - 1
    if not unchanged:
        ctx.state_save_file(file)
    click.echo(f"prompt cache {file}: {n_loaded} tokens loaded, {stats.n_cached} reused, "
               f"{stats.n_prompt_decoded} decoded{'' if unchanged else ', saved'}", err=True)
    return stats
