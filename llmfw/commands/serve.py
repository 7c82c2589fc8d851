"""`llmfw serve`: the OpenAI-compatible HTTP server (uvicorn + starlette) with continuous batching.

The model loads once (progress bar on stderr) while ``/health`` answers 503; then the URL is printed. Several
models (``-m A -m B``, ``--models-dir DIR`` or a ``models:`` list in the YAML file) are each checked at start,
then loaded on first use (:mod:`llmfw.serving.router`). Ctrl-C or SIGTERM stops the engine at once — running
streams end with an error event — and the server within seconds. Flags override the ``--config`` file's keys:
``server.*`` for the server's own settings, ``model`` / ``models``, ``backend``, ``context.n_ctx`` and
``context.n_threads`` for the rest.
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any, Callable

import click

from .model_arg import MODEL_HELP

#: flag name -> dotted key in the pipeline file
SERVE_KEYS = {
    "backend": "backend", "n_ctx": "context.n_ctx", "threads": "context.n_threads",
    "host": "server.host", "port": "server.port", "parallel": "server.parallel", "api_key": "server.api_key",
    "api_key_file": "server.api_key_file", "max_queue": "server.max_queue", "alias": "server.alias",
    "webui": "server.webui",
    "chat_template": "chat.template_file", "reasoning_format": "server.reasoning_format",
    "reasoning_budget": "server.reasoning_budget", "chat_template_kwargs": "server.chat_template_kwargs",
    "models_dir": "server.models_dir", "models_max": "server.models_max",
}
#: seconds uvicorn waits for open connections after a stop signal
GRACEFUL_SHUTDOWN_S = 3


def serve_pipeline(opts: dict[str, Any]) -> Any:
    from ..app.pipeline import Pipeline, merge_overrides, read_yaml

    config = opts.get("config")
    data = read_yaml(config) if config else {}
    overrides = {key: opts[name] for name, key in SERVE_KEYS.items() if opts.get(name) is not None}
    models = list(opts.get("models") or ())
    if models:  # -m replaces the file's model and models: one is today's single model, several a models list
        data = {k: v for k, v in data.items() if k not in ("model", "models")}
        if len(models) == 1:
            overrides["model"] = models[0]
        else:
            overrides["models"] = [{"model": m} for m in models]
    if opts.get("cors_origin"):
        overrides["server.cors_origin"] = list(opts["cors_origin"])
    overrides.update(ray_overrides(opts, (data.get("server") or {}).get("ray") is not None))
    return Pipeline.from_dict(merge_overrides(data, overrides), Path(config) if config else "<command line>")


def ray_overrides(opts: dict[str, Any], in_file: bool) -> dict[str, Any]:
    """The ``server.ray.*`` keys the Ray flags set; a Ray flag without --ray (or a ``server.ray`` section) is an
    error rather than silently ignored."""
    from ..core.errors import ConfigError

    flags = {name: opts.get(name) for name in ("replicas", "autoscale", "ray_address")}
    given = [f"--{name.replace('_', '-')}" for name, value in flags.items() if value is not None]
    if not (opts.get("use_ray") or in_file):
        if given:
            raise ConfigError(f"{', '.join(given)} only make{'s' if len(given) == 1 else ''} sense with --ray")
        return {}
    if flags["replicas"] is not None and flags["autoscale"] is not None:
        raise ConfigError("give --replicas or --autoscale, not both")
    overrides: dict[str, Any] = {"server.ray.address": flags["ray_address"]} if flags["ray_address"] else {}
    if flags["replicas"] is not None:
        overrides["server.ray.num_replicas"] = flags["replicas"]
    if flags["autoscale"] is not None:
        low, high = parse_autoscale(flags["autoscale"])
        overrides["server.ray.autoscaling_config.min_replicas"] = low
        overrides["server.ray.autoscaling_config.max_replicas"] = high
    if not overrides and not in_file:
        overrides["server.ray"] = {}  # --ray alone: one replica on a local instance
    return overrides


def parse_autoscale(text: str) -> tuple[int, int]:
    """``MIN:MAX`` → (MIN, MAX), with 0 <= MIN <= MAX and MAX >= 1."""
    from ..core.errors import ConfigError

    low, sep, high = text.partition(":")
    try:
        bounds = int(low), int(high)
    except ValueError:
        bounds = (-1, -1)
    if not sep or bounds[0] < 0 or bounds[1] < max(1, bounds[0]):
        raise ConfigError(f"--autoscale {text!r}: expected MIN:MAX replicas with 0 <= MIN <= MAX, MAX >= 1")
    return bounds


def log_engine_steps() -> None:
    """``-v``: the serving engines' INFO lines on stderr (a busy period's step profile, ``llmfw.serving.engine``)."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("llmfw.serving")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # a root handler someone configured would print each line twice


