"""A real uvicorn server on 127.0.0.1 for the serving tests (shared by test_serving*.py)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

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


class ServeCommand:
    """``llmfw serve ARGS --port P`` as a real process (this checkout's ``llmfw``), started and waited for until it
    prints its ``serving`` line; its stderr is read all along (``lines``) so the log never blocks it."""

    def __init__(self, *args: str, cwd: str | Path | None = None):
        root = Path(__file__).resolve().parents[2]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(root), "LLMFW_ONNX_CACHE": "0"}
        self.proc = subprocess.Popen([sys.executable, "-m", "llmfw.cli", "serve", *args, "--port", str(self.port)],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True, cwd=cwd)
        self.lines: list[str] = []
        self._serving = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._serving.wait(TIMEOUT)
        if not any("serving" in line for line in self.lines):
            self.stop()
            raise RuntimeError("llmfw serve did not start:\n" + self.log())

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if "serving" in line:
                self._serving.set()
        self._serving.set()  # the process ended: stop waiting

    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for_log(self, text: str, timeout: float = 60) -> str:
        """The first log line holding ``text`` (waiting for it up to ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines if text in line]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no log line with {text!r}:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        return self.proc.returncode
