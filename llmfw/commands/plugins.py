"""`llmfw plugins`: everything registered, and where it comes from."""
from __future__ import annotations

import json
from typing import Any

import click

from ..core.errors import LLMFWError
from ..core.plugins import PluginManager, get_plugin_manager


def _backend_class(manager: PluginManager, kind: str, name: str) -> Any:
    """The registered backend class, or None for other kinds and for a plugin that cannot be imported (the
    manager reports it under "failed")."""
    if kind != "backends":
        return None
    try:
        return manager.get(kind, name)
    except LLMFWError:
        return None


def missing_install(manager: PluginManager, kind: str, name: str) -> str | None:
    """For a backend whose libraries are not installed, how to install them (``pip install 'llmfw[torch]'``);
    None when it is usable or not a backend. Reads the backend's declaration; imports none of its libraries."""
    cls = _backend_class(manager, kind, name)
    if cls is None:
        return None
    missing_requirements = getattr(cls, "missing_requirements", None)
    if not callable(missing_requirements) or not missing_requirements():
        return None
    return str(cls.install_hint())


def backend_declaration(manager: PluginManager, kind: str, name: str) -> dict[str, Any] | None:
    """What a backend declares to the core (host role, default priority per device, its options), read from
    the class alone: nothing is loaded and no device is probed."""
    cls = _backend_class(manager, kind, name)
    if cls is None:
        return None
    schema = getattr(cls, "options_schema", None)
    fields = getattr(schema, "model_fields", {})
    return {"is_host": bool(getattr(cls, "is_host", False)),
            "default_priority": dict(getattr(cls, "default_priority", {}) or {}),
            "options": {key: repr(field.default) for key, field in fields.items()}}


def _declaration_line(declaration: dict[str, Any]) -> str:
    priority = ", ".join(f"{device} {value}" for device, value in declaration["default_priority"].items())
    options = ", ".join(f"{key}={default}" for key, default in declaration["options"].items())
    return (f"      host: {'yes' if declaration['is_host'] else 'no'}; default priority: {priority or 'never default'}"
            f"; options: {options or 'none'}")


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins_cmd(as_json: bool) -> None:
    """List registered architectures, backends, tokenizers, samplers, loaders and memory modules; a backend
    whose libraries are missing is marked ``(not installed: pip install ...)``, and each backend's declaration
    (host role, default priority per device, options with their defaults) is shown under it."""
    manager = get_plugin_manager()
    listing: dict[str, list[dict[str, Any]]] = manager.listing()
    for kind, entries in listing.items():
        for e in entries:
            install = missing_install(manager, kind, e["name"])
            if install:
                e["not_installed"] = install
            declaration = backend_declaration(manager, kind, e["name"])
            if declaration is not None:
                e["declaration"] = declaration
    failures = [{"name": f.name, "reason": f.reason} for f in manager.failures]
    if as_json:
        click.echo(json.dumps({"plugins": listing, "failures": failures}, indent=2))
        return
    for kind, entries in listing.items():
        click.echo(f"{kind}:")
        for e in entries:
            mark = f"  (not installed: {e['not_installed']})" if "not_installed" in e else ""
            click.echo(f"  {e['name']:20} {e['source']:28} {e['ref']}{mark}")
            if "declaration" in e:
                click.echo(_declaration_line(e["declaration"]))
    for f in failures:
        click.echo(f"failed: {f['name']}: {f['reason']}", err=True)
