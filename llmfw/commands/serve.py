"""`llmfw serve`: the OpenAI-compatible HTTP server (uvicorn + starlette) with continuous batching.

The model loads once (progress bar on stderr) while ``/health`` answers 503; then the URL is printed. Ctrl-C or
SIGTERM stops the engine at once — running streams end with an error event — and the server within seconds.
Flags override the ``--config`` file's keys: ``server.*`` for the server's own settings, ``model``, ``backend``,
``context.n_ctx`` and ``context.n_threads`` for the rest.
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import click

#: flag name -> dotted key in the pipeline file
SERVE_KEYS = {
    "model": "model", "backend": "backend", "n_ctx": "context.n_ctx", "threads": "context.n_threads",
    "host": "server.host", "port": "server.port", "parallel": "server.parallel", "api_key": "server.api_key",
    "api_key_file": "server.api_key_file", "max_queue": "server.max_queue", "alias": "server.alias",
}
#: seconds uvicorn waits for open connections after a stop signal
GRACEFUL_SHUTDOWN_S = 3


def serve_pipeline(opts: dict[str, Any]) -> Any:
    from ..core.pipeline import Pipeline, merge_overrides, read_yaml

    config = opts.get("config")
    data = read_yaml(config) if config else {}
    overrides = {key: opts[name] for name, key in SERVE_KEYS.items() if opts.get(name) is not None}
    if opts.get("cors_origin"):
        overrides["server.cors_origin"] = list(opts["cors_origin"])
    return Pipeline.from_dict(merge_overrides(data, overrides), Path(config) if config else "<command line>")


def read_api_key(server: Any) -> str | None:
    from ..core.errors import ConfigError

    if server.api_key and server.api_key_file:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if not server.api_key_file:
        return server.api_key or None
    try:
        key = Path(server.api_key_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"--api-key-file {server.api_key_file}: {exc.strerror or exc}") from None
    if not key:
        raise ConfigError(f"--api-key-file {server.api_key_file} is empty")
    return key


def make_server(app: Any, host: str, port: int, verbose: bool) -> Any:
    """A uvicorn server whose first stop signal also stops the engine (streams end with an error event)
    and exits normally; a second Ctrl-C forces the exit."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            engine = app.state.engine
            if engine is not None:
                engine.close(timeout=0)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level="info" if verbose else "warning",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=verbose)
    return Server(config)


@click.command("serve")
@click.option("-m", "--model", default=None, help="Catalog name or GGUF path (default: smollm2).")
@click.option("--host", default=None, help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (default 8080).")
@click.option("-np", "--parallel", type=int, default=None, help="Sequences decoded together (default 4).")
@click.option("-c", "--n-ctx", "n_ctx", type=int, default=None,
              help="Total context; each slot gets n_ctx / parallel (0 = model default).")
@click.option("-t", "--threads", type=int, default=None, help="CPU threads.")
@click.option("--backend", default=None, help="numpy, torch, torch:cuda, onnx (default: fastest).")
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY'.")
@click.option("--api-key-file", default=None, type=click.Path(dir_okay=False), help="Read the API key from a file.")
@click.option("--max-queue", type=int, default=None, help="Most requests waiting for a slot (default 64).")
@click.option("--alias", default=None, help="Model name in /v1/models and responses (default: the file name).")
@click.option("--cors-origin", multiple=True, help="Allow browser requests from this origin (repeatable).")
@click.option("--config", type=click.Path(dir_okay=False), default=None, help="YAML file (its server: section).")
@click.option("-v", "--verbose", is_flag=True, help="Log every request.")
def serve(**opts: Any) -> None:
    """Serve a model over an OpenAI-compatible HTTP API with continuous batching."""
    from ..serving.app import create_app
    from ..serving.engine import Engine
    from .run import load_model_with_progress

    pipeline = serve_pipeline(opts)
    cfg = pipeline.config
    server_cfg = cfg.server
    api_key = read_api_key(server_cfg)
    url = f"http://{server_cfg.host}:{server_cfg.port}"

    def load() -> Engine:
        model = load_model_with_progress(pipeline, True)
        engine = Engine(model, server_cfg.parallel, n_ctx=cfg.context.n_ctx, n_threads=cfg.context.n_threads,
                        max_queue=server_cfg.max_queue, alias=server_cfg.alias)
        click.echo(f"llmfw: serving {engine.alias} at {url} (parallel {engine.parallel}, "
                   f"{engine.n_ctx_slot} tokens per slot)", err=True)
        sys.stderr.flush()
        return engine

    app = create_app(load, api_key=api_key, cors_origins=server_cfg.cors_origin,
                     thread_tokens=server_cfg.max_queue + server_cfg.parallel + 16)
    server = make_server(app, server_cfg.host, server_cfg.port, opts["verbose"])
    try:
        server.run()
    finally:
        if app.state.engine is not None:
            app.state.engine.close()
    if not server.started:
        raise click.ClickException(f"could not listen on {url}")
