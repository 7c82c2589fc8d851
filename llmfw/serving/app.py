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
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..core.errors import ChatTemplateError, ConfigError, ContextError, EngineBusy, EngineLoading, EngineStopped, \
    LLMFWError, RequestError, SamplerError, TokenizerError
from . import anthropic
from .chat_options import chat_options_from_config
from .engine import Engine
from .metrics import CONTENT_TYPE
from .openapi import openapi_endpoint
from .protocol import parse_request
from .webui import webui_routes

log = logging.getLogger(__name__)

#: largest request body, bytes (larger ones answer 413 before being read further)
MAX_BODY_BYTES = 2 * 1024 * 1024
#: seconds a client is told to wait when the queue is full
RETRY_AFTER_S = 1
#: paths that need the API key (when one is set): these plus everything under /v1/
PROTECTED = ("/tokenize", "/detokenize", "/metrics")
REPLICA_HEADER = "x-llmfw-replica"


# -- errors ----------------------------------------------------------------------------------------------------
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 501: "not_implemented_error",
          503: "unavailable_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


#: project errors that mean "the request is wrong" (400)
BAD_REQUEST = (RequestError, ChatTemplateError, TokenizerError, ContextError, SamplerError)


def response_for_error(exc: BaseException) -> JSONResponse:
    """The HTTP answer for an error raised while serving a request (never a traceback)."""
    if isinstance(exc, BAD_REQUEST):
        return error_response(400, str(exc), getattr(exc, "param", None))
    if isinstance(exc, EngineBusy):
        return error_response(503, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineLoading):
        return error_response(503, str(exc), code="loading")
    if isinstance(exc, EngineStopped):
        return error_response(503, str(exc), code="unavailable")
    if isinstance(exc, LLMFWError):
        return error_response(500, str(exc))
    log.exception("unexpected error while serving a request", exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}")


