"""The HTTP edge shared by the API server and the engine server: typed errors out, server-sent events out.

Errors (:func:`install_error_handlers`) -- every failure leaves as an OpenAI-style body with its status:

* :class:`ParrotError` -> its ``status_code`` and ``to_body()`` (one handler for the whole hierarchy);
* request validation errors -> 400 ``invalid_request`` naming the offending field in ``param``;
* Starlette HTTP errors (unknown route, wrong method) -> their status, OpenAI-shaped;
* anything else -> 500 ``internal_error``, logged with its traceback (a bug).

Streams (:class:`EventStreamResponse`) -- one ``data: {json}\\n\\n`` event per payload, then ``data: [DONE]``::

    data: {...}\\n\\n  data: {...}\\n\\n  ...  [data: {"error": {...}}\\n\\n]  data: [DONE]\\n\\n

or, with ``named=True`` (OpenAI's Responses API), each event preceded by ``event: <its "type">`` (``error`` for
an error body) and no ``[DONE]``.

Events are ASCII-only JSON (non-ASCII escaped), so no line splitter (httpx's splits on U+2028 and friends)
can cut one in two. The response watches ``receive()`` for ``http.disconnect`` while it streams: a client
that goes away cancels the stream at once (not at the next write), and the payload iterator is closed, which
lets its owner free what it holds (engine contexts, an engine stream; the close is shielded from the
cancellation). An error raised mid-stream becomes one error event (the status line is already sent),
followed by ``[DONE]``.

Whole answers (:func:`cancel_on_disconnect`) -- a non-streaming route awaits its work through the same watch:
the client's ``http.disconnect`` cancels the work (whose cleanup frees what it holds) instead of letting it run
to the end for nobody, and raises :class:`ClientDisconnected` (nothing is sent: the socket is gone). Both call
``on_disconnect`` once, so the caller can count the cancellation with its reason.

This module imports only Starlette/FastAPI and :mod:`parrot.common`, so an engine process does not load the
API app or the manager.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from parrot.common.errors import ParrotError

logger = logging.getLogger(__name__)

T = TypeVar("T")
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


# ---- error bodies and handlers --------------------------------------------------------------------------------
def error_body(message: str, *, error_type: str, code: str, param: str | None = None) -> dict:
    """The OpenAI error shape; the same one :meth:`ParrotError.to_body` produces."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def internal_error_body(exc: BaseException) -> dict:
    """The body for a bug: names the exception type only (its text may hold internals)."""
    return error_body(f"internal server error ({type(exc).__name__})", error_type="server_error",
                      code="internal_error")


async def parrot_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ParrotError)
    if exc.status_code >= 500:
        logger.warning("%s %s -> %d %s: %s", request.method, request.url.path, exc.status_code, exc.code,
                       exc.message)
    retry = getattr(exc, "retry_after_s", None)
    headers = {"Retry-After": str(max(1, math.ceil(retry)))} if retry is not None else None
    return JSONResponse(exc.to_body(), status_code=exc.status_code, headers=headers)


def _loc_name(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or ".".join(str(p) for p in loc)


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    details = "; ".join(f"{_loc_name(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}" for e in errors[:5])
    param = _loc_name(tuple(errors[0].get("loc", ()))) if errors else None
    body = error_body(f"invalid request: {details}", error_type="invalid_request_error", code="invalid_request",
                      param=param)
    return JSONResponse(body, status_code=400)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(exc.detail), error_type=error_type, code=code),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.error("%s %s crashed", request.method, request.url.path, exc_info=exc)
    return JSONResponse(internal_error_body(exc), status_code=500)


async def disconnected_handler(request: Request, exc: Exception) -> Response:
    """Nobody reads this answer (the client is gone): 499, nginx's "client closed request", for the access log."""
    return Response(status_code=499)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ParrotError, parrot_error_handler)
    app.add_exception_handler(ClientDisconnected, disconnected_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)


# ---- server-sent events ---------------------------------------------------------------------------------------
DONE = b"data: [DONE]\n\n"


def encode_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def encode_named_event(payload: dict) -> bytes:
    """``event: <type>`` then the data line; an error body (no ``type``) is an ``error`` event."""
    return b"event: " + str(payload.get("type", "error")).encode() + b"\n" + encode_event(payload)


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready; its work was cancelled. Nothing can be sent back
    (raised out of the route, it ends the request without a response the client could read)."""


async def _disconnect(receive: Receive) -> None:
    """Return when ``receive`` delivers ``http.disconnect`` (the body was already read, so nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass  # e.g. an empty trailing http.request message: keep listening


def _retrieve(task: asyncio.Future) -> None:
    """Mark the task's outcome as seen (nobody awaits it any more; asyncio would log it as never retrieved)."""
    if not task.cancelled():
        task.exception()


async def cancel_on_disconnect(request: Request, work: Awaitable[T], *,
                               on_disconnect: Callable[[], None] | None = None) -> T:
    """Await ``work``; if the client disconnects first, cancel it, wait for its cleanup (frees, releases) and
    raise :class:`ClientDisconnected`, after calling ``on_disconnect`` if the work was indeed cut short."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the route itself is cancelled (server shutdown): so is its work
        task.cancel()
        task.add_done_callback(_retrieve)
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    logger.info("%s %s: client disconnected; cancelling its work", request.method, request.url.path)
    task.cancel()
    await asyncio.wait((task,))  # its cleanup (shielded frees) runs to the end
    _retrieve(task)  # it may have ended on its own meanwhile: nobody reads that outcome
    if task.cancelled() and on_disconnect is not None:
        on_disconnect()
    raise ClientDisconnected(f"{request.method} {request.url.path}")


class EventStreamResponse(StreamingResponse):
    """An SSE stream of ``events`` (JSON-able dicts) that stops at once when the client disconnects.

    ``events`` is always closed (``aclose``) when the response ends, however it ends; ``disconnected`` tells
    afterwards whether the client went away first (``on_disconnect`` is called when it does). ``named``:
    Responses-API framing (see the module docstring)."""

    def __init__(self, events: AsyncIterator[dict], *, named: bool = False,
                 on_disconnect: Callable[[], None] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._encode = encode_named_event if named else encode_event
        self._done = b"" if named else DONE
        self._on_disconnect = on_disconnect
        self._complete = False  # the last byte is being sent: a disconnect from now on is the normal end
        self.disconnected = False

    def _went_away(self) -> None:
        if not self.disconnected and not self._complete:
            logger.info("client disconnected; stopping the stream")
            self.disconnected = True
            if self._on_disconnect is not None:
                self._on_disconnect()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self._went_away()
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            try:
                try:
                    async for payload in self._events:
                        await send({"type": "http.response.body", "body": self._encode(payload), "more_body": True})
                except ParrotError as e:
                    logger.info("stream failed: %s: %s", e.code, e.message)
                    await send({"type": "http.response.body", "body": self._encode(e.to_body()), "more_body": True})
                except Exception as e:  # a bug: log it, tell the client, end the stream cleanly
                    logger.exception("stream crashed")
                    await send({"type": "http.response.body", "body": self._encode(internal_error_body(e)),
                                "more_body": True})
                await send({"type": "http.response.body", "body": self._done, "more_body": True})
                self._complete = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                self._went_away()  # the socket is gone
            finally:
                with anyio.CancelScope(shield=True):
                    aclose = getattr(self._events, "aclose", None)
                    if aclose is not None:
                        await aclose()
                tg.cancel_scope.cancel()
