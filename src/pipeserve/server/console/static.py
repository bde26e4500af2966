"""The console's page at `/`. Agent CLIs probe `HEAD /` and JSON clients may GET it:
a client that asks for JSON (and not HTML) gets the small service document instead."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import falcon

STATIC_DIR = Path(__file__).resolve().parent / "static"
# The page runs only its own files and talks only to this server: model text that got
# past the renderer still could not load or run anything.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'none'"
)
SERVICE = {"service": "pipeserve", "health": "/health", "models": "/v1/models", "console": "/"}


@cache
def index_html() -> bytes:
    return (STATIC_DIR / "index.html").read_bytes()


class ConsoleIndex:
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        accept = req.accept or ""
        if "application/json" in accept and "text/html" not in accept:
            resp.media = SERVICE
            return
        resp.content_type = falcon.MEDIA_HTML
        resp.set_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        resp.set_header("X-Content-Type-Options", "nosniff")
        resp.set_header("Cache-Control", "no-cache")
        resp.data = index_html()

    def on_head(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = falcon.MEDIA_HTML
