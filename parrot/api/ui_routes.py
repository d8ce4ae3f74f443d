"""The live web view: ``GET /ui`` (the page), ``/ui/static/*`` (its JS / CSS, package data), and its data:
``GET /ui/api/snapshot`` (one JSON snapshot) and ``GET /ui/api/events`` (an SSE stream of snapshots).

Auth: the page and its static files are public (they hold no data; :data:`PUBLIC_PATHS` are exempted from the
tenant middleware). Every data route goes through the middleware like the API: with keys configured it needs
``Authorization: Bearer <key>`` and shows that tenant's view (:mod:`parrot.api.ui.snapshot`). The page asks
for the key, keeps it in ``sessionStorage`` and sends it as that header; it reads the stream with ``fetch``
and a ``ReadableStream`` (a browser ``EventSource`` cannot send headers), so a key never appears in a URL
or an access log line.

The stream (one :class:`~parrot.http_edge.EventStreamResponse`, which stops at once when the client goes)::

    snapshot ... (only when something changed, at most one per `interval` seconds)
    {"type": "ping", "at": ...}  when nothing changed for KEEPALIVE_S
    ... after MAX_STREAM_S: [DONE]; the page reconnects (a stream never outlives its bound)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, Response

from parrot.api.tenants import ANONYMOUS
from parrot.api.ui import snapshot
from parrot.common.errors import NotFoundError
from parrot.http_edge import EventStreamResponse
from parrot.manager.manager import Manager

router = APIRouter(prefix="/ui", tags=["ui"])

STATIC_FILES = {"app.js": "text/javascript; charset=utf-8", "dag.js": "text/javascript; charset=utf-8",
                "app.css": "text/css; charset=utf-8"}
# paths served without an API key: the page and its code, never data
PUBLIC_PATHS = ("/ui", "/ui/", *(f"/ui/static/{name}" for name in STATIC_FILES))
KEEPALIVE_S = 15.0
MAX_STREAM_S = 600.0
# a no-store page that loads only its own files (no CDN, no inline script), connects only back here
_HEADERS = {"Cache-Control": "no-store",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                       "script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def _static(name: str) -> str:
    return resources.files("parrot.api.ui").joinpath("static", name).read_text(encoding="utf-8")


def _view(request: Request) -> dict:
    manager: Manager = request.app.state.manager
    tenant = getattr(request.state, "tenant", ANONYMOUS)
    return snapshot.build(manager, tenant.name, open_server=tenant is ANONYMOUS)


@router.get("", response_class=HTMLResponse, include_in_schema=False)
@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page() -> HTMLResponse:
    return HTMLResponse(_static("index.html"), headers=_HEADERS)


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> Response:
    media = STATIC_FILES.get(name)
    if media is None:
        raise NotFoundError(f"no static file {name!r}", param="name")
    return Response(_static(name), media_type=media, headers=_HEADERS)


@router.get("/api/snapshot")
async def ui_snapshot(request: Request) -> dict:
    """The caller's view now: its sessions' DAGs, the engines, its recent requests (docs/api.md, "Live view")."""
    return _view(request)


@router.get("/api/events")
async def ui_events(request: Request, interval: Annotated[float, Query(ge=0.1, le=10.0, description=
                    "seconds between looks; a snapshot is sent only when it changed")] = 0.5) -> Response:
    """Server-sent events: a snapshot whenever it changed (at most one per ``interval``), pings in between."""
    clock = request.app.state.manager.clock

    async def events() -> AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        started = last_sent = loop.time()
        last = None
        while loop.time() - started < MAX_STREAM_S:
            view = _view(request)
            digest = snapshot.fingerprint(view)
            if digest != last:
                last, last_sent = digest, loop.time()
                yield view
            elif loop.time() - last_sent >= KEEPALIVE_S:
                last_sent = loop.time()
                yield {"type": "ping", "at": clock()}
            await asyncio.sleep(interval)

    return EventStreamResponse(events())
