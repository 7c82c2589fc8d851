"""The browser chat page of ``llmfw serve``: ``/`` and its static files under ``/webui/``.

The page is plain HTML, CSS and JavaScript modules shipped inside the package (``llmfw/serving/webui/static/``),
with no build step and nothing fetched from elsewhere: it talks only to the server it came from
(``/v1/chat/completions`` as server-sent events, ``/v1/models``, ``/metrics``), and its Content-Security-Policy tells
the browser to refuse anything else. The API key, when the server has one, lives in the browser's localStorage only; the page sends it
as ``Authorization: Bearer`` and the server never writes it anywhere. ``llmfw serve --no-webui`` leaves these
routes out (``/`` then answers 404 like any unknown path).
"""
from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

#: the page's files, inside the package (pyproject's package-data ships them)
STATIC_DIR = Path(__file__).with_name("static")
#: where the page's files are served from
PREFIX = "/webui"
#: the page may load and contact only its own server; no inline script, no frames, no plugins
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


async def index(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


class _PageFiles(StaticFiles):
    """The page's scripts and styles, with the same headers as the page (``no-cache``: revalidated, so an
    upgraded server never runs with last version's scripts)."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def webui_routes() -> list[BaseRoute]:
    """The routes the server adds for the page."""
    return [Route("/", index, methods=["GET", "HEAD"]),
            Mount(PREFIX, app=_PageFiles(directory=STATIC_DIR), name="webui")]


def page_url(host: str, port: int) -> str:
    """The address to open in a browser (a wildcard listening address is reached through the loopback)."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
