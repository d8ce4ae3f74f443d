"""Failover helpers for the graph executor (the registry decides who is dead; this is what requests do then).

* :func:`run_unless_lost` runs a request's work on a lease and turns the loss of the lease (its engine was
  declared dead: missed heartbeats, or another request found it unreachable) into ``EngineUnavailable``, so the
  executor reschedules the request. A call into an engine that hangs would otherwise never return.
* :class:`OrphanContexts` remembers request contexts that could not be freed because their engine was dead, and
  frees them if that same engine process comes back alive (a restarted process lost them anyway).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from parrot.common.errors import EngineUnavailable, ParrotError
from parrot.engine.interface import EngineClient
from parrot.manager.dispatcher import Lease
from parrot.manager.engine_registry import EngineEntry, EngineRegistry, EngineState

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def run_unless_lost(lease: Lease, work: Awaitable[T], what: str) -> T:
    """Await ``work`` in this task; if ``lease`` is lost meanwhile, cancel it and raise EngineUnavailable.

    The loss cancels this task once; that cancellation is told apart from one from outside (a session closing,
    which must stay a cancellation) by the task's pending cancellation count."""
    task = asyncio.current_task()
    assert task is not None
    lost = False

    def on_lost() -> None:
        nonlocal lost
        lost = True
        task.cancel()

    lease.add_lost_callback(on_lost)
    try:
        return await work
    except asyncio.CancelledError:
        if lost and task.uncancel() == 0:
            raise EngineUnavailable(f"engine {lease.engine} was declared dead while running {what}") from None
        raise
    finally:
        lease.remove_lost_callback(on_lost)


class OrphanContexts:
    def __init__(self, registry: EngineRegistry) -> None:
        self._left: list[tuple[str, EngineClient, str]] = []  # (engine, client it was created through, context)
        self._tasks: set[asyncio.Task] = set()
        registry.add_listener(self._on_engine_state)

    def add(self, engine: str, client: EngineClient, context_id: str) -> None:
        self._left.append((engine, client, context_id))

    def __len__(self) -> int:
        return len(self._left)

    def _on_engine_state(self, entry: EngineEntry) -> None:
        if entry.state is not EngineState.ALIVE or not any(name == entry.name for name, _, _ in self._left):
            return
        mine = [ctx for name, client, ctx in self._left if name == entry.name and client is entry.client]
        self._left = [o for o in self._left if o[0] != entry.name]
        if not mine:
            return
        try:
            task = asyncio.get_running_loop().create_task(self._free_all(entry.client, mine))
        except RuntimeError:
            return  # no event loop: nothing can be freed now
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _free_all(client: EngineClient, contexts: list[str]) -> None:
        for ctx in contexts:
            try:
                await client.free_context(ctx)
            except ParrotError as e:  # gone already (UnknownContext) or unreachable again: nothing more to do
                logger.debug("freeing orphaned context %s failed: %s", ctx, e)