async def _http_exception(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    if status == 404:
        detail = f"unknown path {request.url.path}"
    return error_response(status, str(detail))


async def _any_exception(request: Request, exc: Exception) -> Response:
    return response_for_error(exc)


# -- state -------------------------------------------------------------------------------------------------------
@dataclass
class ServerState:
    """The engine once loaded (None while loading) and the settings the handlers need."""

    api_key: str | None = None
    replica: str = field(default_factory=lambda: uuid.uuid4().hex)
    engine: Engine | None = None
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def ready_engine(self) -> Engine:
        if self.engine is None:
            if self.load_error:
                raise EngineStopped(f"the model failed to load: {self.load_error}")
            raise EngineLoading("the model is still loading")
        return self.engine


def _state(request: Request) -> ServerState:
    return request.app.state.llmfw


# -- request bodies ------------------------------------------------------------------------------------------------
class _BadBody(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, bounded by MAX_BODY_BYTES (413), valid JSON and an object (400)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _BadBody(413, f"the request body has {declared} bytes; the limit is {MAX_BODY_BYTES}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _BadBody(413, f"the request body is larger than the limit of {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
    except RecursionError:
        raise _BadBody(400, "the request body is JSON nested too deeply") from None
    except ValueError as exc:  # includes UnicodeDecodeError
        raise _BadBody(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _BadBody(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def _finite_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


async def _in_thread(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await anyio.to_thread.run_sync(functools.partial(func, *args, **kwargs))


def _next_chunk(stream: Any) -> dict[str, Any] | None:
    return next(stream, None)


def _openai_event(chunk: dict[str, Any]) -> str:
    return f"data: {_finite_json(chunk)}\n\n"


def _openai_error_event(exc: BaseException) -> str:
    return f"data: {response_for_error(exc).body.decode()}\n\n"


async def sse_events(stream: Any, render: Callable[[dict[str, Any]], str] = _openai_event,
                     render_error: Callable[[BaseException], str] = _openai_error_event,
                     done: str = "data: [DONE]\n\n") -> AsyncIterator[str]:
    """``data: {chunk}`` per chunk, then ``data: [DONE]``; a failure mid-stream becomes an error event (another
    API's events: ``render``, ``render_error``, ``done``). A client that goes away cancels this generator, which
    closes the stream (the engine frees the slot next step)."""
    try:
        while True:
            chunk = await anyio.to_thread.run_sync(_next_chunk, stream, abandon_on_cancel=True)
            if chunk is None:
                break
            yield render(chunk)
        if done:
            yield done
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, as llama-server does
        yield render_error(exc)
    finally:
        stream.close()


async def _generation(request: Request, method: str) -> Response:
    engine = _state(request).ready_engine()
    body = await read_json(request)
    result = await _in_thread(getattr(engine, method), **body)
    if isinstance(result, dict):
        return Response(_finite_json(result), media_type="application/json")
    return StreamingResponse(sse_events(result), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- routes ----------------------------------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    state = _state(request)
    if state.engine is None:
        return JSONResponse({"status": "error" if state.load_error else "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def models(request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    return JSONResponse({"object": "list", "data": [
        {"id": engine.alias, "object": "model", "created": state.created, "owned_by": "llmfw",
         "meta": {"n_ctx": engine.ctx.n_ctx, "n_ctx_slot": engine.n_ctx_slot, "parallel": engine.parallel,
                  "n_vocab": engine.model.n_vocab}}]})


async def completions(request: Request) -> Response:
    return await _generation(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _generation(request, "chat_completion")


async def embeddings(request: Request) -> Response:
    """``/v1/embeddings``: the engine's :meth:`~llmfw.serving.Engine.embeddings` (between decode steps)."""
    engine = _state(request).ready_engine()
    body = await read_json(request)
    result = await _in_thread(engine.embeddings, **body)
    return Response(_finite_json(result), media_type="application/json")


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    content: str
    add_special: bool = False
    parse_special: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int] = Field(max_length=1 << 20)


async def tokenize(request: Request) -> Response:
    engine = _state(request).ready_engine()
    body = parse_request(TokenizeBody, await read_json(request))  # type: ignore[arg-type]
    tokens = await _in_thread(engine.model.vocab.tokenize, body.content, add_special=body.add_special,
                              parse_special=body.parse_special)
    return JSONResponse({"tokens": list(tokens)})


async def detokenize(request: Request) -> Response:
    engine = _state(request).ready_engine()
    body = parse_request(DetokenizeBody, await read_json(request))  # type: ignore[arg-type]
    bad = [t for t in body.tokens if not 0 <= t < engine.model.n_vocab]
    if bad:
        raise RequestError(f"token {bad[0]} is outside the vocabulary (0..{engine.model.n_vocab - 1})", "tokens")
    return JSONResponse({"content": await _in_thread(engine.model.vocab.detokenize, body.tokens)})


async def metrics(request: Request) -> Response:
    engine = _state(request).ready_engine()
    return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE)


def _guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Turn a handler's errors into OpenAI-shaped responses (starlette's own handlers would give a 500)."""
    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except _BadBody as exc:
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

        async def send_with_replica(message: dict[str, Any]) -> None:
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


def create_app(engine: Engine | Callable[[], Engine], *, api_key: str | None = None,
               cors_origins: list[str] | None = None, thread_tokens: int | None = None, webui: bool = True,
               on_load_error: Callable[[str], None] | None = None) -> Any:
    """The ASGI app. ``engine``: a ready Engine, or a callable that builds one (run in a thread at startup,
    /health answers 503 until it returns). ``webui``: serve the browser chat page at ``/``
    (:mod:`llmfw.serving.webui`). ``on_load_error`` hears why building the engine failed (``llmfw serve`` then
    exits); without it the failure is logged with its traceback and every request answers 503."""
    state = ServerState(api_key=api_key or None)

    def load() -> None:
        try:
            state.engine = engine()  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001 - reported by /health and every request
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
        else:
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
    wrapped.state = state  # type: ignore[attr-defined]
    return wrapped



def pipeline_app(pipeline: Any, *, eager: bool = False, load_model: Callable[[], Any] | None = None,
                 on_ready: Callable[[Engine], None] | None = None,
                 on_load_error: Callable[[str], None] | None = None) -> Any:
    """The app for a pipeline's ``server`` settings: its engine over ``load_model()`` (default: the pipeline's
    own model). ``eager`` builds the engine now (a Ray replica, ready only once loaded); otherwise it loads in
    the background while ``/health`` answers 503 (``llmfw serve``). ``on_ready`` sees the engine once built."""
    cfg = pipeline.config
    server = cfg.server

    def build() -> Engine:
        model = (load_model or pipeline.load_model)()
        engine = Engine(model, server.parallel, n_ctx=cfg.context.n_ctx, n_threads=cfg.context.n_threads,
                        max_queue=server.max_queue, alias=server.alias,
                        chat_template=pipeline.chat_template(), chat_options=chat_options_from_config(pipeline))
        if on_ready is not None:
            on_ready(engine)
        return engine

    return create_app(build() if eager else build, api_key=read_api_key(server), cors_origins=server.cors_origin,
                      thread_tokens=server.max_queue + server.parallel + 16, webui=server.webui,
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
