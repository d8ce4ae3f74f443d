"""Engine choice: a pluggable :class:`Policy` fed by engine load, and the :class:`Dispatcher` that hands out
leases on engines to DAG requests and OpenAI completions alike.

The dispatcher counts what it has in flight per engine (requests and prompt+output tokens) and combines it
with the last :class:`EngineStatus` from heartbeats; a policy only *chooses* among candidates, it never
mutates state. Engines batch whatever they receive, so the dispatcher does not cap concurrency; a policy that
queues (FIFO with a latency capacity cap, Algorithm 1) will make :meth:`Dispatcher.acquire` wait.

Prefix affinity (Algorithm 1, CtxInEngine): each candidate carries ``prefix_tokens``, the longest of the
request's prefix hashes that engine already holds (a prefix context or a running request context), from the
``prefix_lookup`` the manager wires to its PrefixStore; a policy keeps sharers where their prefix lives.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from parrot.common.errors import EngineUnavailable
from parrot.engine.interface import EngineClient, EngineStatus, ModelInfo
from parrot.manager.engine_registry import EngineEntry, EngineRegistry
from parrot.manager.perf import PerfCriteria

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchRequest:
    """What the policy knows about the work to place."""

    request_id: str
    session_id: str | None = None  # None for OpenAI completions
    models: tuple[str, ...] = ()  # acceptable models (empty = any)
    prompt_tokens: int = 0  # estimate (0 if unknown before tokenization)
    max_new_tokens: int = 0
    perf: PerfCriteria | None = None
    prefix_hashes: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineLoad:
    """A candidate engine as a policy sees it."""

    name: str
    model: str
    max_model_len: int
    status: EngineStatus | None  # last heartbeat snapshot
    inflight_requests: int  # leases handed out by this dispatcher and not yet released
    inflight_tokens: int
    prefix_tokens: int = 0  # tokens of the request's longest prefix this engine holds (0 = none / unknown)


class Policy(abc.ABC):
    """Chooses an engine for one request among healthy candidates (never empty)."""

    name: str = "policy"

    @abc.abstractmethod
    def choose(self, request: DispatchRequest, candidates: Sequence[EngineLoad]) -> str:
        """Return the ``name`` of one of ``candidates``."""


class LeastLoadedPolicy(Policy):
    """Fewest in-flight requests, then fewest tokens (in flight here + engine-reported), then name.

    With ``prefix_affinity`` an engine holding the request's longest shared prefix wins instead, as long as it
    has at most ``affinity_slack`` more requests in flight than the least loaded candidate (so one popular
    system prompt cannot pile every request onto one engine).
    """

    name = "least_loaded"

    def __init__(self, *, prefix_affinity: bool = True, affinity_slack: int = 4) -> None:
        if affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0, got {affinity_slack!r}")
        self.prefix_affinity = prefix_affinity
        self.affinity_slack = affinity_slack

    def choose(self, request: DispatchRequest, candidates: Sequence[EngineLoad]) -> str:
        def load(c: EngineLoad) -> tuple[int, int, str]:
            reported = c.status.running_tokens + c.status.waiting_tokens if c.status is not None else 0
            return c.inflight_requests, c.inflight_tokens + reported, c.name

        best = min(candidates, key=load)
        if self.prefix_affinity:
            top = max(c.prefix_tokens for c in candidates)
            if top > 0:
                holder = min((c for c in candidates if c.prefix_tokens == top), key=load)
                if holder.inflight_requests <= best.inflight_requests + self.affinity_slack:
                    return holder.name
        return best.name


class Lease:
    """An engine handed to one request; :meth:`release` (idempotent) returns its load share."""

    def __init__(self, dispatcher: "Dispatcher", entry: EngineEntry, tokens: int) -> None:
        self._dispatcher = dispatcher
        self._tokens = tokens
        self._released = False
        self.engine = entry.name
        self.client: EngineClient = entry.client
        assert entry.info is not None  # candidates always have model info
        self.info: ModelInfo = entry.info

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._dispatcher._release(self.engine, self._tokens)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


PrefixLookup = Callable[[str, Sequence[str]], int]  # (engine, prefix hashes) -> tokens of the longest held


class Dispatcher:
    def __init__(self, registry: EngineRegistry, policy: Policy | None = None, *,
                 prefix_lookup: PrefixLookup | None = None) -> None:
        self.registry = registry
        self.policy = policy or LeastLoadedPolicy()
        self.prefix_lookup = prefix_lookup
        self._requests: dict[str, int] = {}
        self._tokens: dict[str, int] = {}

    def load(self, entry: EngineEntry, request: DispatchRequest | None = None) -> EngineLoad:
        assert entry.info is not None
        prefix = 0
        if request is not None and request.prefix_hashes and self.prefix_lookup is not None:
            prefix = self.prefix_lookup(entry.name, request.prefix_hashes)
        return EngineLoad(name=entry.name, model=entry.info.name, max_model_len=entry.info.max_model_len,
                          status=entry.status, inflight_requests=self._requests.get(entry.name, 0),
                          inflight_tokens=self._tokens.get(entry.name, 0), prefix_tokens=prefix)

    async def acquire(self, request: DispatchRequest) -> Lease:
        """Choose an engine for ``request`` and count it as in flight there until the lease is released.

        Raises UnknownModel (no engine serves the requested models) or EngineUnavailable (none healthy).
        """
        entries = self.registry.candidates(request.models)
        by_name = {e.name: e for e in entries}
        choice = self.policy.choose(request, [self.load(e, request) for e in entries])
        entry = by_name.get(choice)
        if entry is None:
            raise EngineUnavailable(f"policy {self.policy.name} chose {choice!r}, which is not a candidate")
        tokens = request.prompt_tokens + request.max_new_tokens
        self._requests[entry.name] = self._requests.get(entry.name, 0) + 1
        self._tokens[entry.name] = self._tokens.get(entry.name, 0) + tokens
        logger.debug("dispatch %s -> %s (policy %s)", request.request_id, entry.name, self.policy.name)
        return Lease(self, entry, tokens)

    def _release(self, engine: str, tokens: int) -> None:
        self._requests[engine] = max(0, self._requests.get(engine, 0) - 1)
        self._tokens[engine] = max(0, self._tokens.get(engine, 0) - tokens)
