"""Failover: what a request does when its engine dies under it (the registry decides who is dead).

* :class:`Failover` is the one restart loop: it runs a piece of work on a leased engine and, when that engine
  is lost, tells the dispatcher (which declares it dead) and runs the work again on another engine, up to
  ``max_attempts`` runs in all. The graph executor (Parrot requests) and the completion service (OpenAI
  requests) both run their requests through it; they differ only in their hooks.
* :func:`run_unless_lost` turns the loss of a lease (its engine was declared dead: missed heartbeats, or
  another request found it unreachable) into ``EngineUnavailable`` for the work running on it; a call into an
  engine that hangs would otherwise never return.
* :class:`OrphanContexts` remembers request contexts that could not be freed because their engine was dead, and
  frees them if that same engine process comes back alive (a restarted process lost them anyway).

One :meth:`Failover.run`::

    acquire(request, enqueued_at) --> work(lease, attempt) --> its result (the lease is still held: the caller's)
          ^                                |
          |                                | EngineUnavailable (a call failed, or the lease was lost)
          |                                v
          +-- restart <-- engine_failed(lease); lease.release(); on_lost(Loss)
                                           '--> re-raise when it was the last run or not restartable()

Invariants: a restarted run keeps its first ``enqueued_at`` (its place in the queue); the dispatcher hears of
the death before the lease is released, so no queued request is placed on the dead engine in between; any
other exception (or a cancellation) releases the lease and propagates unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from parrot.common.errors import EngineUnavailable, ParrotError, UnknownContext
from parrot.protocol.interface import EngineClient
from parrot.manager.dispatcher import Dispatcher, DispatchRequest, Lease
from parrot.manager.engine_registry import EngineEntry, EngineRegistry, EngineState

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Loss:
    """An engine lost under a run, as :meth:`Failover.run` tells its ``on_lost`` hook (the dispatcher already
    knows, and the lease is released)."""

    lease: Lease
    error: EngineUnavailable
    attempt: int  # the run that lost it, from 1
    restarting: bool  # whether another run follows (else the error is re-raised right after the hook)


def _always() -> bool:
    return True


def _ignore(loss: Loss) -> None:
    return None


class Failover:
    """Runs work on leased engines with restarts on engine loss; counts the restarts (``num_restarts``)."""

    def __init__(self, dispatcher: Dispatcher, *, max_attempts: int) -> None:
        """``max_attempts``: runs of a piece of work in all when its engine dies under it (1 = no restart)."""
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
        self.dispatcher = dispatcher
        self.max_attempts = max_attempts
        self.num_restarts = 0  # runs started again on another engine after their engine was lost

    async def run(self, request: DispatchRequest, work: Callable[[Lease, int], Awaitable[T]], *, what: str,
                  restartable: Callable[[], bool] = _always, on_lost: Callable[[Loss], None] = _ignore) -> T:
        """Lease an engine for ``request`` and return ``await work(lease, attempt)`` (``attempt`` counts runs
        from 1); on the engine's loss run it again elsewhere (see the module docstring).

        ``restartable()`` is asked after a loss while runs remain (a stream that already sent tokens is not);
        ``on_lost`` is called once per loss, before the next run or the re-raise. ``what`` names the work in
        logs and in the error of a lost lease. On success the lease is still held and the caller releases it.
        Raises the last ``EngineUnavailable`` when no run is left or the work is not restartable, and whatever
        else ``work`` or ``acquire`` raise (UnknownModel, EngineUnavailable when no engine is alive, ...)."""
        enqueued_at: float | None = None
        for attempt in range(1, self.max_attempts + 1):
            lease = await self.dispatcher.acquire(request, enqueued_at=enqueued_at)
            enqueued_at = lease.enqueued_at
            try:
                return await run_unless_lost(lease, work(lease, attempt), what)
            except EngineUnavailable as e:
                self.dispatcher.engine_failed(lease, e)
                lease.release()
                restarting = attempt < self.max_attempts and restartable()
                on_lost(Loss(lease, e, attempt, restarting))
                if not restarting:
                    raise
                self.num_restarts += 1
                logger.warning("%s lost engine %s (%s); restarting (run %d of %d)", what, lease.engine, e.message,
                               attempt + 1, self.max_attempts)
            except BaseException:
                lease.release()
                raise
        raise AssertionError("unreachable: the last run returns or raises")


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
    """Contexts left on dead engines, keyed by the engine process (its client object) they were created in."""

    def __init__(self, registry: EngineRegistry) -> None:
        self._registry = registry
        self._left: list[tuple[str, EngineClient, str]] = []  # (engine, client it was created through, context)
        self._tasks: set[asyncio.Task] = set()
        registry.add_listener(self._on_engine_state)

    def add(self, engine: str, client: EngineClient, context_id: str) -> None:
        self._left.append((engine, client, context_id))

    async def free(self, engine: str, context_id: str, client: EngineClient | None = None) -> None:
        """Free a request's context on ``engine`` through ``client`` (the one it was created through; None: the
        engine's current client), or keep it here if that engine process is dead now (a call could hang until
        the engine's timeout). Never raises a ParrotError: an unknown context is gone already (never created,
        or freed), any other failure is logged."""
        try:
            entry = self._registry.entry(engine)
            client = entry.client if client is None else client
            if entry.state is EngineState.DEAD and entry.client is client:
                self.add(engine, client, context_id)
                return
            await client.free_context(context_id)
        except UnknownContext:
            pass
        except ParrotError as e:
            logger.warning("freeing context %s on engine %s failed: %s", context_id, engine, e)

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
