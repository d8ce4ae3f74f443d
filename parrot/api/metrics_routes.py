"""``GET /metrics``: the manager's Prometheus metrics (text exposition format; parrot.manager.metrics).

Behind the same tenant middleware as every other route: with API keys configured a scrape must send
``Authorization: Bearer <key>`` (Prometheus: ``authorization: {credentials: <key>}`` in the scrape config) and counts
toward that key's request rate; an open server serves it to anyone.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from parrot.protocol.metrics import CONTENT_TYPE

router = APIRouter(tags=["ops"])


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.manager.metrics.render(), media_type=CONTENT_TYPE)
