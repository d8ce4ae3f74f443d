"""A deterministic asyncio event loop on a virtual clock (discrete-event simulation of asyncio code).

``loop.time()`` returns virtual seconds. When no callback is ready, asyncio's ``_run_once`` asks the selector
to wait until the next timer; our selector *jumps* the clock by exactly that timeout instead of blocking, so
``asyncio.sleep``, ``wait_for`` and ``call_later`` cost no wall time, and the real manager code (which only
uses the loop's timers) runs unchanged. Invariants:

* the clock only moves forward, and only when nothing is ready (every task is blocked on a timer/future);
* no real I/O: registering a real file descriptor is allowed (asyncio's own self-pipe), but if the loop would
  block forever (no ready callback, no timer) that is a deadlock of the simulated program: it raises
  :class:`VirtualDeadlock` rather than hang;
* ordering is asyncio's own (FIFO ready queue, timers by deadline), so a run is a pure function of the
  program and its seeds;
* work handed to an executor (``run_in_executor``, hence ``asyncio.to_thread``: e.g. a flow's server tool) runs
  inline, at once, costing no virtual time (a thread would finish at an unknown wall time while the clock jumped
  to the next timer; the simulated manager's other computation costs no virtual time either).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualDeadlock(RuntimeError):
    """The simulated program waits for something that can never happen (no ready callback and no timer)."""


class _JumpSelector(selectors.BaseSelector):
    """A selector that never waits: ``select(timeout)`` advances the owning loop's virtual clock."""

    def __init__(self) -> None:
        self._map: dict[Any, selectors.SelectorKey] = {}
        self.loop: VirtualEventLoop | None = None

    def register(self, fileobj, events, data=None):
        key = selectors.SelectorKey(fileobj, self._fd(fileobj), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj):
        return self._map.pop(fileobj)

    def modify(self, fileobj, events, data=None):
        self._map.pop(fileobj, None)
        return self.register(fileobj, events, data)

    def get_map(self):
        return self._map

    def select(self, timeout=None):
        assert self.loop is not None
        if timeout is None:
            raise VirtualDeadlock("virtual loop: no ready callbacks and no timers (the simulation deadlocked)")
        if timeout > 0:
            self.loop._advance(timeout)
        return []

    def close(self) -> None:
        self._map.clear()

    @staticmethod
    def _fd(fileobj) -> int:
        return fileobj if isinstance(fileobj, int) else fileobj.fileno()


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is virtual (starts at ``start``) and jumps to the next timer when idle."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _JumpSelector()
        self._vnow = float(start)
        super().__init__(selector)
        selector.loop = self
        self.num_jumps = 0

    def time(self) -> float:
        return self._vnow

    def _advance(self, dt: float) -> None:
        self._vnow += dt
        self.num_jumps += 1

    def run_in_executor(self, executor, func, *args):
        """``func(*args)`` now, in the loop's thread (see the module docstring); its result or exception is the
        returned future's."""
        fut = self.create_future()
        try:
            fut.set_result(func(*args))
        except BaseException as e:  # noqa: BLE001 -- handed to the awaiting task, as an executor would
            fut.set_exception(e)
        return fut

    # thread-safe wake-ups never happen in a simulation; asyncio's self-pipe write is harmless though

    def clock(self) -> float:
        """The virtual clock, for components that take a ``clock`` callable (manager, registry, engines)."""
        return self._vnow


def run_virtual(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualEventLoop` (closed afterwards, tasks cancelled)."""
    loop = VirtualEventLoop(start)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
