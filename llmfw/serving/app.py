"""The OpenAI-compatible HTTP server: a starlette app in front of one :class:`Engine`.

Handlers never touch the model's context: they hand the parsed JSON body to ``engine.completion`` /
``engine.chat_completion`` (run in a worker thread) and stream the chunks it yields as server-sent events.
Every failure is an OpenAI-shaped JSON error ``{"error": {"message", "type", "param", "code"}}``; every response
carries ``x-llmfw-replica``; with an API key every ``/v1/*``, ``/tokenize``, ``/detokenize`` and ``/metrics``
request needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (compared in constant time). Anthropic's
``/v1/messages`` endpoints (:mod:`llmfw.serving.anthropic`) answer in Anthropic's error shape instead.
"""
from __future__ import annotations

import functools
import hmac
import logging
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Callable, MutableMapping

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..core.errors import ConfigError, RequestError
from . import anthropic
from .chat_options import chat_options_from_config
from .engine import Engine
from .metrics import CONTENT_TYPE, EngineMetrics
from .http_common import (MAX_BODY_BYTES as MAX_BODY_BYTES, RETRY_AFTER_S as RETRY_AFTER_S, BadBody, ServerState,
                          error_body as error_body, error_response, finite_json, on_model, read_json,
                          response_for_error, server_state, sse_events)
from .openapi import openapi_endpoint
from .protocol import DetokenizeBody, TokenizeBody, parse_request
from .router import ModelRouter, ServedModel, load_progress
from .webui import webui_routes

log = logging.getLogger(__name__)

#: paths that need the API key (when one is set): these plus everything under /v1/
PROTECTED = ("/tokenize", "/detokenize", "/metrics")
REPLICA_HEADER = "x-llmfw-replica"