def make_server(app: Any, host: str, port: int, verbose: bool, on_listening: Callable[[], None] | None = None) -> Any:
    """A uvicorn server whose first stop signal also stops the engine (streams end with an error event)
    and exits normally; a second Ctrl-C forces the exit. ``on_listening`` runs once it accepts connections."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and on_listening is not None:
                on_listening()

        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.close(timeout=0)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level="info" if verbose else "warning",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=verbose)
    return Server(config)


@click.command("serve")
@click.option("-m", "--model", "models", multiple=True, metavar="MODEL",
              help=f"{MODEL_HELP} Repeat it to serve several models, routed by each request's model.")
@click.option("--models-dir", default=None, type=click.Path(), metavar="DIR",
              help="Serve every *.gguf of DIR as well, each named by its file stem.")
@click.option("--models-max", type=click.IntRange(min=0), default=None, metavar="N",
              help="With several models: most loaded at once, the least recently used unloaded (default 4, "
                   "0 = no limit).")
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
@click.option("--chat-template", "chat_template", default=None, type=click.Path(dir_okay=False),
              help="Jinja chat template FILE overriding the model's (e.g. one that knows tools).")
@click.option("--chat-template-kwargs", default=None, metavar="JSON",
              help='Variables for every chat template render, e.g. \'{"enable_thinking": false}\'.')
@click.option("--reasoning-format", type=click.Choice(["deepseek", "none"]), default=None,
              help="deepseek (default): thinking goes to reasoning_content; none: it stays in the content.")
@click.option("--reasoning-budget", type=int, default=None,
              help="Most thinking tokens before the closing tag is forced (-1 = no limit, 0 = no thinking).")
@click.option("--cors-origin", multiple=True, help="Allow browser requests from this origin (repeatable).")
@click.option("--webui/--no-webui", default=None, help="Serve the browser chat page at / (default: on).")
@click.option("--config", type=click.Path(dir_okay=False), default=None, help="YAML file (its server: section).")
@click.option("--ray", "use_ray", is_flag=True,
              help="Serve as a Ray Serve application (replicas behind Ray's router; needs llmfw[ray]).")
@click.option("--replicas", type=click.IntRange(min=1), default=None, help="With --ray: this many replicas.")
@click.option("--autoscale", default=None, metavar="MIN:MAX",
              help="With --ray: autoscale between MIN and MAX replicas.")
@click.option("--ray-address", default=None, metavar="auto|ray://HOST:PORT",
              help="With --ray: join this cluster (default: start a local Ray instance).")
@click.option("-v", "--verbose", is_flag=True,
              help="Log every request, and each engine's step profile when it goes idle (decode vs. its own work).")
def serve(**opts: Any) -> None:
    """Serve a model (or several) over OpenAI- and Anthropic-compatible HTTP APIs with continuous batching."""
    from ..serving.app import pipeline_app, read_api_key
    from ..serving.engine import Engine
    from ..serving.startup import serves_several
    from ..serving.webui import page_url
    from .run import load_model_with_progress

    pipeline = serve_pipeline(opts)
    if opts["verbose"]:
        log_engine_steps()
    cfg = pipeline.config
    server_cfg = cfg.server
    url = f"http://{server_cfg.host}:{server_cfg.port}"
    if serves_several(cfg):
        serve_several(pipeline, url, opts["verbose"])
        return
    if server_cfg.ray is not None:
        from ..serving.ray_app import run_ray_server

        run_ray_server(pipeline, lambda line: click.echo(line, err=True))
        return
    read_api_key(server_cfg)  # a bad key file fails before the model loads
    preflight(pipeline)
    failed: list[str] = []

    def announce(engine: Engine) -> None:
        click.echo(f"llmfw: serving {engine.alias} at {url} (parallel {engine.parallel}, "
                   f"{engine.n_ctx_slot} tokens per slot)", err=True)
        if server_cfg.webui:
            click.echo(f"llmfw: chat in a browser at {page_url(server_cfg.host, server_cfg.port)}", err=True)
        sys.stderr.flush()

    def give_up(message: str) -> None:  # the model failed to load: a 503 server is no use to anyone
        failed.append(message)
        server.should_exit = True

    app = pipeline_app(pipeline, load_model=lambda: load_model_with_progress(pipeline, True), on_ready=announce,
                       on_load_error=give_up)
    server = make_server(app, server_cfg.host, server_cfg.port, opts["verbose"])
    run_server(server, app, url)
    if failed:
        raise LoadFailed(f"the model failed to load: {failed[0]}")


def run_server(server: Any, app: Any, url: str) -> None:
    """Serve until stopped, then stop the engines; a server that never listened is an error."""
    try:
        server.run()
    finally:
        app.state.close()
    if not server.started:
        raise click.ClickException(f"could not listen on {url}")


def serve_several(pipeline: Any, url: str, verbose: bool) -> None:
    """Serve several models: each checked now (one clear error for a bad one), loaded on first use."""
    from ..core.errors import ConfigError
    from ..serving.app import read_api_key, router_app
    from ..serving.chat_options import chat_options_from_config
    from ..serving.startup import preflight_models
    from ..serving.webui import page_url
    from .progress import ProgressBar

    server_cfg = pipeline.config.server
    read_api_key(server_cfg)  # a bad key file fails before anything else
    if server_cfg.ray is not None:
        raise ConfigError("--ray serves one model; several models (-m A -m B, --models-dir, models:) are not "
                          "supported with it")
    if server_cfg.alias:
        raise ConfigError("--alias names the one model; with several, give names and aliases in a `models:` "
                          "list of the YAML file")
    with ProgressBar("pull models") as bar:
        models = preflight_models(pipeline, progress=lambda done, total, what: bar.update(done / max(total, 1), what))
    chat_options_from_config(pipeline)
    pipeline.chat_template()  # a missing template file fails now

    def say(line: str) -> None:
        click.echo(line, err=True)
        sys.stderr.flush()

    def announce() -> None:
        limit = f"at most {server_cfg.models_max} at once" if server_cfg.models_max else "no limit"
        say(f"llmfw: serving {len(models)} models at {url} ({', '.join(m.name for m in models)}; "
            f"loaded on first use, {limit})")
        if server_cfg.webui:
            say(f"llmfw: chat in a browser at {page_url(server_cfg.host, server_cfg.port)}")

    app = router_app(pipeline, models, report=say)
    run_server(make_server(app, server_cfg.host, server_cfg.port, verbose, on_listening=announce), app, url)


def preflight(pipeline: Any) -> None:
    """Fail now, with one line, on what would otherwise only fail once the server listens: the model (exists,
    is a GGUF of a known architecture; a catalog model is pulled here), the chat template file and the
    ``server`` settings that need parsing."""
    from ..serving.chat_options import chat_options_from_config
    from ..serving.startup import preflight_model
    from .progress import ProgressBar

    location = pipeline.model_location()
    with ProgressBar(f"pull {location}") as bar:
        path = preflight_model(location, progress=lambda done, total, what: bar.update(done / max(total, 1), what))
    pipeline.config.model = str(path)
    chat_options_from_config(pipeline)


class LoadFailed(click.ClickException):
    """Printed as ``llmfw: error: ...`` like every other project error; exit code 1."""

    def show(self, file: Any = None) -> None:
        click.echo(f"llmfw: error: {self.message}", err=True)
