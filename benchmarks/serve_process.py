"""A real ``llmfw serve`` process on 127.0.0.1 for the serving benchmarks (soak_serve.py, fuzz_serve.py)."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout: float = 600) -> None:
    """Until ``/health`` answers 200; SystemExit when the server exits or never gets there."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not become ready")


@contextlib.contextmanager
def llmfw_serve(serve_args: list[str], log_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``llmfw serve SERVE_ARGS`` on a free port of 127.0.0.1, ready; yields its URL and process, then stops it.
    The server's output goes to ``log_path``."""
    port = free_port()
    command = [sys.executable, "-m", "llmfw.cli", "serve", "--port", str(port), *serve_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, server)
            yield url, server
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
