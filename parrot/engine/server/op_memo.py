"""Idempotent fills on the engine: the result of each recent fill, kept by its ``op_id``.

The manager sends every fill with a fresh ``op_id`` and repeats the same id when it retries the fill after a lost
answer (a reset connection). A fill is not idempotent by itself (filling a context appends), so the engine runs each
op id once::

    run(op_id, key, work)
      op_id unknown                  -> start work as its own task (a dropped connection does not cancel it), keep it
      op_id known, same key          -> wait for that task: its result or its error (applied once, answered twice)
      op_id known, another key       -> OpIdConflict (409): an id names one fill

``key`` fingerprints the fill (context, parent, tokens). Entries are dropped ``ttl_s`` after the op finished, and
the oldest finished ones beyond ``max_entries`` (a retry comes within seconds, not minutes). The clock is passed in.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from parrot.common.errors import OpIdConflict


@dataclass
class _Entry:
    key: Hashable
    task: asyncio.Task
    finished_at: float | None = field(default=None)


class OpMemo:
    def __init__(self, *, ttl_s: float = 300.0, max_entries: int = 16_384,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # insertion order = age
        self.replays = 0  # answers given from an earlier run of the same op id

    def __len__(self) -> int:
        return len(self._entries)

    async def run(self, op_id: str, key: Hashable, work: Callable[[], Awaitable[Any]]) -> Any:
        """``await work()`` once per ``op_id``; later calls with that id get the same result or exception."""
        self._collect()
        entry = self._entries.get(op_id)
        if entry is not None:
            if entry.key != key:
                raise OpIdConflict(f"op_id {op_id!r} was already used for another fill", param="op_id")
            self.replays += 1
        else:
            entry = _Entry(key, asyncio.ensure_future(work()))
            entry.task.add_done_callback(lambda _t, e=entry: setattr(e, "finished_at", self._clock()))
            self._entries[op_id] = entry
        # shielded: a caller that goes away (its connection dropped) leaves the op running for its retry
        return await asyncio.shield(entry.task)

    def _collect(self) -> None:
        """Drop finished entries from the oldest on while they are expired or beyond ``max_entries``."""
        now = self._clock()
        while self._entries:
            op, e = next(iter(self._entries.items()))
            over = len(self._entries) > self._max
            if e.finished_at is None or (not over and now - e.finished_at <= self._ttl_s):
                return
            del self._entries[op]
