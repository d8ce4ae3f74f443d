"""Pure-ASGI guards in front of every route: the optional API key and the request body size limit.

Both answer with an OpenAI-style error body themselves (they run before routing, so the exception handlers
are not involved). The body limit checks ``Content-Length`` first, then counts the bytes actually received
(chunked uploads, lying headers) while buffering at most ``max_bytes``, and replays the buffered body to the
app; later ``receive()`` calls (disconnect notifications) pass through.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from parrot.common.errors import AuthenticationError, ParrotError, PayloadTooLarge

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


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <api_key>`` on every HTTP route except the exempt paths."""

    def __init__(self, app: ASGIApp, api_key: str, exempt_paths: tuple[str, ...] = ("/health",)) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._exempt = exempt_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self._exempt:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not secrets.compare_digest(given, self._expected):
            what = "missing" if not given else "invalid"
            await send_error(send, AuthenticationError(f"{what} API key: send 'Authorization: Bearer <key>'",
                                                       param="Authorization"),
                             headers=[(b"www-authenticate", b"Bearer")])
            return
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
