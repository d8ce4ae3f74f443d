"""Calls of client-side tools made by flows: the server lists a call once its arguments are ready, a client worker
takes it (``GET .../tool_calls``), runs its own code and answers (``PUT`` the variable, or ``POST .../error``).

Invariants: a call is handed out at most once (taking it moves it from ``pending`` to ``taken``); a call whose
variable is done (answered, failed, cancelled with a speculated branch) is never handed out; waiting takers are
woken when a call is offered. One queue per session; no thread: used from the event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    call_id: str  # the variable the answer goes to
    tool: str
    args: dict[str, str]
    flow_id: str
    on_error: str  # "fail" | "value": what a reported error does (the flow's tool step says)

    def to_json(self) -> dict:
        return {"call_id": self.call_id, "tool": self.tool, "args": dict(self.args), "flow_id": self.flow_id}


class ToolCallQueue:
    def __init__(self) -> None:
        self.pending: dict[str, ToolCall] = {}  # ready, not handed out yet
        self.taken: dict[str, ToolCall] = {}  # handed out, not answered yet
        self._changed = asyncio.Event()

    def offer(self, call: ToolCall) -> None:
        self.pending[call.call_id] = call
        self._changed.set()

    def withdraw(self, call_id: str) -> None:
        self.pending.pop(call_id, None)
        self.taken.pop(call_id, None)

    def answered(self, call_id: str) -> ToolCall | None:
        """The call ``call_id`` got its answer: forget it; returns it (None: not a call of this queue)."""
        return self.taken.pop(call_id, None) or self.pending.pop(call_id, None)

    def find(self, call_id: str) -> ToolCall | None:
        return self.taken.get(call_id) or self.pending.get(call_id)

    def _take(self, tools: Collection[str] | None, limit: int) -> list[ToolCall]:
        out = [c for c in self.pending.values() if tools is None or c.tool in tools][:limit]
        for c in out:
            del self.pending[c.call_id]
            self.taken[c.call_id] = c
        return out

    async def take(self, tools: Collection[str] | None, timeout_s: float, limit: int = 64) -> list[ToolCall]:
        """Calls for ``tools`` (None: any), waiting up to ``timeout_s`` for the first one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            calls = self._take(tools, limit)
            left = deadline - loop.time()
            if calls or left <= 0:
                return calls
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return self._take(tools, limit)
