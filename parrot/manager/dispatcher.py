"""The global scheduler's mechanics: a queue of requests waiting for an engine, leases on engines, and the
scheduling rounds that ask the :class:`~parrot.manager.policies.base.Policy` where queued requests go.

``acquire(request)`` enqueues a ticket and runs a round; it returns a :class:`Lease` once the policy placed
the request (a policy with caps may keep it queued: FIFO for the baselines, Algorithm 1 order for ``parrot``).
Each round hands the policy the queue ordered by ``DispatchRequest.priority`` (lower first), FIFO among equals.
Rounds run synchronously on the event loop (no await inside, so a round sees one consistent state) whenever
something changes: an arrival, a release, new labels from perf deduction (:meth:`Dispatcher.kick`), an engine
dying or coming back. A request whose models no live engine serves fails at once (EngineUnavailable /
UnknownModel): nothing ever waits for an engine that is not there.

Failover: when the registry declares an engine dead, every lease on it is *lost* (``lease.lost``; the holder
reschedules its request, see the executor) and its load share disappears from the accounting.

Capacity hint to engines: after each round the dispatcher pushes to every engine the cap of the strictest
request placed on it, raised to the tokens placed there if the policy placed more
(``EngineClient.set_token_cap``; None when nothing of ours runs there), so the engine's local batch follows
the placement. One push task per engine sends the latest wanted value (no reordering); engines that do not
support caps are not asked again.

Prefix affinity (Algorithm 1, CtxInEngine): ``prefix_lookup`` (wired to the PrefixStore) tells the policy how
many tokens of a request's prefix each engine already holds; the policies also use it to count a prefix shared
by requests placed on one engine once toward that engine's tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from parrot.common.errors import EngineError, ParrotError
from parrot.common.step_cost import StepCost, StepStats
from parrot.protocol.interface import EngineCapabilities, EngineClient, ModelInfo, OpHint
from parrot.manager.engine_registry import EngineEntry, EngineRegistry, EngineState
from parrot.manager.perf_deduction import SchedInfo
from parrot.manager.policies.base import (
    ClusterView,
    DispatchRequest,
    EngineLoad,
    EngineView,
    PlacedRequest,
    PrefixLookup,
    Policy,
    QueuedRequest,
)
from parrot.manager.policies.baseline import LeastLoadedPolicy

logger = logging.getLogger(__name__)

__all__ = ["DispatchRequest", "Dispatcher", "EngineLoad", "LeastLoadedPolicy", "Lease", "Policy"]

CAP_PUSH_TIMEOUT_S = 5.0

InfoLookup = Callable[[str, str], SchedInfo]  # (session id, request id) -> labels, depth, app order
# (policy name, the placed request, its engine, the round's view before its placements): metrics
PlacedHook = Callable[[str, QueuedRequest, str, ClusterView], None]


class Lease:
    """An engine handed to one request; :meth:`release` (idempotent) returns its load share. ``lost`` turns
    true (once; lost callbacks run synchronously then) if the engine is declared dead while the lease is held."""

    def __init__(self, dispatcher: "Dispatcher", entry: EngineEntry, request: DispatchRequest,
                 enqueued_at: float, tpot_s: float | None = None) -> None:
        self._dispatcher = dispatcher
        self._released = False
        self._lost = False
        self._lost_callbacks: list[Callable[[], None]] = []
        self.request = request
        self.tokens = request.tokens
        self.enqueued_at = enqueued_at
        self.placed_at = dispatcher._clock()
        self.engine = entry.name
        self.client: EngineClient = entry.client
        assert entry.info is not None  # candidates always have model info
        self.info: ModelInfo = entry.info
        self.tpot_s = tpot_s  # the per-token target the request's generates carry to the engine (Placement.tpot_s)

    @property
    def lost(self) -> bool:
        return self._lost

    def targeted(self, hint: OpHint | None) -> OpHint | None:
        """``hint`` carrying this lease's per-token target (when it has one and the hint has none of its own)."""
        if self.tpot_s is None or hint is None or hint.tpot_s is not None:
            return hint
        return dataclasses.replace(hint, tpot_s=self.tpot_s)

    def add_lost_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the lease is lost (right now if it already is)."""
        if self._lost:
            fn()
        else:
            self._lost_callbacks.append(fn)

    def remove_lost_callback(self, fn: Callable[[], None]) -> None:
        if fn in self._lost_callbacks:
            self._lost_callbacks.remove(fn)

    def _lose(self) -> None:
        if self._lost:
            return
        self._lost = True
        for fn in list(self._lost_callbacks):
            try:
                fn()
            except Exception:  # one holder's bug must not keep the others from hearing about it
                logger.exception("lease lost callback failed")

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._dispatcher._release(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(eq=False)
class _Ticket:
    id: int
    request: DispatchRequest
    enqueued_at: float
    future: asyncio.Future


class Dispatcher:
    def __init__(self, registry: EngineRegistry, policy: Policy | None = None, *,
                 prefix_lookup: PrefixLookup | None = None, info_lookup: InfoLookup | None = None,
                 on_placed: PlacedHook | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.policy = policy or LeastLoadedPolicy()
        self.prefix_lookup = prefix_lookup
        self.info_lookup = info_lookup
        self._on_placed = on_placed
        self._clock = clock
        self._ids = itertools.count(1)
        self._queue: list[_Ticket] = []
        self._leases: dict[str, list[Lease]] = {}  # engine name -> leases held there
        self._caps_wanted: dict[str, int | None] = {}
        self._caps_sent: dict[str, int | None] = {}
        self._cap_tasks: dict[str, asyncio.Task] = {}
        self._no_caps: set[str] = set()  # engines that answered "caps unsupported"
        # engines whose placed work changed since their cap was last computed (all of them: _caps_stale)
        self._caps_dirty: set[str] = set()
        self._caps_stale = True
        self._timer: asyncio.TimerHandle | None = None  # a round the policy asked for (Policy.next_round_at)
        self._timer_at: float | None = None
        # the last step-cost fit and the statuses it came from (see _step_costs)
        self._costs_cache: tuple[tuple, dict[tuple[str, str], StepCost]] | None = None
        registry.add_listener(self._on_engine_state)

    # ---- the request side -----------------------------------------------------------------------------------
    async def acquire(self, request: DispatchRequest, *, enqueued_at: float | None = None) -> Lease:
        """Wait until the policy places ``request``; the lease counts it on its engine until released.

        ``enqueued_at`` keeps a rescheduled request's place in the queue. Raises UnknownModel (no engine
        serves the requested models) or EngineUnavailable (none alive), now or while queued.
        """
        self.registry.candidates(request.models)
        ticket = _Ticket(next(self._ids), request, enqueued_at if enqueued_at is not None else self._clock(),
                         asyncio.get_running_loop().create_future())
        self._queue.append(ticket)
        self._pump()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            fut = ticket.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().release()  # placed just as we were cancelled
            raise
        finally:
            if ticket in self._queue:
                self._queue.remove(ticket)

    def kick(self) -> None:
        """Run a scheduling round now (labels changed)."""
        self._caps_stale = True  # relabeled work changes its engine's cap
        self._pump()

    def engine_failed(self, lease: Lease, error: ParrotError) -> None:
        """A call on ``lease``'s engine found it unreachable: declare it dead (its other leases are lost too)."""
        self.registry.mark_dead(lease.engine, f"call failed: {error.message}", client=lease.client)

    def _release(self, lease: Lease) -> None:
        leases = self._leases.get(lease.engine)
        if leases is not None and lease in leases:
            leases.remove(lease)
        if self._info(lease.request, lease.enqueued_at).task_group is not None:
            self._caps_stale = True  # the group's total changed: so do its members' caps on other engines
        else:
            self._caps_dirty.add(lease.engine)
        self._pump()

    # ---- engines --------------------------------------------------------------------------------------------
    def _on_engine_state(self, entry: EngineEntry) -> None:
        if entry.state is EngineState.DEAD:
            held = self._leases.get(entry.name, [])
            lost = [lease for lease in held if lease.client is entry.client]
            self._leases[entry.name] = [lease for lease in held if lease.client is not entry.client]
            for lease in lost:
                lease._lose()
            if lost:
                logger.warning("engine %s died holding %d request(s); they will be rescheduled", entry.name,
                               len(lost))
            self._caps_sent.pop(entry.name, None)
            self._caps_wanted.pop(entry.name, None)
            self._no_caps.discard(entry.name)
        self._caps_stale = True
        self._pump()

    # ---- scheduling rounds ----------------------------------------------------------------------------------
    def _pump(self) -> None:
        self._queue = [t for t in self._queue if not t.future.done()]
        cluster: ClusterView | None = None
        if self._queue:
            try:
                cluster = self._round()
            except Exception as e:  # a policy bug: fail the queue rather than leave requests waiting forever
                logger.exception("scheduling round failed (policy %s)", self.policy.name)
                self._caps_stale = True
                for t in self._queue:
                    if not t.future.done():
                        t.future.set_exception(EngineError(f"scheduler error: {type(e).__name__}: {e}"))
            self._queue = [t for t in self._queue if not t.future.done()]
            if self._queue:
                self._arm_timer()
        self._update_caps(cluster)

    def _arm_timer(self) -> None:
        """Schedule the round the policy asked for (an earlier request replaces a later one)."""
        at = self.policy.next_round_at()
        if at is None or (self._timer_at is not None and self._timer_at <= at):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = loop.call_later(max(0.0, at - self._clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._pump()

    def _round(self) -> ClusterView | None:
        """One scheduling round; returns the round's cluster view with its placements added (None: nothing was
        queued for a live engine), which the cap update reuses instead of building it again."""
        queued: list[QueuedRequest] = []
        tickets: dict[int, _Ticket] = {}
        # the policy sees the queue by priority (lower first), then arrival (stable: FIFO among equals)
        for t in sorted(self._queue, key=lambda t: t.request.priority):
            try:
                names = tuple(e.name for e in self.registry.candidates(t.request.models))
            except ParrotError as e:  # no live engine for it any more: fail now, never wait
                t.future.set_exception(e)
                continue
            tickets[t.id] = t
            queued.append(QueuedRequest(t.id, t.request, self._info(t.request, t.enqueued_at), t.enqueued_at, names))
        if not queued:
            return None
        cluster = self._cluster(queued)
        by_ticket = {q.ticket: q for q in queued}
        new: dict[str, list[PlacedRequest]] = {}
        for p in self.policy.place(queued, cluster):
            q, t = by_ticket.get(p.ticket), tickets.get(p.ticket)
            if q is None or t is None or t.future.done():
                continue
            if p.engine not in q.candidates:
                raise EngineError(f"policy {self.policy.name} placed {q.request.request_id} on {p.engine!r}, "
                                  f"not one of its candidates {q.candidates}")
            entry = self.registry.entry(p.engine)
            lease = Lease(self, entry, t.request, t.enqueued_at,
                          p.tpot_s if p.tpot_s is not None else q.info.targets.tpot_s)
            self._leases.setdefault(entry.name, []).append(lease)
            t.future.set_result(lease)
            if self._on_placed is not None:
                self._on_placed(self.policy.name, q, entry.name, cluster)
            view = cluster.engines.get(entry.name)
            if view is not None:
                new.setdefault(entry.name, []).append(self._placed(lease, q.info, cluster, view.step_cost))
            logger.debug("dispatch %s -> %s (policy %s)", t.request.request_id, entry.name, self.policy.name)
        for name, placed in new.items():
            view = cluster.engines[name]
            cluster.engines[name] = dataclasses.replace(view, placed=view.placed + tuple(placed))
        return cluster

    def _placed(self, lease: Lease, info: SchedInfo, cluster: ClusterView, cost: StepCost | None) -> PlacedRequest:
        """``lease`` as its engine's view lists it (demand from the current labels and its group's total)."""
        key = (lease.request.session_id, info.task_group) if info.task_group is not None else None
        demand = self.policy.demand(lease.request, info, cluster.group_tokens(key, lease.tokens), cost)
        return PlacedRequest(lease.request.request_id, lease.request.session_id, lease.tokens, demand,
                             info.task_group, lease.request.prefix_hashes, lease.request.prompt_tokens,
                             lease.placed_at)

    def _info(self, request: DispatchRequest, enqueued_at: float) -> SchedInfo:
        if self.info_lookup is not None and request.session_id is not None:
            return self.info_lookup(request.session_id, request.request_id)
        return SchedInfo(app_order=enqueued_at)

    def _held(self, entry: EngineEntry) -> list[Lease]:
        return [lease for lease in self._leases.get(entry.name, ()) if lease.client is entry.client]

    def _cluster(self, queued: Sequence[QueuedRequest] = (), only: Collection[str] | None = None) -> ClusterView:
        """Live engines with what is placed on them (demands from the current labels: a request relabeled
        after placement changes its engine's cap right away); with ``only``, just those engines."""
        entries = [e for e in self.registry.entries() if e.healthy and e.info is not None]
        held = {e.name: [(lease, self._info(lease.request, lease.enqueued_at)) for lease in self._held(e)]
                for e in entries}
        group_tokens: dict[tuple[str | None, str], int] = {}
        for q in queued:
            if q.group_key is not None:
                group_tokens[q.group_key] = group_tokens.get(q.group_key, 0) + q.tokens
        for pairs in held.values():
            for lease, info in pairs:
                if info.task_group is not None:
                    key = (lease.request.session_id, info.task_group)
                    group_tokens[key] = group_tokens.get(key, 0) + lease.tokens
        costs = self._step_costs(entries)
        cluster = ClusterView({}, prefix_tokens=self.prefix_lookup, group_tokens=group_tokens, now=self._clock())
        for e in entries:
            assert e.info is not None
            if only is not None and e.name not in only:
                continue
            cost = costs.get(_cost_pool(e))
            cluster.engines[e.name] = self._view(e, tuple(self._placed(lease, info, cluster, cost)
                                                          for lease, info in held[e.name]), costs)
        return cluster

    def _view(self, e: EngineEntry, placed: tuple[PlacedRequest, ...],
              costs: dict[tuple[str, str], StepCost]) -> EngineView:
        """The engine as the policy sees it: count-once credit for shared prefixes only where the engine
        advertises shared-prefix attention (EngineCapabilities; nothing advertised = none)."""
        assert e.info is not None
        s = e.status
        capacity = s.kv_blocks_total * s.block_size if s is not None and s.kv_blocks_total > 0 else None
        caps = EngineCapabilities.from_status(s)
        return EngineView(e.name, e.info.name, e.info.max_model_len, s, capacity, placed,
                          shared_prefix_attention=caps is not None and caps.shared_prefix_attention,
                          step_cost=costs.get(_cost_pool(e)))

    def _step_costs(self, entries: Sequence[EngineEntry]) -> dict[tuple[str, str], StepCost]:
        """Per (model, engine kind) (:func:`_cost_pool`), the iteration-time fit of the step statistics its
        engines last reported, pooled (engines of one model and kind are assumed alike; a pool none of whose
        engines reported enough steps is left out). Refitted only when a status changed (a heartbeat), not every
        round."""
        key = tuple((e.name, e.status) for e in entries)
        if self._costs_cache is not None and len(key) == len(self._costs_cache[0]) \
                and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(key, self._costs_cache[0])):
            return self._costs_cache[1]
        by_model: dict[tuple[str, str], list[StepStats]] = {}
        for e in entries:
            raw = e.status.extra.get("step_stats") if e.status is not None else None
            if raw is None or e.info is None:
                continue
            try:
                by_model.setdefault(_cost_pool(e), []).append(StepStats.from_wire(raw))
            except ValueError as err:
                logger.debug("engine %s: ignoring its step statistics (%s)", e.name, err)
        out = {}
        for model, stats in by_model.items():
            fit = StepStats.pooled(stats).fit()
            if fit is not None:
                out[model] = fit
        self._costs_cache = (key, out)
        return out

    # ---- capacity hints -------------------------------------------------------------------------------------
    def _update_caps(self, cluster: ClusterView | None = None) -> None:
        """Recompute the wanted cap of the engines whose placed work changed: all of them from ``cluster`` (this
        round's view, placements included), else only the dirty ones (a release), else all (labels or engines
        changed)."""
        if not self.policy.caps_engines:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): the next round pushes
        if cluster is None:
            if not self._caps_stale and not self._caps_dirty:
                return
            cluster = self._cluster(only=None if self._caps_stale else self._caps_dirty)
        self._caps_stale = False
        self._caps_dirty.clear()
        for name, view in cluster.engines.items():
            caps = [p.demand.cap for p in view.placed if p.demand.cap is not None]
            # The engine admits everything placed here: even beyond the cap (an idle engine's oversized request,
            # the parrot policy's sharing pass), and counted the way the engine counts (every running context in
            # full: a prefix the policy counted once is one per context there). The cap holds the rest back.
            wanted = max(min(caps), view.tokens) if caps else None
            if name in self._no_caps or (self._caps_sent.get(name) == wanted and name not in self._cap_tasks):
                continue
            self._caps_wanted[name] = wanted
            if name not in self._cap_tasks:
                entry = self.registry.entry(name)
                self._cap_tasks[name] = asyncio.get_running_loop().create_task(self._push_caps(entry))

    async def _push_caps(self, entry: EngineEntry) -> None:
        name = entry.name
        try:
            while self._caps_sent.get(name) != self._caps_wanted.get(name):
                cap = self._caps_wanted.get(name)
                supported = await asyncio.wait_for(entry.client.set_token_cap(cap), CAP_PUSH_TIMEOUT_S)
                self._caps_sent[name] = cap
                if not supported:
                    self._no_caps.add(name)
                    return
        except (ParrotError, OSError, asyncio.TimeoutError) as e:
            logger.debug("pushing the token cap to engine %s failed: %s", name, e)
        finally:
            self._cap_tasks.pop(name, None)

    async def close(self) -> None:
        """Stop cap pushes; fail whatever still waits in the queue."""
        for t in self._queue:
            if not t.future.done():
                t.future.set_exception(EngineError("the manager is shutting down"))
        self._queue.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None
        tasks = list(self._cap_tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- introspection --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        cluster = self._cluster()
        engines = {name: {"requests": len(v.placed), "tokens": cluster.engine_tokens(name), "cap": v.cap,
                          "cap_sent": self._caps_sent.get(name),
                          "kinds": sorted({p.demand.kind.value for p in v.placed})}
                   for name, v in cluster.engines.items()}
        return {"policy": self.policy.name, "queued": len(self._queue), "decisions": self.policy.decision_counts(),
                "engines": engines}


def _cost_pool(e: EngineEntry) -> tuple[str, str]:
    """Whose step statistics are pooled: engines of one model and one kind (the builtin engine, or an external
    server's kind, ``extra["backend"]["kind"]``): a llama.cpp server and a builtin engine on the same GGUF run
    on different code, so they are not assumed alike."""
    assert e.info is not None
    backend = e.status.extra.get("backend") if e.status is not None else None
    kind = backend.get("kind") if isinstance(backend, dict) else None
    return e.info.name, str(kind or "builtin")
