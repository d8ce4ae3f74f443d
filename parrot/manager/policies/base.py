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

Token accounting (one unit everywhere): a request's *tokens* are its prompt estimate plus its max new tokens.
An engine's tokens are the union of what the requests placed on it hold: a prompt prefix that several of them
share (PrefixHash, paper §5.3: forked from one context, its KV blocks exist once) counts once::

    placed on e:   a = | system prompt (3000) | query a (80) | answer a (500) |
                   b = | system prompt (3000) | query b (60) | answer b (400) |
    tokens(e)  = 3580 + (3460 - 3000) = 4040     (not 3580 + 3460)

This holds on engines whose decode reads such a prefix once (``EngineView.shared_prefix_attention``); with
plain paged attention every request re-reads it, so every request counts in full. A prefix is credited only
when its token count is known on that engine (:meth:`ClusterView.held_tokens`: a prefix context or a request
context there holds it) and another request placed there shares it; a cached prefix nobody placed there uses
adds nothing, and the first request that uses it counts it in full. An idle engine takes any single request,
even one beyond every cap (otherwise it could never run).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from parrot.common.perf import PerfCriteria
from parrot.common.step_cost import StepCost
from parrot.protocol.interface import EngineStatus
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
    prefix_hashes: tuple[str, ...] = ()  # PrefixHash at each known boundary, in prompt order (chained)
    # the prompt's token ids when known (OpenAI completions): what Preble's E2 matches in its radix tree
    prompt_token_ids: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    priority: int = 0  # vLLM's request priority (OpenAI completions): lower is queued ahead, ties by arrival

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
    # The cap comes from an explicit per-token latency target (a TPOT target): no policy ever places work that
    # takes the engine beyond it. A soft cap (False) may yield to latency work that would otherwise wait (see
    # AppCentricPolicy's sharing pass).
    firm: bool = False


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
    # policy parrot: the share by which latency work's step may grow while throughput work rides in it
    share_slack: float = 0.10

    def __post_init__(self) -> None:
        for name in ("latency_cap_tokens", "throughput_cap_tokens", "min_cap_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.latency_cap_tokens > self.throughput_cap_tokens:
            raise ValueError(f"latency_cap_tokens ({self.latency_cap_tokens}) must not exceed "
                             f"throughput_cap_tokens ({self.throughput_cap_tokens})")
        if not self.share_slack > 0:
            raise ValueError(f"share_slack must be > 0, got {self.share_slack!r}")
        if not (self.tpot_base_s >= 0 and self.tpot_per_token_s > 0):
            raise ValueError("tpot_base_s must be >= 0 and tpot_per_token_s > 0")

    def cap_for_tpot(self, tpot_s: float) -> int:
        tokens = int((tpot_s - self.tpot_base_s) / self.tpot_per_token_s)
        return max(self.min_cap_tokens, min(self.latency_cap_tokens, tokens))


@dataclass(frozen=True)
class PlacedRequest:
    request_id: str
    session_id: str | None
    tokens: int  # its own prompt estimate + max new tokens (before any sharing)
    demand: Demand
    task_group: str | None = None
    prefix_hashes: tuple[str, ...] = ()
    prompt_tokens: int = 0  # the prompt part of ``tokens`` (what a shared prefix can cover)
    placed_at: float | None = None  # dispatcher clock when it was placed (None = unknown)


@dataclass(frozen=True)
class EngineView:
    name: str
    model: str
    max_model_len: int
    status: EngineStatus | None
    capacity_tokens: int | None  # KV capacity from its status (None = unknown)
    placed: tuple[PlacedRequest, ...] = ()
    # Decode reads a prompt prefix shared by forked contexts once per iteration (the builtin engine's
    # shared-prefix attention, paper §7), so such a prefix costs the engine's running tokens once. False for
    # plain paged attention (vLLM's kernel), where every request re-reads it: then each request counts in full.
    shared_prefix_attention: bool = True
    # Iteration time vs batch, fitted from the step statistics the engines serving this model report (None =
    # unknown: the policies then decide on tokens alone, see parrot.manager.policies.cost_aware)
    step_cost: StepCost | None = None

    @property
    def tokens(self) -> int:
        """Tokens of what is placed here, counting every request in full (see ClusterView.engine_tokens)."""
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
    # the per-output-token target the request's generates carry to the engine (OpHint.tpot_s): what its engine
    # keeps each iteration within while other work shares it; None: the request's own TPOT target, if any
    tpot_s: float | None = None


PrefixLookup = Callable[[str, Sequence[str]], int]  # (engine, prefix hashes) -> tokens of the longest held


class ClusterView:
    """Live engines and what is placed on them, for one scheduling round.

    ``prefix_tokens(engine, hashes)`` answers how many tokens of the longest of ``hashes`` ``engine`` holds (the
    PrefixStore, Algorithm 1's CtxInEngine); answers are memoized for the round, the store does not change
    during one."""

    def __init__(self, engines: Mapping[str, EngineView], *, prefix_tokens: PrefixLookup | None = None,
                 group_tokens: Mapping[tuple[str | None, str], int] | None = None, now: float | None = None) -> None:
        self.engines = dict(engines)
        self.now = now  # the dispatcher clock at this round (None = unknown), the time base of placed_at
        self._lookup = prefix_tokens
        self._group_tokens = dict(group_tokens or {})
        self._held: dict[tuple[str, str], int] = {}

    def prefix_tokens(self, engine: str, request: DispatchRequest) -> int:
        """Tokens of the request's longest prefix ``engine`` holds (Algorithm 1, CtxInEngine)."""
        return max((self.held_tokens(engine, h) for h in request.prefix_hashes), default=0)

    def held_tokens(self, engine: str, prefix_hash: str) -> int:
        """Tokens of the prefix ``prefix_hash`` if ``engine`` holds it, else 0 (its size is unknown there)."""
        if self._lookup is None:
            return 0
        key = (engine, prefix_hash)
        if key not in self._held:
            self._held[key] = self._lookup(engine, (prefix_hash,))
        return self._held[key]

    def shared_tokens(self, engine: str, hashes: Sequence[str], prompt_tokens: int,
                      present: Collection[str]) -> int:
        """Tokens of a prompt with boundary ``hashes`` already counted on ``engine``: its longest prefix that a
        request in ``present`` (the hashes of what is placed there) shares and whose size is known there,
        at most ``prompt_tokens``; 0 on an engine without shared-prefix attention."""
        if not self.engines[engine].shared_prefix_attention:
            return 0
        best = 0
        for h in hashes:
            if h in present:
                best = max(best, self.held_tokens(engine, h))
        return min(best, prompt_tokens)

    def engine_tokens(self, engine: str) -> int:
        """Tokens placed on ``engine`` with shared prefixes counted once (the module docstring)."""
        placed = self.engines[engine].placed
        if self._lookup is None or sum(bool(p.prefix_hashes) for p in placed) < 2:
            return sum(p.tokens for p in placed)  # nothing can be shared
        present: set[str] = set()
        total = 0
        for p in placed:
            total += p.tokens - self.shared_tokens(engine, p.prefix_hashes, p.prompt_tokens, present)
            present.update(p.prefix_hashes)
        return total

    def group_tokens(self, key: tuple[str | None, str] | None, own: int) -> int:
        """Tokens of a whole task group (queued + placed members); ``own`` if not in a group."""
        return self._group_tokens.get(key, own) if key is not None else own


class Policy(abc.ABC):
    """A global scheduling policy. Both methods are pure functions of their arguments."""

    name: str = "policy"
    caps_engines: bool = True  # its demands may carry caps (False: the dispatcher never pushes a token cap)

    @abc.abstractmethod
    def demand(self, request: DispatchRequest, info: SchedInfo, group_tokens: int,
               cost: StepCost | None = None) -> Demand:
        """The cap and kind of work of ``request`` (``group_tokens``: its task group's total, else its own;
        ``cost``: the step cost of the engines serving it, if known)."""

    @abc.abstractmethod
    def place(self, queue: Sequence[QueuedRequest], cluster: ClusterView) -> list[Placement]:
        """Placements for some of ``queue`` (each on one of its candidates); the rest keep waiting."""

    def next_round_at(self) -> float | None:
        """After :meth:`place`: the cluster-clock time at which the policy wants another round although nothing
        else may change (work held back only until then, e.g. an engine's backlog draining); None = only on
        events (arrivals, releases, relabels, engines). Policies that hold work back only for events keep
        this answer."""
        return None

    def decision_counts(self) -> dict[str, int]:
        """Decisions made so far, by kind, for ``GET /api/v1/stats`` and ``/metrics`` (E2: exploit, explore,
        rebalance, replicate, pd-balance, eviction notices applied). A policy that keeps no such counters reports
        none: this answer."""
        return {}


class PerRequestPolicy(Policy):
    """A policy that picks one engine per request and never queues (no caps): :meth:`choose` decides."""

    caps_engines = False

    def demand(self, request: DispatchRequest, info: SchedInfo, group_tokens: int,
               cost: StepCost | None = None) -> Demand:
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
            occ.add(engine, q.request, self.demand(q.request, q.info, q.tokens))
            out.append(Placement(q.ticket, engine))
        return out


class Occupancy:
    """A policy's scratch copy of per-engine load during one round (placements made so far count).

    Tokens are counted with shared prefixes once (see the module docstring): :meth:`extra_tokens` is what a
    set of requests would add to an engine given what is already there."""

    def __init__(self, cluster: ClusterView) -> None:
        self.cluster = cluster
        self.tokens = {n: cluster.engine_tokens(n) for n in cluster.engines}
        self.count = {n: len(e.placed) for n, e in cluster.engines.items()}
        self.cap = {n: e.cap for n, e in cluster.engines.items()}
        self.kinds = {n: {p.demand.kind for p in e.placed} for n, e in cluster.engines.items()}
        self.firm = {n: any(p.demand.firm for p in e.placed) for n, e in cluster.engines.items()}
        self.hashes: dict[str, set[str]] = {n: {h for p in e.placed for h in p.prefix_hashes}
                                            for n, e in cluster.engines.items()}

    def copy(self) -> "Occupancy":
        """An independent copy (to try placements without making them)."""
        out = object.__new__(Occupancy)
        out.cluster = self.cluster
        out.tokens, out.count, out.cap, out.firm = dict(self.tokens), dict(self.count), dict(self.cap), dict(self.firm)
        out.kinds = {n: set(k) for n, k in self.kinds.items()}
        out.hashes = {n: set(h) for n, h in self.hashes.items()}
        return out

    def extra_tokens(self, engine: str, requests: Sequence[DispatchRequest]) -> int:
        """Tokens ``requests`` (placed together, in this order) add to ``engine``: each one's own tokens minus
        its prefix already counted there (by a request placed earlier or by an earlier one of ``requests``)."""
        present = set(self.hashes[engine])
        total = 0
        for r in requests:
            total += r.tokens - self.cluster.shared_tokens(engine, r.prefix_hashes, r.prompt_tokens, present)
            present.update(r.prefix_hashes)
        return total

    def fits(self, engine: str, tokens: int, cap: int | None, *, members: int = 1) -> bool:
        """Room for ``tokens`` more (of ``members`` requests) under both the engine's cap and the newcomers' own
        cap. An idle engine takes a single request beyond every cap (else it could never run), not a set."""
        if self.count[engine] == 0 and members == 1:
            return True
        limits = [c for c in (self.cap[engine], cap) if c is not None]
        return not limits or self.tokens[engine] + tokens <= min(limits)

    def add(self, engine: str, request: DispatchRequest, demand: Demand) -> None:
        self.tokens[engine] += self.extra_tokens(engine, [request])
        self.hashes[engine].update(request.prefix_hashes)
        self.count[engine] += 1
        if demand.cap is not None:
            self.cap[engine] = demand.cap if self.cap[engine] is None else min(self.cap[engine], demand.cap)
        self.kinds[engine].add(demand.kind)
        self.firm[engine] = self.firm[engine] or demand.firm

    def similarity(self, engine: str, kind: WorkKind) -> int:
        """0 = already runs this kind of work, 1 = idle, 2 = runs only other kinds (Algorithm 1's FindEngine
        prefers engines running similar work, so latency and throughput work end up on separate engines)."""
        if kind in self.kinds[engine]:
            return 0
        return 1 if self.count[engine] == 0 else 2
