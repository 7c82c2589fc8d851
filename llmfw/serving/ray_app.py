"""Scale-out: ``llmfw serve`` as a Ray Serve application.

Ray Serve runs the very ASGI app that ``llmfw serve`` runs (:func:`llmfw.serving.app.create_app`), once per
replica: each replica is a Ray actor that loads the model from the shared model cache path, owns one
continuous-batching :class:`~llmfw.serving.Engine` and answers every endpoint itself (``/health`` and
``/metrics`` describe that replica; its ``x-llmfw-replica`` header names it). Ray's HTTP proxy routes each request
to a replica (power of two choices on ongoing requests); nothing but the model file is shared.

``ray`` is an optional extra (``pip install 'llmfw[ray]'``), imported only here and only when used.
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from ..core.errors import ConfigError
from ..app.pipeline import Pipeline, PipelineConfig, RayConfig, load_pipeline

#: the Ray Serve application and deployment names
APP_NAME = "llmfw"
DEPLOYMENT_NAME = "llmfw"
#: what a replica reserves when the config says nothing: less than a core, so two replicas and Serve's own
#: actors fit on a small machine (the engine's threads are ``context.n_threads``, not Ray's bookkeeping)
DEFAULT_REPLICA_CPUS = 0.5


def import_serve() -> Any:
    """``ray.serve``, or a ConfigError that names the extra to install."""
    try:
        from ray import serve
    except ImportError:
        raise ConfigError("serving with Ray needs the ray extra: pip install 'llmfw[ray]'") from None
    return serve


def deployment_options(ray_cfg: RayConfig) -> dict[str, Any]:
    """Keyword arguments for ``serve.deployment`` from the ``server.ray`` section."""
    if ray_cfg.num_replicas is not None and ray_cfg.autoscaling_config is not None:
        raise ConfigError("server.ray: give num_replicas or autoscaling_config, not both")
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": DEFAULT_REPLICA_CPUS, **ray_cfg.ray_actor_options}}
    auto = ray_cfg.autoscaling_config
    if auto is not None:
        if auto.min_replicas > auto.max_replicas:
            raise ConfigError(f"server.ray.autoscaling_config: min_replicas {auto.min_replicas} is above "
                              f"max_replicas {auto.max_replicas}")
        options["autoscaling_config"] = auto.model_dump(exclude_none=True)
    else:
        options["num_replicas"] = ray_cfg.num_replicas or 1
    return options


def build_replica_app(config: Mapping[str, Any], source: str | None) -> Any:
    """One replica's ASGI app: the model loaded before the replica reports ready (Ray routes no request to a
    replica still loading), then exactly the single-process server's app around its own engine."""
    from .app import pipeline_app

    pipeline = Pipeline.from_dict(config, source)
    return pipeline_app(pipeline, eager=True)


def _replica_class(serve: Any) -> type:
    """The deployment class: Ray builds each replica's app at replica start (``__serve_build_asgi_app__``)."""

    class LLMFWReplica:
        def __init__(self, config: Mapping[str, Any], source: str | None = None):
            self._config, self._source = dict(config), source
            self._app: Any = None

        def __serve_build_asgi_app__(self) -> Any:
            self._app = build_replica_app(self._config, self._source)
            return self._app

        def check_health(self) -> None:
            """Ray's health probe: a replica whose engine thread died is replaced."""
            engine = getattr(getattr(self._app, "state", None), "engine", None)
            if engine is not None and not engine.running:
                raise RuntimeError("the llmfw engine thread has stopped")

    return serve.ingress()(LLMFWReplica)


def _pipeline_of(config: Pipeline | PipelineConfig | Mapping[str, Any] | str | Path) -> Pipeline:
    if isinstance(config, Pipeline):
        return config
    if isinstance(config, PipelineConfig):
        return Pipeline(config)
    if isinstance(config, (str, Path)):
        return load_pipeline(config)
    return Pipeline.from_dict(config, "<ray_app config>")


def ray_app(config: Pipeline | PipelineConfig | Mapping[str, Any] | str | Path) -> Any:
    """A Ray Serve application serving the pipeline ``config`` (a Pipeline, its config, a YAML-shaped mapping
    or a YAML file's path); its ``server.ray`` section sets replicas, autoscaling and actor options.
    Compose it into your own Ray apps or run it with ``serve.run(ray_app(cfg), name=..., route_prefix="/")``."""
    serve = import_serve()
    pipeline = _pipeline_of(config)
    cfg = pipeline.config
    options = deployment_options(cfg.server.ray or RayConfig())
    source = str(pipeline.source) if pipeline.source is not None else None
    deployment = serve.deployment(name=DEPLOYMENT_NAME, **options)(_replica_class(serve))
    return deployment.bind(cfg.model_dump(mode="json"), source)


def start_ray(address: str | None) -> Any:
    """Join the cluster at ``address`` (``auto``, ``ray://HOST:PORT``) or start a local Ray instance."""
    import ray

    try:
        return ray.init(address=address, ignore_reinit_error=True, include_dashboard=False,
                        log_to_driver=False)
    except ConnectionError as exc:
        raise ConfigError(f"cannot reach a Ray cluster at {address}: {exc}") from None


def run_ray_server(pipeline: Pipeline, echo: Callable[[str], None],
                   stop: threading.Event | None = None) -> None:
    """``llmfw serve --ray``: deploy :func:`ray_app` behind Ray Serve's HTTP proxy on ``server.host`` /
    ``server.port`` and block until Ctrl-C / SIGTERM (or ``stop``), then delete the application."""
    serve = import_serve()
    server = pipeline.config.server
    ray_cfg = server.ray or RayConfig()
    app = ray_app(pipeline)  # validates the options before Ray starts
    start_ray(ray_cfg.address)
    serve.start(http_options={"host": server.host, "port": server.port})
    echo(f"llmfw: deploying {deployment_summary(ray_cfg)} on Ray (each loads the model) ...")
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    echo(f"llmfw: serving at http://{server.host}:{server.port} through Ray Serve")
    if server.webui:
        from .webui import page_url

        echo(f"llmfw: chat in a browser at {page_url(server.host, server.port)}")
    stop = stop or threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        echo("llmfw: stopping the Ray Serve application")
        serve.delete(APP_NAME)
        if ray_cfg.address is None:  # our own local instance
            serve.shutdown()


def deployment_summary(ray_cfg: RayConfig) -> str:
    auto = ray_cfg.autoscaling_config
    if auto is not None:
        return f"{auto.min_replicas} to {auto.max_replicas} autoscaled replicas"
    n = ray_cfg.num_replicas or 1
    return f"{n} replica{'s' if n != 1 else ''}"


__all__ = ["ray_app", "run_ray_server", "deployment_options", "import_serve"]
