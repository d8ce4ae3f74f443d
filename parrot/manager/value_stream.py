"""Streaming Semantic Variables: the pieces of a value while it is generated, for any number of readers.

Every :class:`~parrot.manager.graph.Variable` owns one :class:`ValueStream`, written only by the executor (the
variable's producer) and read by :func:`follow` (one per ``GET .../variables/{vid}/stream``)::

    executor:  generate_stream chunks -> OutputSink.push (lead spaces held back) -> ValueStream.append
    graph:     materialize / fail_variable -> ValueStream.wake      (the end: readers see var.status)
    reader:    follow(var): pieces[0:n] (the log so far), then each new piece, then the final value or the error

Invariants:

* the log is the raw generated text of the output, in order: no stop string (the engine holds back text that
  could begin one, :mod:`parrot.engine.runtime.stopping`), without the template's moved lead spaces (as the value);
  with no transforms ``"".join(pieces) == value``; with transforms the value is ``transforms(join(pieces))``
  (the final event carries it). Memory is the text itself (bounded by the output's ``max_tokens``); a reader
  that falls behind gets what it missed joined into one event, so a slow reader never holds the producer back;
* a variable that was never streamed (set by the client, a native function's output, a constrained output,
  an output replayed after failover) streams its value as one piece when it becomes ready;
* after a failover restart the regenerated text is matched against the log: the part readers already have is
  not sent again. Only a sampled (non-greedy) output can diverge there; the log then stops growing and the
  final event's value is authoritative (logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from parrot.common.errors import StepFailed
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.protocol.interface import EngineClient, GenerateResult, OpHint

if TYPE_CHECKING:
    from parrot.manager.graph import Variable

logger = logging.getLogger(__name__)

KEEPALIVE_S = 15.0  # a reader with nothing new for this long gets a keepalive event (clients time out at 45 s)


class ValueStream:
    """The piece log of one variable and the event its readers wait on. Event-loop only (not thread-safe)."""

    __slots__ = ("pieces", "_chars", "_replay", "_diverged", "_changed")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self._chars = 0  # len("".join(pieces))
        self._replay: int | None = None  # chars of the log the current run has re-generated (after a restart)
        self._diverged = False
        self._changed: asyncio.Event | None = None  # created by the first reader: unread variables cost nothing

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def begin(self) -> None:
        """A generation of the value starts; if an earlier run already streamed pieces, re-match from 0."""
        if self._chars:
            self._replay, self._diverged = 0, False

    def append(self, text: str) -> None:
        if not text or self._diverged:
            return
        if self._replay is not None:
            log = self.text
            overlap = min(len(text), self._chars - self._replay)
            if text[:overlap] != log[self._replay:self._replay + overlap]:
                self._diverged = True
                logger.warning("a restarted generation diverged from the %d streamed chars; the final value is "
                               "authoritative", self._chars)
                return
            self._replay += overlap
            text = text[overlap:]
            if self._replay < self._chars or not text:
                return
            self._replay = None
        self.pieces.append(text)
        self._chars += len(text)
        self.wake()

    def wake(self) -> None:
        """Wake every reader (a new piece, or the variable became READY / FAILED)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def changed(self) -> asyncio.Event:
        """An event set at the next :meth:`wake` (take it before reading the state, then wait on it)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed


class OutputSink:
    """Feeds one generation's chunks into a variable's stream, leaving out the ``lead`` spaces the executor
    strips from the value (they are held back until the text shows whether it starts with them)."""

    def __init__(self, stream: ValueStream, lead: int = 0, *, on_tokens: Callable[[int], None] | None = None) -> None:
        self._stream = stream
        self._lead = lead
        self._head = ""  # text held back while fewer than ``lead`` chars arrived
        self._on_tokens = on_tokens  # told each chunk's token count as it arrives (work done so far)
        stream.begin()

    def tokens(self, n: int) -> None:
        if self._on_tokens is not None and n:
            self._on_tokens(n)

    def push(self, text: str) -> None:
        if self._lead:
            self._head += text
            if len(self._head) < self._lead:
                return
            text, self._head = self._head, ""
            if text.startswith(" " * self._lead):
                text = text[self._lead:]
            self._lead = 0
        self._stream.append(text)

    def close(self) -> None:
        """Generation ended: release held-back text (an output shorter than its lead)."""
        if self._head:
            self._stream.append(self._head)  # shorter than the lead: the value keeps it as it is
            self._head = ""


async def generate_streamed(client: EngineClient, sampling: SamplingParams, context_id: str, sink: OutputSink,
                            clock: Callable[[], float] = time.time, *, hint: OpHint | None = None) -> GenerateResult:
    """``client.generate`` through ``generate_stream``: each chunk's text goes to ``sink`` as it arrives.

    Returns the result ``generate`` would (``ttft_s`` measured here on ``clock`` from the call to the first
    chunk; ``prompt_len`` 0: the executor does not use it; ``constraint_complete`` None: the executor streams
    only outputs without a constraint). An engine error mid-stream raises like ``generate``'s."""
    started = clock()
    first: float | None = None
    ids: list[int] = []
    parts: list[str] = []
    finish: FinishReason | None = None
    stream = client.generate_stream(sampling, context_id, hint=hint)
    try:
        async for chunk in stream:
            if first is None:
                first = clock() - started
            ids.extend(chunk.token_ids)
            sink.tokens(len(chunk.token_ids))
            if chunk.text:
                parts.append(chunk.text)
                sink.push(chunk.text)
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
    finally:
        await stream.aclose()  # an abandoned stream (a cancelled run) stops its generation
    sink.close()
    return GenerateResult(context_id, tuple(ids), "".join(parts), finish or FinishReason.ABORT, 0,
                          ttft_s=first if first is not None else clock() - started, latency_s=clock() - started)


async def follow(var: "Variable", *, on_event: Callable[[], None] = lambda: None,
                 keepalive_s: float = KEEPALIVE_S) -> AsyncIterator[dict]:
    """The events of one reader of ``var`` (the SSE payloads of docs/api.md, "Streaming a variable")::

        {"type": "piece", "var_id", "text"}                      zero or more, in order
        {"type": "keepalive", "var_id"}                          after ``keepalive_s`` with nothing new
        {"type": "done", "var_id", "name", "status": "ready", "value"}   last
      or StepFailed raised (the stream's error event) when the producer or an upstream step failed.

    ``on_event`` runs before each event (the route keeps the session alive with it)."""
    from parrot.manager.graph import VarStatus  # graph imports this module

    stream, sent = var.pieces, 0
    while True:
        changed = stream.changed()
        if sent < len(stream.pieces):
            text = "".join(stream.pieces[sent:])
            sent = len(stream.pieces)
            on_event()
            yield {"type": "piece", "var_id": var.var_id, "text": text}
            continue
        if var.status is VarStatus.READY:
            assert var.value is not None
            if not stream.pieces and var.value:  # never streamed: the value is its one piece
                on_event()
                yield {"type": "piece", "var_id": var.var_id, "text": var.value}
            on_event()
            yield {"type": "done", "var_id": var.var_id, "name": var.name, "status": "ready", "value": var.value}
            return
        if var.status is VarStatus.FAILED:
            assert var.error is not None
            on_event()
            # a fresh exception per reader (the stored one is shared)
            raise StepFailed(var.error.message, cause_code=var.error.cause_code, param="var_id")
        try:
            await asyncio.wait_for(changed.wait(), keepalive_s)
        except asyncio.TimeoutError:
            on_event()
            yield {"type": "keepalive", "var_id": var.var_id}
