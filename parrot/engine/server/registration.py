"""An engine's side of registration: announce itself to the manager, then push heartbeats carrying its status.

    register --ok--> heartbeat every heartbeat_s --404 (the manager forgot us: restarted, or dropped us)--+
       ^  |                 |                                                                            |
       |  +-- failed: retry with backoff (unreachable, refused: bad secret, name taken, ...)               |
       +------------------------------------------------------------------------------------------------+
                            |
                            +-- failed (unreachable, 5xx, 409): heartbeats go on, spaced by backoff

A transient failure never re-registers: registering again replaces the manager's entry, which would restart the
requests running here. Backoff is exponential with full jitter (tenacity's), from ``heartbeat_s`` up to
``max_backoff_s``, reset by the first success, so a manager that comes back after a restart hears from every
engine within ``max_backoff_s``. The engine proves itself with the manager's engine secret
(``ENGINE_SECRET_HEADER``) and an ``instance`` token of its own (random per process).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

from parrot.protocol.interface import EngineClient
from parrot.protocol.wire import ENGINE_SECRET_HEADER, to_json

log = logging.getLogger(__name__)


class ManagerLink:
    """The registration / heartbeat loop of one engine process (run :meth:`run` as a task; cancel to stop)."""

    def __init__(self, client: EngineClient, manager_url: str, advertise_url: str, *, secret: str | None,
                 heartbeat_s: float, max_backoff_s: float = 30.0, timeout_s: float = 5.0,
                 draining: Callable[[], bool] = lambda: False,
                 forgotten: Callable[[], Awaitable[None]] | None = None) -> None:
        """``draining()``: the engine is shutting down; it stops heartbeating (the manager then stops sending
        work here, at the latest after its heartbeat timeout). ``forgotten()``: awaited when the manager answers
        that it does not know this engine, before registering again (the engine frees the contexts the manager
        that forgot it had made: their owner is gone)."""
        self.client = client
        self.base = manager_url.rstrip("/")
        self.url = advertise_url
        self.instance = secrets.token_urlsafe(16)  # this process: the manager keeps our name for us only
        self.heartbeat_s = heartbeat_s
        self._wait = wait_random_exponential(multiplier=heartbeat_s, max=max(heartbeat_s, max_backoff_s),
                                             min=min(heartbeat_s, 0.1))
        self._headers = {ENGINE_SECRET_HEADER: secret} if secret else {}
        self._timeout_s = timeout_s
        self._draining = draining
        self._forgotten = forgotten
        self.registered = False
        self.registrations = 0  # successful registrations (1 + one per manager that forgot us)
        self.failures = 0  # failed registration / heartbeat attempts

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=self._timeout_s, headers=self._headers) as http:
            while not self._draining():
                # a fresh retrying per round: the backoff starts over after each success
                async for attempt in AsyncRetrying(wait=self._wait, retry=retry_if_exception_type(httpx.HTTPError),
                                                   before_sleep=self._failed):
                    with attempt:
                        await self._step(http)
                await asyncio.sleep(self.heartbeat_s)

    def _failed(self, state: RetryCallState) -> None:
        self.failures += 1
        e = state.outcome.exception() if state.outcome else None
        if isinstance(e, httpx.HTTPStatusError):  # refused: bad secret, name taken... (retried: it may change)
            log.warning("manager %s refused %s: %s; retrying in %.1f s", self.base, e.request.url.path,
                        _error_message(e.response), state.upcoming_sleep)
        else:
            log.warning("manager %s unreachable (%r); retrying in %.1f s", self.base, e, state.upcoming_sleep)

    async def _step(self, http: httpx.AsyncClient) -> None:
        """Register if needed, then one heartbeat; raises httpx.HTTPError on any failure."""
        status = to_json(await self.client.status())
        just_registered = False
        if not self.registered:
            r = await http.post(f"{self.base}/api/v1/engines/register",
                                json={"name": self.client.name, "url": self.url, "instance": self.instance})
            r.raise_for_status()
            self.registered = just_registered = True
            self.registrations += 1
            log.info("registered with manager %s as %s (%s)", self.base, self.client.name, self.url)
        r = await http.post(f"{self.base}/api/v1/engines/{self.client.name}/heartbeat",
                            json={"status": status, "instance": self.instance})
        if r.status_code == 404 and not just_registered:
            self.registered = False  # the manager restarted or dropped us: register again, at once
            log.warning("manager %s does not know %s; registering again", self.base, self.client.name)
            if self._forgotten is not None:
                await self._forgotten()
            await self._step(http)
            return
        r.raise_for_status()


def _error_message(resp: httpx.Response) -> str:
    try:
        return f"{resp.status_code} {resp.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{resp.status_code} {resp.text[:200]}"
