"""`llmfw plugins`: everything registered, and where it comes from."""
from __future__ import annotations

import json

import click

from ..core.plugins import get_plugin_manager


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins_cmd(as_json: bool) -> None:
    """List registered architectures, backends, tokenizers, samplers, loaders and memory modules."""
    manager = get_plugin_manager()
    listing = manager.listing()
    failures = [{"name": f.name, "reason": f.reason} for f in manager.failures]
    if as_json:
        click.echo(json.dumps({"plugins": listing, "failures": failures}, indent=2))
        return
    for kind, entries in listing.items():
        click.echo(f"{kind}:")
        for e in entries:
            click.echo(f"  {e['name']:20} {e['source']:28} {e['ref']}")
    for f in failures:
        click.echo(f"failed: {f['name']}: {f['reason']}", err=True)
