"""The engines a manager can dispatch to: their clients, model info, last status and liveness.

Each engine is a small state machine, changed only here::

    PENDING --(model info + status answered)--> ALIVE --(failed call / missed heartbeats)--> DEAD
                                                  ^                                            |
                                                  +----------(a heartbeat succeeds again)------+

* A call that cannot reach the engine (``EngineUnavailable``, from a heartbeat probe or from the request
  path via :meth:`EngineRegistry.mark_dead`) kills it at once; other heartbeat failures (errors, a probe that
  hangs or times out: ``EngineTimeout``) kill it once no heartbeat succeeded for ``timeout_s``.
* A DEAD engine keeps being probed; the first success (a pull probe or a pushed heartbeat) revives it.
* ``register`` (an engine process announcing itself, e.g. after a restart) replaces the old entry: the old
  one dies (its contexts are gone with the process) and the new one starts PENDING.

Listeners (the dispatcher) are told about every state change, synchronously, so the requests running on a
dead engine can be rescheduled right away.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from parrot.common.errors import EngineTimeout, EngineUnavailable, NotReady, ParrotError, UnknownModel
from parrot.protocol.interface import EngineClient, EngineStatus, ModelInfo

logger = logging.getLogger(__name__)


class EngineState(str, enum.Enum):
    PENDING = "pending"  # known, but model info / status not fetched yet
    ALIVE = "alive"
    DEAD = "dead"


@dataclass(eq=False)
class EngineEntry:
    """Registry-owned record of one engine (fields are written by the registry only)."""

    name: str
    client: EngineClient
    info: ModelInfo | None = None  # None until the engine answered model_info()
    status: EngineStatus | None = None
    state: EngineState = EngineState.PENDING
    last_heartbeat: float | None = None  # registry clock of the last successful status()
    last_error: str | None = None
    deaths: int = 0

    @property
    def healthy(self) -> bool:
        return self.state is EngineState.ALIVE

    @healthy.setter
    def healthy(self, value: bool) -> None:
        """Operator/test override without notifying listeners (a later heartbeat decides again)."""
        self.state = EngineState.ALIVE if value and self.info is not None else EngineState.DEAD


Listener = Callable[[EngineEntry], None]


class EngineRegistry:
    def __init__(self, clients: Sequence[EngineClient] = (), *, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._entries: dict[str, EngineEntry] = {}
        self._listeners: list[Listener] = []
        self.num_deaths = 0
        for client in clients:
            self.add(client)

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

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
        engine process that restarted comes back with a fresh client; the old one is declared dead)."""
        old = self._entries.pop(client.name, None)
        if old is not None:
            logger.info("engine %s re-registered", client.name)
            self._set_state(old, EngineState.DEAD, "replaced by a new registration")
        return self.add(client)

    def remove(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            self._set_state(entry, EngineState.DEAD, "removed")

    # ---- state changes ----------------------------------------------------------------------------------------
    def _set_state(self, entry: EngineEntry, state: EngineState, reason: str | None = None) -> None:
        if entry.state is state:
            return
        previous, entry.state = entry.state, state
        if state is EngineState.DEAD:
            entry.deaths += 1
            self.num_deaths += 1
            entry.last_error = reason or entry.last_error
            logger.warning("engine %s is dead (%s)", entry.name, reason)
        elif state is EngineState.ALIVE:
            entry.last_error = None
            assert entry.info is not None
            logger.info("engine %s is %s (model %s, window %d)", entry.name,
                        "back" if previous is EngineState.DEAD else "alive", entry.info.name, entry.info.max_model_len)
        for listener in list(self._listeners):
            try:
                listener(entry)
            except Exception:  # a listener bug must not stop the others (or the heartbeat loop)
                logger.exception("engine state listener failed")

    def mark_dead(self, name: str, reason: str, *, client: EngineClient | None = None) -> bool:
        """A call to engine ``name`` failed as unreachable. Ignored if the engine is unknown, already dead, or
        (with ``client``) was replaced since that call started. True if this call killed it."""
        entry = self._entries.get(name)
        if entry is None or (client is not None and entry.client is not client) or entry.state is EngineState.DEAD:
            return False
        self._set_state(entry, EngineState.DEAD, reason)
        return True

    def record_heartbeat(self, name: str, status: EngineStatus) -> EngineEntry:
        """A pushed heartbeat from a registered engine process. Raises EngineUnavailable if unknown."""
        entry = self.entry(name)
        entry.status = status
        entry.last_heartbeat = self._clock()
        if entry.info is not None:
            self._set_state(entry, EngineState.ALIVE)
        return entry

    # ---- heartbeats -------------------------------------------------------------------------------------------
    async def probe(self, entry: EngineEntry) -> None:
        """Fetch model info (once) and status; update liveness."""
        try:
            if entry.info is None:
                entry.info = await entry.client.model_info()
            entry.status = await entry.client.status()
        except EngineTimeout as e:  # accepted the call, did not answer: dead only after timeout_s of silence
            if entry.last_error is None:
                logger.warning("engine %s did not answer its heartbeat: %s", entry.name, e)
            entry.last_error = str(e)
            return
        except EngineUnavailable as e:
            entry.last_error = str(e)
            if entry.state is not EngineState.PENDING:
                self._set_state(entry, EngineState.DEAD, f"heartbeat: {e}")
            return
        except (ParrotError, OSError) as e:
            if entry.last_error is None:
                logger.warning("engine %s failed its heartbeat: %s", entry.name, e)
            entry.last_error = str(e)
            return
        entry.last_heartbeat = self._clock()
        self._set_state(entry, EngineState.ALIVE)

    async def refresh(self, timeout_s: float | None = None, *, probe_timeout_s: float | None = None) -> None:
        """Probe every engine (each probe bounded by ``probe_timeout_s``, default ``timeout_s``), then kill those
        silent for ``timeout_s``."""
        bound = probe_timeout_s if probe_timeout_s is not None else timeout_s

        async def one(entry: EngineEntry) -> None:
            try:
                await asyncio.wait_for(self.probe(entry), bound)
            except asyncio.TimeoutError:
                entry.last_error = f"heartbeat timed out after {bound} s"

        await asyncio.gather(*(one(e) for e in list(self._entries.values())))
        if timeout_s is not None:
            self.check_timeouts(timeout_s)

    def check_timeouts(self, timeout_s: float) -> list[str]:
        """Declare dead every ALIVE engine without a successful heartbeat for more than ``timeout_s``."""
        now, dead = self._clock(), []
        for entry in list(self._entries.values()):
            if entry.state is EngineState.ALIVE and entry.last_heartbeat is not None \
                    and now - entry.last_heartbeat > timeout_s:
                self._set_state(entry, EngineState.DEAD, f"no heartbeat for {now - entry.last_heartbeat:.1f} s")
                dead.append(entry.name)
        return dead

    async def heartbeat_loop(self, interval_s: float, timeout_s: float | None = None) -> None:
        """Refresh every ``interval_s`` until cancelled (the manager owns and cancels this task). A probe waits
        at most max(interval_s, 1 s), so a hung engine is declared dead within about
        ``timeout_s + 2 * interval_s + 1`` s of its last answer."""
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh(timeout_s, probe_timeout_s=max(interval_s, 1.0))

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

    async def wait_for_models(self, timeout_s: float, *, poll_s: float = 0.05) -> list[ModelInfo]:
        """:meth:`model_infos`, waiting up to ``timeout_s`` (event-loop time) for the first engine to answer when
        none has yet (a server that is starting); an empty list means none came in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not (infos := self.model_infos()) and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        return infos

    def numerics_of(self, model: str) -> dict[str, dict]:
        """Engine name -> how it computes (ModelInfo.numerics) for the engines serving ``model`` that say so."""
        return {name: e.info.numerics for name, e in sorted(self._entries.items())
                if e.info is not None and e.info.name == model and e.info.numerics}

    def candidates(self, models: Sequence[str] = ()) -> list[EngineEntry]:
        """Live engines serving one of ``models`` (any model if empty).

        Raises NotReady (503 with Retry-After) while no engine has answered yet (a server starting: the model
        may well come), UnknownModel (404) if no engine serves any of the named models, EngineUnavailable (503)
        if the matching engines are all dead or pending.
        """
        if not any(e.info is not None for e in self._entries.values()):
            raise NotReady("no engine has registered yet (the server is starting); retry shortly")
        matching = [e for e in self._entries.values()
                    if e.info is not None and (not models or e.info.name in models)]
        if models and not matching and all(e.info is not None for e in self._entries.values()):
            served = sorted({i.name for i in self.model_infos()})
            raise UnknownModel(f"model {', '.join(models)!s} is not served here (served: {served})", param="model")
        healthy = [e for e in matching if e.healthy]
        if not healthy:
            raise EngineUnavailable("no live engine" + (f" for model {', '.join(models)}" if models else ""))
        return healthy
