"""Graceful shutdown of both servers (`parrot serve`, `parrot engine`): drain, then stop, in bounded time.

    SIGTERM --> draining: new work -> 503 server_draining (Retry-After), /ready -> 503, /health still 200;
       |        the listener stays open (a load balancer reads the 503s and /ready and moves traffic away);
       |        work whose client is gone is cancelled at once; the rest runs
       v
    in-flight work done, or grace_s over --> uvicorn stops: closes the listener and idle connections, cancels
       |                                     what still runs after the grace's remainder (at least 0.5 s)
       v
    lifespan shutdown (the manager closes its sessions, the engine stops) --> exit
    a second SIGTERM / SIGINT skips the drain; whatever happens, the process ends by grace_s + HARD_EXIT_MARGIN_S
    (an interval timer set at the first signal: SIGALRM's default action, exit status 142, if it is still running)

"Work" is what a route table says (:class:`DrainMiddleware`'s ``is_work``): POSTs that start something (a
submit, a completion, a fill); reads, deletes, probes and the engines' heartbeats are never refused. A request
whose client disconnected while the server drains is cancelled (its ``receive()`` reports ``http.disconnect``
once the body was read, as uvicorn does), so a backlog left by clients that went away does not hold the exit.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn
from starlette.responses import JSONResponse

from parrot.common.errors import ServerDraining

logger = logging.getLogger(__name__)

HARD_EXIT_MARGIN_S = 5.0  # after the grace: the most the port's closing and the lifespan shutdown may take


@dataclass(eq=False)
class _Work:
    task: asyncio.Task
    receive: Callable
    body_read: bool = False
    responded: bool = False  # the whole response was sent
    cancelled_by_drain: bool = False
    watcher: asyncio.Task | None = None


@dataclass(eq=False)
class Drain:
    """One server's drain state; the middleware and :class:`DrainingServer` share it (kept in ``app.state``)."""

    grace_s: float = 10.0
    started_at: float | None = None  # time.monotonic() of the first SIGTERM
    work: set[_Work] = field(default_factory=set)
    cancelled: int = 0  # in-flight work cancelled because its client was gone

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def start(self) -> None:
        """Begin draining. Safe in a signal handler: only sets the start time (the server's tick does the rest)."""
        if self.started_at is None:
            self.started_at = time.monotonic()

    def remaining_s(self) -> float:
        if self.started_at is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self.started_at))

    def watch_client(self, w: _Work) -> None:
        """Cancel ``w`` once its client is gone (only after its body was read: receive() is the app's till then)."""
        if not w.body_read or w.watcher is not None:
            return

        async def watch() -> None:
            while True:
                message = await w.receive()
                if message["type"] != "http.disconnect":
                    continue
                if not w.responded:  # (uvicorn reports a disconnect once the response is complete, too)
                    w.cancelled_by_drain = True
                    self.cancelled += 1
                    w.task.cancel()
                return

        w.watcher = asyncio.get_running_loop().create_task(watch())


class DrainMiddleware:
    """Pure ASGI: refuses new work while draining and tracks the work in flight (see the module docstring)."""

    def __init__(self, app, drain: Drain, is_work: Callable[[str, str], bool]) -> None:
        self.app = app
        self._drain = drain
        self._is_work = is_work

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self._is_work(scope.get("method", ""), scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        drain = self._drain
        if drain.draining:
            err = ServerDraining("the server is shutting down and takes no new work; retry on another replica")
            retry_after = str(max(1, math.ceil(drain.remaining_s())))
            await JSONResponse(err.to_body(), status_code=err.status_code,
                               headers={"retry-after": retry_after})(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        w = _Work(task, receive)

        async def tracked_receive():
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False) and not w.body_read:
                w.body_read = True
                if drain.draining:
                    drain.watch_client(w)
            return message

        async def tracked_send(message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                w.responded = True

        drain.work.add(w)
        try:
            await self.app(scope, tracked_receive, tracked_send)
        except asyncio.CancelledError:
            if not w.cancelled_by_drain or task.uncancel() > 0:
                raise  # cancelled from outside (uvicorn's deadline): stays a cancellation
            logger.info("%s %s cancelled: its client went away while the server drained", scope.get("method"),
                        scope.get("path"))
        finally:
            drain.work.discard(w)
            if w.watcher is not None:
                w.watcher.cancel()


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain phase before its own shutdown (the first SIGTERM / SIGINT starts it)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._announced = False

    def handle_exit(self, sig, frame) -> None:
        """The signal handler: runs between two bytecodes of the loop's thread, so it only sets flags."""
        if self.drain.draining or self.should_exit:
            super().handle_exit(sig, frame)  # the second signal: stop now
            self.should_exit = True
            return
        self._captured_signals.append(sig)
        self.drain.start()
        # the backstop: if the loop is starved (a backlog that keeps it busy for seconds at a time) or the shutdown
        # hangs, the kernel ends the process with SIGALRM's default action at grace + HARD_EXIT_MARGIN_S
        signal.setitimer(signal.ITIMER_REAL, self.drain.grace_s + HARD_EXIT_MARGIN_S)

    async def on_tick(self, counter: int) -> bool:
        drain = self.drain
        if drain.draining and not self.should_exit:
            if not self._announced:
                self._announced = True
                logger.warning("draining: new work is refused (503); %d request(s) in flight get up to %.1f s",
                               len(drain.work), drain.grace_s)
            for w in list(drain.work):
                drain.watch_client(w)  # cancelled once its client is gone (no-op for those watched already)
            if not drain.work or drain.remaining_s() <= 0:
                # uvicorn's own wait (connections: long polls, streams) gets the rest of the grace, at least 0.5 s
                self.config.timeout_graceful_shutdown = max(0.5, drain.remaining_s())
                logger.warning("drained (%d request(s) still in flight, %d cancelled: client gone); stopping",
                               len(drain.work), drain.cancelled)
                self.should_exit = True
        return await super().on_tick(counter)


def serve(app, *, host: str, port: int, drain: Drain, **config) -> None:
    """Run ``app`` under :class:`DrainingServer` until SIGTERM / SIGINT (blocking)."""
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=drain.grace_s,
                                           **config), drain)
    try:
        server.run()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)  # shut down in time: the backstop is off (the caller may clean up)
