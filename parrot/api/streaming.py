"""Server-sent events for the OpenAI streams: ``data: {json}\\n\\n`` per chunk, then ``data: [DONE]``.

The response watches ``receive()`` for ``http.disconnect`` while it streams: a client that goes away
cancels the stream at once (not at the next write), and the event iterator is closed, which frees the engine
contexts (the iterator's cleanup is shielded). An error raised mid-stream becomes one ``data: {"error": ...}``
event (the status line is already sent), followed by ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from parrot.common.errors import ParrotError

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def encode_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    def __init__(self, events: AsyncIterator[dict]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self.disconnected = True
                        logger.info("client disconnected; stopping the stream")
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            try:
                try:
                    async for payload in self._events:
                        await send({"type": "http.response.body", "body": encode_event(payload), "more_body": True})
                except ParrotError as e:
                    logger.info("stream failed: %s: %s", e.code, e.message)
                    await send({"type": "http.response.body", "body": encode_event(e.to_body()), "more_body": True})
                except Exception as e:  # a bug: log it, tell the client, end the stream cleanly
                    logger.exception("stream crashed")
                    body = {"error": {"message": f"internal server error ({type(e).__name__})",
                                      "type": "server_error", "param": None, "code": "internal_error"}}
                    await send({"type": "http.response.body", "body": encode_event(body), "more_body": True})
                await send({"type": "http.response.body", "body": DONE, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                self.disconnected = True  # the socket is gone
            finally:
                with anyio.CancelScope(shield=True):
                    aclose = getattr(self._events, "aclose", None)
                    if aclose is not None:
                        await aclose()
                tg.cancel_scope.cancel()
