"""What a global scheduling policy sees and decides (no torch, no I/O): plain data in, placements out.

The :class:`~parrot.manager.dispatcher.Dispatcher` owns the queue and the leases. Each scheduling round it
builds a :class:`ClusterView` (every live engine with the requests placed on it) and asks the policy

* :meth:`Policy.demand` -- the running-token *cap* a request imposes on the engine that runs it, and its kind
  of work (the engine's cap is the minimum over what it runs: "the request with the most strict latency
  constraint", paper §5.4), and
* :meth:`Policy.place` -- which queued requests go where now. Requests left out stay queued (their
  ``acquire`` waits) until the next round (a release, an arrival, a label change, an engine coming or going).

A policy never mutates the view; :class:`Occupancy` is its scratch copy for one round, so requests it placed
earlier in the round count against the engine's room.

Token accounting (one unit everywhere): a request's *tokens* are its prompt estimate plus its max new tokens;
an engine's tokens are the sum over the requests placed on it. An idle engine takes any request, even one
beyond every cap (otherwise it could never run).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from parrot.engine.interface import EngineStatus
from parrot.manager.perf import PerfCriteria
from parrot.manager.perf_deduction import SchedInfo


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

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


@dataclass(frozen=True)
class EngineLoad:
    """A candidate engine as a per-request policy (:class:`PerRequestPolicy`) sees it."""

    name: str
    model: str
    max_model_len: int
    status: EngineStatus | None  # last heartbeat snapshot
    inflight_requests: int  # leases handed out by this dispatcher and not yet released
    inflight_tokens: int
    prefix_tokens: int = 0  # tokens of the request's longest prefix this engine holds (0 = none / unknown)


class WorkKind(str, enum.Enum):
    LATENCY = "latency"  # latency-sensitive or of unknown objective: keeps its engine's batch small
    THROUGHPUT = "throughput"  # throughput-preferred: may fill an engine


@dataclass(frozen=True)
class Demand:
    cap: int | None  # running tokens the engine may hold while this request runs (None = no cap)
    kind: WorkKind


@dataclass(frozen=True)
class CapacityConfig:
    """Per-engine running-token caps (paper §5.4 and §8.1: "an engine that can run up to 64,000 tokens of
    throughput-driven requests ... reduced to 2,000 to satisfy a strict latency requirement").

    ``tpot_*`` is a linear time-per-output-token profile of an engine (TPOT = base + per_token x running
    tokens); a TPOT target turns into the cap that keeps the profile under it, clamped to
    [min_cap_tokens, latency_cap_tokens]."""

    latency_cap_tokens: int = 2048
    throughput_cap_tokens: int = 65536
    min_cap_tokens: int = 256
    tpot_base_s: float = 0.015
    tpot_per_token_s: float = 5e-6

    def __post_init__(self) -> None:
        for name in ("latency_cap_tokens", "throughput_cap_tokens", "min_cap_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.latency_cap_tokens > self.throughput_cap_tokens:
            raise ValueError(f"latency_cap_tokens ({self.latency_cap_tokens}) must not exceed "
                             f"throughput_cap_tokens ({self.throughput_cap_tokens})")
        if not (self.tpot_base_s >= 0 and self.tpot_per_token_s > 0):
            raise ValueError("tpot_base_s must be >= 0 and tpot_per_token_s > 0")

    def cap_for_tpot(self, tpot_s: float) -> int:
        tokens = int((tpot_s - self.tpot_base_s) / self.tpot_per_token_s)
        return max(self.min_cap_tokens, min(self.latency_cap_tokens, tokens))


@dataclass(frozen=True)
class PlacedRequest:
    request_id: str
    session_id: str | None
    tokens: int
    demand: Demand
    task_group: str | None = None


@dataclass(frozen=True)
class EngineView:
    name: str
    model: str
    max_model_len: int
    status: EngineStatus | None
    capacity_tokens: int | None  # KV capacity from its status (None = unknown)
    placed: tuple[PlacedRequest, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.placed)

    @property
    def cap(self) -> int | None:
        """The strictest cap of what runs here, else the engine's capacity (None = unbounded/unknown)."""
        caps = [p.demand.cap for p in self.placed if p.demand.cap is not None]
        if self.capacity_tokens is not None:
            caps.append(self.capacity_tokens)
        return min(caps) if caps else None


@dataclass(frozen=True)
class QueuedRequest:
    ticket: int
    request: DispatchRequest
    info: SchedInfo
    enqueued_at: float  # time.time() of its (first) acquire: a rescheduled request keeps its place
    candidates: tuple[str, ...]  # live engines serving one of its models

    @property
    def tokens(self) -> int:
        return self.request.tokens

    @property
    def group_key(self) -> tuple[str | None, str] | None:
        group = self.info.task_group
        return (self.request.session_id, group) if group is not None else None


@dataclass(frozen=True)
class Placement:
    ticket: int
    engine: str


class ClusterView:
    """Live engines and what is placed on them, for one scheduling round."""

    def __init__(self, engines: Mapping[str, EngineView], *,
                 prefix_tokens: Callable[[str, DispatchRequest], int] | None = None,
                 group_tokens: Mapping[tuple[str | None, str], int] | None = None) -> None:
        self.engines = dict(engines)
        self._prefix_tokens = prefix_tokens
        self._group_tokens = dict(group_tokens or {})

    def prefix_tokens(self, engine: str, request: DispatchRequest) -> int:
        """Tokens of the request's longest prefix ``engine`` holds (Algorithm 1, CtxInEngine)."""
        if self._prefix_tokens is None or not request.prefix_hashes:
            return 0
        return self._prefix_tokens(engine, request)

    def group_tokens(self, key: tuple[str | None, str] | None, own: int) -> int:
        """Tokens of a whole task group (queued + placed members); ``own`` if not in a group."""
        return self._group_tokens.get(key, own) if key is not None else own


class Policy(abc.ABC):
    """A global scheduling policy. Both methods are pure functions of their arguments."""

    name: str = "policy"

    @abc.abstractmethod
    def demand(self, request: DispatchRequest, info: SchedInfo, group_tokens: int) -> Demand:
        """The cap and kind of work of ``request`` (``group_tokens``: its task group's total, else its own)."""

    @abc.abstractmethod
    def place(self, queue: Sequence[QueuedRequest], cluster: ClusterView) -> list[Placement]:
        """Placements for some of ``queue`` (each on one of its candidates); the rest keep waiting."""


class PerRequestPolicy(Policy):
    """A policy that picks one engine per request and never queues (no caps): :meth:`choose` decides."""

    def demand(self, request: DispatchRequest, info: SchedInfo, group_tokens: int) -> Demand:
        return Demand(None, WorkKind.LATENCY)

    @abc.abstractmethod
    def choose(self, request: DispatchRequest, candidates: Sequence[EngineLoad]) -> str:
        """Return the ``name`` of one of ``candidates`` (never empty)."""

    def place(self, queue: Sequence[QueuedRequest], cluster: ClusterView) -> list[Placement]:
        occ = Occupancy(cluster)
        out = []
        for q in sorted(queue, key=lambda q: (q.enqueued_at, q.ticket)):
            loads = [EngineLoad(name=e, model=cluster.engines[e].model,
                                max_model_len=cluster.engines[e].max_model_len, status=cluster.engines[e].status,
                                inflight_requests=occ.count[e], inflight_tokens=occ.tokens[e],
                                prefix_tokens=cluster.prefix_tokens(e, q.request)) for e in q.candidates]
            engine = self.choose(q.request, loads)
            occ.add(engine, q.tokens, self.demand(q.request, q.info, q.tokens))
            out.append(Placement(q.ticket, engine))
        return out


class Occupancy:
    """A policy's scratch copy of per-engine load during one round (placements made so far count)."""

    def __init__(self, cluster: ClusterView) -> None:
        self.tokens = {n: e.tokens for n, e in cluster.engines.items()}
        self.count = {n: len(e.placed) for n, e in cluster.engines.items()}
        self.cap = {n: e.cap for n, e in cluster.engines.items()}
        self.kinds = {n: {p.demand.kind for p in e.placed} for n, e in cluster.engines.items()}

    def fits(self, engine: str, tokens: int, cap: int | None) -> bool:
        """Room for ``tokens`` more under both the engine's cap and the newcomer's own cap."""
        if self.count[engine] == 0:
            return True
        limits = [c for c in (self.cap[engine], cap) if c is not None]
        return not limits or self.tokens[engine] + tokens <= min(limits)

    def add(self, engine: str, tokens: int, demand: Demand) -> None:
        self.tokens[engine] += tokens
        self.count[engine] += 1
        if demand.cap is not None:
            self.cap[engine] = demand.cap if self.cap[engine] is None else min(self.cap[engine], demand.cap)
        self.kinds[engine].add(demand.kind)

    def similarity(self, engine: str, kind: WorkKind) -> int:
        """0 = already runs this kind of work, 1 = idle, 2 = runs only other kinds (Algorithm 1's FindEngine
        prefers engines running similar work, so latency and throughput work end up on separate engines)."""
        if kind in self.kinds[engine]:
            return 0
        return 1 if self.count[engine] == 0 else 2
