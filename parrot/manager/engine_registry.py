"""The engines a manager can dispatch to: their clients, model info, last status and health.

Health comes from heartbeats (``status()`` calls): an engine whose heartbeat fails is skipped by dispatch
until a later heartbeat succeeds. The request path never flips health, so one failed call cannot take the
only engine out of service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from parrot.common.errors import EngineUnavailable, ParrotError, UnknownModel
from parrot.engine.interface import EngineClient, EngineStatus, ModelInfo

logger = logging.getLogger(__name__)


@dataclass
class EngineEntry:
    """Registry-owned record of one engine (fields are written by the registry only)."""

    name: str
    client: EngineClient
    info: ModelInfo | None = None  # None until the engine answered model_info()
    status: EngineStatus | None = None
    healthy: bool = False
    last_heartbeat: float | None = None  # time.monotonic() of the last successful status()
    last_error: str | None = None


class EngineRegistry:
    def __init__(self, clients: Sequence[EngineClient] = (), *, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._entries: dict[str, EngineEntry] = {}
        for client in clients:
            self.add(client)

    def add(self, client: EngineClient) -> EngineEntry:
        name = getattr(client, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"engine client {client!r} has no name")
        if name in self._entries:
            raise ValueError(f"duplicate engine name {name!r}")
        entry = EngineEntry(name=name, client=client)
        self._entries[name] = entry
        return entry

    def register(self, client: EngineClient) -> EngineEntry:
        """Add an engine that announced itself, replacing a previous registration under the same name (an
        engine process that restarted comes back with a fresh client)."""
        old = self._entries.pop(client.name, None)
        if old is not None:
            logger.info("engine %s re-registered", client.name)
        return self.add(client)

    def record_heartbeat(self, name: str, status: EngineStatus) -> EngineEntry:
        """A pushed heartbeat from a registered engine process. Raises EngineUnavailable if unknown."""
        entry = self.entry(name)
        entry.status = status
        entry.last_heartbeat = self._clock()
        if entry.info is not None:
            entry.healthy, entry.last_error = True, None
        return entry

    def remove(self, name: str) -> None:
        self._entries.pop(name, None)

    # ---- heartbeats -------------------------------------------------------------------------------------------
    async def probe(self, entry: EngineEntry) -> None:
        """Fetch model info (once) and status; update health."""
        try:
            if entry.info is None:
                entry.info = await entry.client.model_info()
            entry.status = await entry.client.status()
        except (ParrotError, OSError) as e:
            if entry.healthy or entry.last_error is None:
                logger.warning("engine %s failed its heartbeat: %s", entry.name, e)
            entry.healthy, entry.last_error = False, str(e)
            return
        if not entry.healthy:
            logger.info("engine %s is healthy (model %s, window %d)", entry.name, entry.info.name,
                        entry.info.max_model_len)
        entry.healthy, entry.last_error = True, None
        entry.last_heartbeat = self._clock()

    async def refresh(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in list(self._entries.values())))

    async def heartbeat_loop(self, interval_s: float) -> None:
        """Refresh every ``interval_s`` until cancelled (the manager owns and cancels this task)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()

    # ---- queries ----------------------------------------------------------------------------------------------
    def entries(self) -> list[EngineEntry]:
        return list(self._entries.values())

    def entry(self, name: str) -> EngineEntry:
        entry = self._entries.get(name)
        if entry is None:
            raise EngineUnavailable(f"unknown engine {name!r}")
        return entry

    def model_infos(self) -> list[ModelInfo]:
        """One ModelInfo per distinct served model name (engines that answered model_info)."""
        seen: dict[str, ModelInfo] = {}
        for e in self._entries.values():
            if e.info is not None:
                seen.setdefault(e.info.name, e.info)
        return list(seen.values())

    def candidates(self, models: Sequence[str] = ()) -> list[EngineEntry]:
        """Healthy engines serving one of ``models`` (any model if empty).

        Raises UnknownModel (404) if no engine serves any of the named models, EngineUnavailable (503) if
        the matching engines are all unhealthy (or there are none at all).
        """
        matching = [e for e in self._entries.values()
                    if e.info is not None and (not models or e.info.name in models)]
        if models and not matching and all(e.info is not None for e in self._entries.values()):
            served = sorted({i.name for i in self.model_infos()})
            raise UnknownModel(f"model {', '.join(models)!s} is not served here (served: {served})", param="model")
        healthy = [e for e in matching if e.healthy]
        if not healthy:
            raise EngineUnavailable("no healthy engine" + (f" for model {', '.join(models)}" if models else ""))
        return healthy