async def _http_exception(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    if status == 404:
        detail = f"unknown path {request.url.path}"
    if anthropic.is_anthropic_path(request.url.path):  # e.g. a GET of /v1/messages: 405 in Anthropic's shape
        response: Response = anthropic.error_response(status, str(detail))
        return response
    return error_response(status, str(detail))


async def _any_exception(request: Request, exc: Exception) -> Response:
    return response_for_error(exc)


async def _generation(request: Request, method: str) -> Response:
    body = await read_json(request)
    result = await on_model(request, body, lambda engine: getattr(engine, method)(**body))
    if isinstance(result, dict):
        return Response(finite_json(result), media_type="application/json")
    return StreamingResponse(sse_events(result), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- routes ----------------------------------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    state = server_state(request)
    if not state.ready():
        return JSONResponse({"status": "error" if state.load_error else "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


def model_entry(state: ServerState, name: str, engine: Engine | None, status: str = "loaded",
                aliases: tuple[str, ...] = ()) -> dict[str, Any]:
    """One ``/v1/models`` entry: OpenAI's fields, the state (llama-server's ``status.value``: ``loaded``,
    ``loading``, ``unloaded``, ``unloading``), other names, and the slots' sizes while loaded."""
    entry: dict[str, Any] = {"id": name, "object": "model", "created": state.created, "owned_by": "llmfw",
                             "aliases": list(aliases), "status": {"value": status}}
    if engine is not None:
        entry["meta"] = {"n_ctx": engine.ctx.n_ctx, "n_ctx_slot": engine.n_ctx_slot, "parallel": engine.parallel,
                         "n_vocab": engine.model.n_vocab}
    return entry


async def models(request: Request) -> Response:
    state = server_state(request)
    if state.router is None:
        engine = state.ready_engine()
        data = [model_entry(state, engine.alias, engine)]
    else:
        data = [model_entry(state, model.name, engine, status, model.aliases)
                for model, status, engine in state.router.listing()]
    return JSONResponse({"object": "list", "data": data})


async def completions(request: Request) -> Response:
    return await _generation(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _generation(request, "chat_completion")


async def embeddings(request: Request) -> Response:
    """``/v1/embeddings``: the engine's :meth:`~llmfw.serving.Engine.embeddings` (between decode steps)."""
    body = await read_json(request)
    result = await on_model(request, body, lambda engine: engine.embeddings(**body))
    return Response(finite_json(result), media_type="application/json")


async def tokenize(request: Request) -> Response:
    raw = await read_json(request)
    body = parse_request(TokenizeBody, raw)  # type: ignore[arg-type]
    tokens = await on_model(request, raw, lambda engine: engine.model.vocab.tokenize(
        body.content, add_special=body.add_special, parse_special=body.parse_special))
    return JSONResponse({"tokens": list(tokens)})


def _detokenized(engine: Engine, tokens: list[int]) -> str:
    bad = [t for t in tokens if not 0 <= t < engine.model.n_vocab]
    if bad:
        raise RequestError(f"token {bad[0]} is outside the vocabulary (0..{engine.model.n_vocab - 1})", "tokens")
    text: str = engine.model.vocab.detokenize(tokens)
    return text


async def detokenize(request: Request) -> Response:
    raw = await read_json(request)
    body = parse_request(DetokenizeBody, raw)  # type: ignore[arg-type]
    return JSONResponse({"content": await on_model(request, raw, lambda engine: _detokenized(engine, body.tokens))})


async def metrics(request: Request) -> Response:
    state = server_state(request)
    families = state.router.metric_families if state.router is not None else state.ready_engine().metrics
    return Response(families.exposition(), media_type=CONTENT_TYPE)


def _guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Turn a handler's errors into OpenAI-shaped responses (starlette's own handlers would give a 500)."""
    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        try:
            response: Response = await handler(request)
            return response
        except BadBody as exc:
            return error_response(exc.status, exc.message)
        except Exception as exc:  # noqa: BLE001 - every failure answers in the OpenAI shape
            return response_for_error(exc)
    return run


ROUTES = [
    ("/health", health, ["GET"]),
    ("/v1/models", models, ["GET"]),
    ("/v1/completions", completions, ["POST"]),
    ("/v1/chat/completions", chat_completions, ["POST"]),
    ("/v1/embeddings", embeddings, ["POST"]),
    ("/tokenize", tokenize, ["POST"]),
    ("/detokenize", detokenize, ["POST"]),
    ("/metrics", metrics, ["GET"]),
    # Anthropic's Messages API (its own error shape: llmfw.serving.anthropic)
    ("/v1/messages", anthropic.messages_endpoint, ["POST"]),
    ("/v1/messages/count_tokens", anthropic.count_tokens_endpoint, ["POST"]),
    ("/openapi.json", openapi_endpoint, ["GET"]),
]


# -- outermost ASGI layer: replica header and API key ------------------------------------------------------------------
class ReplicaAndAuth:
    """Adds ``x-llmfw-replica`` to every HTTP response and checks the API key on protected paths."""

    def __init__(self, app: Any, state: ServerState):
        self.app, self.state = app, state
        self._header = (REPLICA_HEADER.encode(), state.replica.encode())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_replica(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        if not self._authorized(scope):
            message = "a valid API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
            headers = {"WWW-Authenticate": "Bearer"}
            response = anthropic.error_response(401, message, headers) \
                if anthropic.is_anthropic_path(scope.get("path", "")) else \
                error_response(401, message, code="invalid_api_key", headers=headers)
            await response(scope, receive, send_with_replica)
            return
        await self.app(scope, receive, send_with_replica)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        key = self.state.api_key
        path = scope.get("path", "")
        if not key or not (path.startswith("/v1/") or path in PROTECTED):
            return True
        given, given_key = b"", b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
            elif name == b"x-api-key":  # Anthropic's header, beside OpenAI's Bearer
                given_key = value
        bearer = hmac.compare_digest(given, b"Bearer " + key.encode())
        return hmac.compare_digest(given_key, key.encode()) or bearer


def create_app(engine: Engine | Callable[[], Engine] | ModelRouter, *, api_key: str | None = None,
               cors_origins: list[str] | None = None, thread_tokens: int | None = None, webui: bool = True,
               on_load_error: Callable[[str], None] | None = None) -> Any:
    """The ASGI app. ``engine``: a ready Engine, a callable that builds one (run in a thread at startup,
    /health answers 503 until it returns), or a :class:`~llmfw.serving.router.ModelRouter` serving several
    models (each loaded on first use; /health answers 200 at once). ``webui``: serve the browser chat page at
    ``/`` (:mod:`llmfw.serving.webui`). ``on_load_error`` hears why building the engine failed (``llmfw serve``
    then exits); without it the failure is logged with its traceback and every request answers 503."""
    state = ServerState(api_key=api_key or None, router=engine if isinstance(engine, ModelRouter) else None)

    def load() -> None:
        try:
            state.engine = engine()  # type: ignore[operator]
        except Exception as exc:  # reported by /health and every request
            state.load_error = str(exc) or type(exc).__name__
            if on_load_error is None:
                log.exception("loading the model failed")
            else:
                log.debug("loading the model failed", exc_info=exc)
                on_load_error(state.load_error)

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, thread_tokens or 0)
        if isinstance(engine, Engine):
            state.engine = engine
        elif state.router is None:
            threading.Thread(target=load, name="llmfw-load", daemon=True).start()
        yield

    middleware = []
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                                     allow_headers=["*"], expose_headers=[REPLICA_HEADER]))
    routes: list[Any] = [Route(path, _guarded(fn), methods=methods) for path, fn, methods in ROUTES]
    if webui:
        routes += webui_routes()
    app = Starlette(routes=routes,
                    middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_exception, Exception: _any_exception})
    app.state.llmfw = state
    wrapped = ReplicaAndAuth(app, state)
    return wrapped



def pipeline_app(pipeline: Any, *, eager: bool = False, load_model: Callable[[], Any] | None = None,
                 on_ready: Callable[[Engine], None] | None = None,
                 on_load_error: Callable[[str], None] | None = None) -> Any:
    """The app for a pipeline's ``server`` settings: its engine over ``load_model()`` (default: the pipeline's
    own model). ``eager`` builds the engine now (a Ray replica, ready only once loaded); otherwise it loads in
    the background while ``/health`` answers 503 (``llmfw serve``). ``on_ready`` sees the engine once built."""
    def build() -> Engine:
        engine = pipeline_engine(pipeline, (load_model or pipeline.load_model)(), pipeline.config.server.alias)
        if on_ready is not None:
            on_ready(engine)
        return engine

    return _app_for(pipeline, build() if eager else build, on_load_error=on_load_error)


def router_app(pipeline: Any, models: list[ServedModel], report: Callable[[str], None] | None = None) -> Any:
    """The app serving ``models`` (checked by :func:`~llmfw.serving.startup.preflight_models`) with the
    pipeline's settings, each loaded on first use, at most ``server.models_max`` at once; ``report`` hears each
    load (with progress) and unload."""
    def build(served: ServedModel, metrics: EngineMetrics) -> Engine:
        own = pipeline.with_model(str(served.path))
        return pipeline_engine(own, own.load_model(progress=load_progress(served.name, report)), served.name,
                               metrics)

    server = pipeline.config.server
    router = ModelRouter(models, build, max_loaded=server.models_max, max_waiting=server.max_queue, report=report)
    return _app_for(pipeline, router)


def pipeline_engine(pipeline: Any, model: Any, alias: str | None, metrics: EngineMetrics | None = None) -> Engine:
    """An engine over ``model`` with the pipeline's ``server``, ``context`` and chat settings."""
    cfg = pipeline.config
    server = cfg.server
    return Engine(model, server.parallel, n_ctx=cfg.context.n_ctx, n_threads=cfg.context.n_threads,
                  max_queue=server.max_queue, alias=alias, chat_template=pipeline.chat_template(),
                  chat_options=chat_options_from_config(pipeline), metrics=metrics)


def _app_for(pipeline: Any, engine: Engine | Callable[[], Engine] | ModelRouter,
             on_load_error: Callable[[str], None] | None = None) -> Any:
    server = pipeline.config.server
    # a worker thread per queued or running request of every engine that may be loaded at once (and, with several
    # models, per request waiting for its model)
    threads = server.max_queue + server.parallel + 16
    if isinstance(engine, ModelRouter):
        threads += (server.max_queue + server.parallel) * ((engine.max_loaded or len(engine.names)) - 1) \
            + engine.max_waiting
    return create_app(engine, api_key=read_api_key(server), cors_origins=server.cors_origin,
                      thread_tokens=threads, webui=server.webui,
                      on_load_error=on_load_error)


def read_api_key(server: Any) -> str | None:
    """The API key of the ``server`` settings (``api_key`` or the first line of ``api_key_file``), or None."""
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
