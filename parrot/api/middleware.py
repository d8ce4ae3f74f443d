"""Pure-ASGI guards in front of every route: the tenant (API key, request rate) and the request body size limit.

Both answer with an OpenAI-style error body themselves (they run before routing, so the exception handlers
are not involved). The body limit checks ``Content-Length`` first, then counts the bytes actually received
(chunked uploads, lying headers) while buffering at most ``max_bytes``, and replays the buffered body to the
app; later ``receive()`` calls (disconnect notifications) pass through.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from parrot.api.tenants import ANONYMOUS, RateLimiter, TenantKeys
from parrot.common.errors import AuthenticationError, ParrotError, PayloadTooLarge, RateLimited

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, err: ParrotError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(err.to_body()).encode()
    await send({"type": "http.response.start", "status": err.status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class TenantMiddleware:
    """Who is calling (parrot.api.tenants): ``Authorization: Bearer <key>`` names the tenant, put in the request
    state (``request.state.tenant``) for the routes; then the tenant's request rate. Exempt: the probes (``/health``,
    ``/ready``) and the
    engines' own POSTs (registration, heartbeats): engines are not tenants, they prove themselves with the engine
    secret (parrot.api.engine_routes), and an API key never lets anyone register an engine. An open server (no
    keys) calls everyone :data:`~parrot.api.tenants.ANONYMOUS`, still rate-free."""

    def __init__(self, app: ASGIApp, keys: TenantKeys, limiter: RateLimiter,
                 exempt_paths: tuple[str, ...] = ("/health", "/ready"),
                 engine_prefix: str = "/api/v1/engines/") -> None:
        self.app = app
        self._keys = keys
        self._limiter = limiter
        self._exempt = exempt_paths
        self._engine_prefix = engine_prefix

    def _exempted(self, scope: Scope) -> bool:
        path = scope.get("path") or ""
        return path in self._exempt or (scope.get("method") == "POST" and path.startswith(self._engine_prefix))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._exempted(scope):
            await self.app(scope, receive, send)
            return
        if self._keys.open:
            tenant = ANONYMOUS
        else:
            given = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            scheme, _, key = given.partition(" ")
            found = self._keys.lookup(key) if scheme == "Bearer" and key else None
            if found is None:
                what = "missing" if not given else "invalid"
                await send_error(send, AuthenticationError(f"{what} API key: send 'Authorization: Bearer <key>'",
                                                           param="Authorization"),
                                 headers=[(b"www-authenticate", b"Bearer")])
                return
            tenant = found
        wait = self._limiter.retry_after(tenant)
        if wait is not None:
            await send_error(send, RateLimited(f"rate limit of tenant {tenant.name!r} "
                                               f"({tenant.requests_per_minute:g} requests per minute) reached; retry "
                                               f"in {wait:.1f} s", param="requests_per_minute"),
                             headers=[(b"retry-after", str(max(1, math.ceil(wait))).encode())])
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reject request bodies larger than ``max_bytes`` with 413 ``payload_too_large``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: int | str) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.max_bytes:
                await send_error(send, self._too_large(declared))
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending its body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, self._too_large(f"more than {self.max_bytes}"))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
