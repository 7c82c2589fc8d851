"""A real uvicorn server on 127.0.0.1 for the serving tests (shared by test_serving*.py)."""
from __future__ import annotations

import socket
import threading
import time

import httpx

#: generous: the machine running the suite may be busy (no serving test measures speed)
TIMEOUT = 300


def get(url: str, **kw) -> httpx.Response:
    return httpx.get(url, timeout=TIMEOUT, **kw)


def post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, timeout=TIMEOUT, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving an app in a thread, on a free port."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                return
            time.sleep(0.02)
        raise RuntimeError("uvicorn did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_engine(model, api_key=None, **engine_kwargs):
    """A fixture body (``yield from serve_engine(model, ...)``): an Engine over ``model`` behind a LiveServer."""
    from llmfw.serving import Engine
    from llmfw.serving.app import create_app

    with Engine(model, **engine_kwargs) as engine:
        live = LiveServer(create_app(engine, api_key=api_key))
        yield live
        live.stop()
