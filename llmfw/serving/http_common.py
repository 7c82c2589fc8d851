"""What every HTTP front of the server shares (the OpenAI routes in :mod:`.app`, Anthropic's in :mod:`.anthropic`):
the OpenAI-shaped errors ``{"error": {"message", "type", "param", "code"}}`` and the status each project error
answers with, the server's state on the app, reading a bounded JSON body, and server-sent events."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..core.errors import ChatTemplateError, ContextError, EngineBusy, EngineLoading, EngineStopped, LLMFWError, \
    RequestError, SamplerError, TokenizerError, UnknownModel
from .engine import Engine
from .router import LeasedStream, ModelRouter

log = logging.getLogger(__name__)

#: largest request body, bytes (larger ones answer 413 before being read further)
MAX_BODY_BYTES = 2 * 1024 * 1024
#: seconds a client is told to wait when the queue is full
RETRY_AFTER_S = 1
#: the OpenAI error ``type`` of each status
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
    if isinstance(exc, UnknownModel):
        return error_response(404, str(exc), "model", code="model_not_found")
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


# -- state -------------------------------------------------------------------------------------------------------
@dataclass
class ServerState:
    """The engine once loaded (None while loading) — or, with several models, the router that routes each
    request to its model's engine — and the settings the handlers need."""

    api_key: str | None = None
    replica: str = field(default_factory=lambda: uuid.uuid4().hex)
    engine: Engine | None = None
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    router: ModelRouter | None = None

    def ready_engine(self) -> Engine:
        if self.engine is None:
            if self.load_error:
                raise EngineStopped(f"the model failed to load: {self.load_error}")
            raise EngineLoading("the model is still loading")
        return self.engine

    def with_engine(self, model: Any, work: Callable[[Engine], Any]) -> Any:
        """``work(engine)`` on the engine of the model a request names (run in a worker thread: it may load the
        model). One model: its engine, whatever the name (llama-server's rule). Several: the router's lease on
        the named model, held until ``work`` returns — or, when it returns a stream, until the stream ends."""
        if self.router is None:
            return work(self.ready_engine())
        lease = self.router.acquire(model)
        try:
            result = work(lease.engine)
        except BaseException:
            lease.release()
            raise
        if isinstance(result, Iterator):  # a stream: the lease goes with it
            return LeasedStream(result, lease)
        lease.release()
        return result

    def ready(self) -> bool:
        return self.router is not None or self.engine is not None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the engine (or every model's): running requests end with an error."""
        if self.engine is not None:
            self.engine.close(timeout)
        if self.router is not None:
            self.router.close(timeout)


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.llmfw
    return state


# -- request bodies ------------------------------------------------------------------------------------------------
class BadBody(Exception):
    """A request body refused before it is parsed: its status (400, 413) and message."""

    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, bounded by MAX_BODY_BYTES (413), valid JSON and an object (400)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BadBody(413, f"the request body has {declared} bytes; the limit is {MAX_BODY_BYTES}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadBody(413, f"the request body is larger than the limit of {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
    except RecursionError:
        raise BadBody(400, "the request body is JSON nested too deeply") from None
    except ValueError as exc:  # includes UnicodeDecodeError
        raise BadBody(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadBody(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def finite_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


async def in_thread(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await anyio.to_thread.run_sync(functools.partial(func, *args, **kwargs))


async def on_model(request: Request, body: dict[str, Any], work: Callable[[Engine], Any]) -> Any:
    """``work(engine)`` in a worker thread on the engine of the model the body names (with several models the
    router's: it may load the model first)."""
    return await in_thread(server_state(request).with_engine, body.get("model"), work)


def _openai_event(chunk: dict[str, Any]) -> str:
    return f"data: {finite_json(chunk)}\n\n"


def _openai_error_event(exc: BaseException) -> str:
    return f"data: {bytes(response_for_error(exc).body).decode()}\n\n"


def _pump(stream: Any, render: Callable[[dict[str, Any]], str], render_error: Callable[[BaseException], str],
          done: str, put: Callable[[str | None], None]) -> None:
    """Read and render the whole stream (blocking on the engine), handing each event's text to ``put``; None
    ends it."""
    try:
        for chunk in stream:
            put(render(chunk))
        if done:
            put(done)
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, as llama-server does
        put(render_error(exc))
    finally:
        put(None)


async def sse_events(stream: Any, render: Callable[[dict[str, Any]], str] = _openai_event,
                     render_error: Callable[[BaseException], str] = _openai_error_event,
                     done: str = "data: [DONE]\n\n") -> AsyncIterator[str]:
    """``data: {chunk}`` per chunk, then ``data: [DONE]``; a failure mid-stream becomes an error event (another
    API's events: ``render``, ``render_error``, ``done``). A client that goes away cancels this generator, which
    closes the stream (the engine frees the slot next step).

    One thread per response reads and renders the stream and hands the texts to the event loop: a token costs
    the loop one wake-up, not a worker-thread round trip per chunk, so little Python runs beside the engine."""
    loop = asyncio.get_running_loop()
    texts: asyncio.Queue[str | None] = asyncio.Queue()

    def put(text: str | None) -> None:
        try:
            loop.call_soon_threadsafe(texts.put_nowait, text)
        except RuntimeError:  # the loop is closed: nobody reads any more
            pass

    threading.Thread(target=_pump, args=(stream, render, render_error, done, put), name="llmfw-sse",
                     daemon=True).start()
    try:
        while (text := await texts.get()) is not None:
            yield text
    finally:
        stream.close()
