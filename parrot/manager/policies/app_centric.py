"""Parrot's application-centric scheduling (paper §5.4, Algorithm 1 and FindEngine).

Queue order ("topological order; requests of one app kept together"): earliest deadline first (a deadline
or a TTFT target, see :mod:`parrot.manager.perf_deduction`), then latency-sensitive before throughput work,
then the app that arrived first, then depth in its DAG, then arrival. Unlike the FIFO baselines a request
that fits nowhere does not block the ones behind it.

For each queued request ``r`` in that order (Algorithm 1)::

    if r is in a task group:           FindEngine(all queued members of the group)   -- placed as a whole
    elif queued requests share a prefix with r: FindEngine(r + those sharers)           -- co-located for forks
    elif engines hold r's prefix:      FindEngine(r, only those engines)
    if nothing was found:              FindEngine(r)

FindEngine(set S): among the engines serving every member (for latency work: not running throughput work;
see the last pass below), those with room for S's tokens under both the
engine's current cap and the strictest cap in S (:class:`~parrot.manager.policies.base.Occupancy`; a prompt
prefix S shares with what is placed there counts once, so the users of one long system prompt fit on an engine
many times over); the best is, in order: one already hosting members of S's task group, one already running
the same kind of work (no capacity reduction: "scheduled to an engine that has already been running a
latency-sensitive request, the capacity reduction is negligible"), an idle one, then the longest held prefix,
then the fewest tokens.

When the engines' step cost is known (their step-time statistics, :mod:`parrot.manager.policies.cost_aware`),
throughput work is placed in seconds before Algorithm 1 is asked: a throughput task group (or a lone throughput
request without queued prefix sharers) is split over engines when that finishes it ``SPLIT_GAIN`` sooner than
FindEngine's single engine (never onto another idle engine), and may use a latency engine's spare time within
its latency budget when that gains more than it costs the latency work there; a TPOT target becomes a cap
through the measured cost. With batching nearly free (GPU cost models) the split rarely pays and the decisions
are Algorithm 1's; without a cost they are exactly Algorithm 1's.

Pacing (throughput work when every candidate's step cost is known and the round has a clock,
:meth:`AppCentricPolicy.fill_throughput`; it takes the place of the split rule above): throughput requests go
out one by one in Algorithm 1's order, each to the engine where it finishes first (prefill backlog + decode
steps of the batch it joins, plus the latency it adds to latency work there), but only onto engines with less
than ``backlog_s`` seconds of prompt still to prefill; the rest waits at the manager, where a later app's maps
cannot get ahead of an earlier app's reduce (in an engine's FCFS queue they would), and the dispatcher runs a
round when the first backlog drains (:meth:`Policy.next_round_at`). Engines running latency work take throughput
work only when every candidate runs some (then within their latency budget, cost_aware rule c): a chat decoding
next to a map stage's prefills waits a whole prefill per token.

Latency budget in time (:meth:`AppCentricPolicy._within_budget`): with the step cost known, latency work that
exceeds an engine's token cap may still join it when the estimated decode step (shared prefixes counted once,
each request at its mean context) stays within the step time the cap stands for (the engine filled to the cap
with requests of the same size counted in full). The users of one GPTs app then stay on the engine holding its
system prompt instead of spilling to an engine that must prefill it again; and when FindEngine would still send
such a request to an engine without its prefix, it joins a holder anyway if that adds fewer decode seconds to the
others than the spill would (:meth:`AppCentricPolicy._join_rather_than_spill`). Latency work without throughput work
anywhere treats idle engines like engines running latency work (:meth:`AppCentricPolicy._similarity`).

Caps (:meth:`AppCentricPolicy.demand`): latency-sensitive work and work of unknown objective caps its engine at
``latency_cap_tokens`` (tighter with a TPOT target); a task group at its own total (so it runs as one large
batch, but nothing unrelated piles on); throughput work at ``throughput_cap_tokens`` (and the engine's KV).

Last passes, for what is still queued (in the same order). Sharing pass: a latency request that fits nowhere
joins an engine that runs only latency work, beyond that engine's latency cap, instead of waiting for it. Latency work lowers an engine's capacity to
keep *throughput* work from slowing it down, but the cap must still admit the latency work that needs the
engine: for a request that is waiting, the queue costs the whole remaining run of what is there, while one more
sequence in a memory-bound decode batch costs everyone a little per token. Concurrent chain steps of different
apps therefore run together rather than one app after the other (the Fig. 12b/13 requirement: no app slower
than under the request-centric baseline, whose per-request FIFO interleaves the apps). Limits: never onto an
engine running throughput work (the separation of kinds stands), never beyond the engine's KV capacity or
``throughput_cap_tokens``, and never for or next to a request with a TPOT target (a *firm* cap: the target is a
per-token promise). Among the engines that qualify, the one whose tokens end lowest (a shared prefix counts
once, so sharers stay together). Only then may a latency request join an engine running throughput work (if
that engine's tokens fit under its latency cap): that cuts the engine's capacity from the throughput cap to
the latency cap ("significantly reduced", §5.4), the largest negative impact FindEngine can choose.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence

from parrot.common.perf import PerfCriteria
from parrot.common.step_cost import StepCost
from parrot.manager.perf_deduction import SchedInfo
from parrot.manager.policies.base import (
    CapacityConfig,
    ClusterView,
    Demand,
    DispatchRequest,
    Occupancy,
    Placement,
    Policy,
    QueuedRequest,
    WorkKind,
)
from parrot.manager.policies.cost_aware import SPLIT_GAIN, CostLedger, _Latency, cap_for_tpot


# Throughput work placed on an engine beyond this many seconds of pending prefill waits at the manager, in
# Algorithm 1's order, instead of in the engine's FCFS queue (see "Pacing" in the module docstring)
THROUGHPUT_BACKLOG_S = 0.25


class AppCentricPolicy(Policy):
    name = "parrot"

    def __init__(self, caps: CapacityConfig | None = None, *,
                 backlog_s: float | None = THROUGHPUT_BACKLOG_S, task_groups: bool = True) -> None:
        """``backlog_s``: the pacing bound for throughput work (None: no pacing, Algorithm 1's placement only).
        ``task_groups=False`` ignores the task groups of perf deduction (an ablation: every request is then
        placed and capped on its own)."""
        if backlog_s is not None and backlog_s <= 0:
            raise ValueError(f"backlog_s must be > 0 or None, got {backlog_s!r}")
        self.caps = caps or CapacityConfig()
        self.backlog_s = backlog_s
        self.task_groups = task_groups
        self._wake_at: float | None = None

    def next_round_at(self) -> float | None:
        return self._wake_at

    def demand(self, request: DispatchRequest, info: SchedInfo, group_tokens: int,
               cost: StepCost | None = None) -> Demand:
        label = info.label
        if label is not None and label.task_group is not None and not self.task_groups:
            label = dataclasses.replace(label, task_group=None)
        if label is not None and label.criteria is PerfCriteria.THROUGHPUT:
            return Demand(self.caps.throughput_cap_tokens, WorkKind.THROUGHPUT)
        cap = self.caps.latency_cap_tokens
        firm = label is not None and label.targets.tpot_s is not None  # a per-token promise (module docstring)
        if label is not None and label.targets.tpot_s is not None:
            # the engines' measured step cost if known (cost_aware, rule b), else the configured TPOT profile
            cap = min(cap, self.caps.cap_for_tpot(label.targets.tpot_s) if cost is None else cap_for_tpot(
                cost, label.targets.tpot_s, request.tokens, min_cap=self.caps.min_cap_tokens, max_cap=cap))
        if label is not None and label.task_group is not None:
            cap = max(cap, min(group_tokens, self.caps.throughput_cap_tokens))
        return Demand(cap, WorkKind.LATENCY, firm)

    @staticmethod
    def order_key(q: QueuedRequest) -> tuple:
        t = q.info.targets
        due = [d for d in (t.deadline, q.enqueued_at + t.ttft_s if t.ttft_s is not None else None) if d is not None]
        throughput = q.info.criteria is PerfCriteria.THROUGHPUT
        return (min(due, default=math.inf), throughput, q.info.app_order, q.info.depth, q.enqueued_at, q.ticket)

    def place(self, queue: Sequence[QueuedRequest], cluster: ClusterView) -> list[Placement]:
        if not self.task_groups:
            queue = [_without_group(q) for q in queue]
        order = sorted(queue, key=self.order_key)
        occ = Occupancy(cluster)
        hosts: dict[tuple[str | None, str], set[str]] = {}  # task group -> engines running members of it
        for e in cluster.engines.values():
            for p in e.placed:
                if p.task_group is not None and self.task_groups:
                    hosts.setdefault((p.session_id, p.task_group), set()).add(e.name)
        left = {q.ticket: q for q in order}
        out: list[Placement] = []
        ledger = CostLedger(cluster, occ)
        self._wake_at = None
        self._ledger = ledger  # this round's, for find_engine's latency budget

        def record(m: QueuedRequest, engine: str) -> None:
            out.append(Placement(m.ticket, engine))
            del left[m.ticket]
            if m.group_key is not None:
                hosts.setdefault(m.group_key, set()).add(engine)

        def assign(members: list[QueuedRequest], engine: str) -> None:
            for m in members:
                demand = self._demand(m, cluster)
                ledger.add(engine, m.request, demand, occ.extra_tokens(engine, [m.request]))
                occ.add(engine, m.request, demand)
                record(m, engine)

        for q in order:
            if q.ticket not in left:
                continue
            if self._paced(q, ledger, cluster):  # throughput work with a known step cost: paced fill
                members = [m for m in left.values() if m.group_key == q.group_key] if q.group_key is not None \
                    else [q]
                for m, engine in self.fill_throughput(members, occ, ledger, cluster):
                    record(m, engine)  # fill_throughput recorded it in occ and ledger
                continue
            if q.group_key is not None:  # Algorithm 1, lines 4-5
                members = [m for m in left.values() if m.group_key == q.group_key]
                split = self.split_throughput(members, occ, ledger, cluster, prefer=hosts.get(q.group_key, ()))
                if split is not None:
                    for engine, part in split.items():
                        assign(part, engine)
                    continue
                engine = self.find_engine(members, occ, cluster, prefer=hosts.get(q.group_key, ()))
                if engine is not None:
                    assign(members, engine)
                    continue
            sharers = [m for m in left.values() if m is not q and _share_prefix(q, m)]
            if not sharers and q.group_key is None:  # a lone throughput request: where it finishes first
                split = self.split_throughput([q], occ, ledger, cluster)
                if split is not None:
                    for engine, part in split.items():
                        assign(part, engine)
                    continue
            if sharers:  # lines 6-7
                engine = self.find_engine([q, *sharers], occ, cluster)
                if engine is not None:
                    assign([q, *sharers], engine)
                    continue
            holders = [e for e in q.candidates if cluster.prefix_tokens(e, q.request) > 0]
            engine = self.find_engine([q], occ, cluster, only=holders) if holders else None  # lines 8-9
            if engine is None:
                engine = self.find_engine([q], occ, cluster)  # lines 10-11
                if holders and engine is not None and engine not in holders:
                    engine = self._join_rather_than_spill(q, holders, engine, occ, ledger, cluster) or engine
            if engine is not None:
                assign([q], engine)
        for q in order:  # the sharing pass, then latency work may join throughput work (module docstring)
            if q.ticket in left and not self._paced(q, ledger, cluster):
                engine = self.share_latency_engine(q, occ, cluster)
                if engine is None:
                    engine = self.find_engine([q], occ, cluster, mix_kinds=True)
                holders = [e for e in q.candidates if cluster.prefix_tokens(e, q.request) > 0]
                if holders and engine is not None and engine not in holders:
                    engine = self._join_rather_than_spill(q, holders, engine, occ, ledger, cluster) or engine
                if engine is not None:
                    assign([q], engine)
        return out

    def find_engine(self, members: Sequence[QueuedRequest], occ: Occupancy, cluster: ClusterView, *,
                    only: Collection[str] | None = None, prefer: Collection[str] = (),
                    mix_kinds: bool = False) -> str | None:
        """The best engine with room for all of ``members`` at once, or None (see the module docstring).
        Latency work considers engines running throughput work only with ``mix_kinds``."""
        demands = [self._demand(m, cluster) for m in members]
        caps = [d.cap for d in demands if d.cap is not None]
        cap = min(caps) if caps else None
        kind = WorkKind.LATENCY if any(d.kind is WorkKind.LATENCY for d in demands) else WorkKind.THROUGHPUT
        requests = [m.request for m in members]
        names = set(members[0].candidates).intersection(*(m.candidates for m in members[1:]))
        if only is not None:
            names &= set(only)
        extra = {e: occ.extra_tokens(e, requests) for e in names}
        room = [e for e in names
                if (occ.fits(e, extra[e], cap, members=len(members))
                    or self._within_budget(e, requests, demands, extra[e], occ, cluster))
                and (mix_kinds or kind is WorkKind.THROUGHPUT or WorkKind.THROUGHPUT not in occ.kinds[e])]
        if not room:
            return None

        def score(e: str) -> tuple:
            prefix = max(cluster.prefix_tokens(e, m.request) for m in members)
            return (e not in prefer, self._similarity(occ, e, kind), -prefix, occ.tokens[e], e)

        return min(room, key=score)

    @staticmethod
    def _similarity(occ: Occupancy, engine: str, kind: WorkKind) -> int:
        """Occupancy.similarity, except that for latency work an idle engine is as good as one running latency
        work: keeping idle engines for throughput work only matters while there is any (it has its own engines
        then), and spreading latency work leaves room next to each request for the later sharers of its prefix
        (a GPTs app's users, Fig. 17) instead of piling unrelated prefixes onto one engine."""
        sim = occ.similarity(engine, kind)
        if kind is WorkKind.LATENCY and sim == 1 and not any(WorkKind.THROUGHPUT in k for k in occ.kinds.values()):
            return 0
        return sim

    def _join_rather_than_spill(self, q: QueuedRequest, holders: Sequence[str], spill: str, occ: Occupancy,
                                ledger: CostLedger, cluster: ClusterView) -> str | None:
        """A holder of ``q``'s prefix that ``q`` should join beyond its caps rather than go to ``spill`` (an
        engine without the prefix), or None. In decode seconds added to the other requests over ``q``'s
        generation: joining adds one row with ``q``'s own tokens to every step of the holder; spilling makes
        ``spill`` prefill the prefix (a stall for everything there) and read it every step, next to ``q``'s own
        row. Only latency work with soft caps, a known step cost, holders running only latency work, and within
        KV; False positives are bounded by the engine's own KV and the sharing pass's limits."""
        demand = self._demand(q, cluster)
        if demand.kind is not WorkKind.LATENCY or demand.firm:
            return None
        cost = ledger.cost(spill)
        if cost is None:
            return None
        r = q.request
        steps = max(1, r.max_new_tokens)
        prefix = max(cluster.prefix_tokens(e, r) for e in holders)
        rows_s = occ.count[spill]
        spill_s = (cost.prefill_token_s * prefix * rows_s
                   + steps * (rows_s + 1) * cost.decode_ctx_s * prefix
                   + steps * rows_s * (cost.decode_row_s + cost.decode_ctx_s * max(0, r.tokens - prefix)))
        best: tuple[float, str] | None = None
        for e in holders:
            c = ledger.cost(e)
            if c is None or occ.firm[e] or occ.kinds[e] - {WorkKind.LATENCY}:
                continue
            extra = occ.extra_tokens(e, [r])
            kv = cluster.engines[e].capacity_tokens
            limit = self.caps.throughput_cap_tokens if kv is None else min(kv, self.caps.throughput_cap_tokens)
            if occ.tokens[e] + extra > limit:
                continue
            join_s = steps * occ.count[e] * (c.decode_row_s + c.decode_ctx_s * extra)
            if join_s < spill_s and (best is None or join_s < best[0]):
                best = (join_s, e)
        return best[1] if best is not None else None

    def _within_budget(self, engine: str, requests: Sequence[DispatchRequest], demands: Sequence[Demand],
                       extra_tokens: int, occ: Occupancy, cluster: ClusterView) -> bool:
        """Latency work beyond the engine's token cap that still keeps its decode step within the cap's time:
        the step of the engine filled to its latency cap with requests of these sizes counted in full (what the
        cap means, §8.1: the running tokens at which latency reaches its limit), against the estimated step with
        shared prefixes counted once and each request at its mean context over its life (prompt + half its new
        tokens). Only for latency work with soft caps on an engine running only latency work, within its KV,
        with a known step cost; False otherwise (then the token cap alone decides)."""
        ledger = getattr(self, "_ledger", None)
        if ledger is None or ledger.cluster is not cluster or ledger.occ is not occ:
            return False
        cost = ledger.cost(engine)
        if cost is None or occ.firm[engine] or WorkKind.THROUGHPUT in occ.kinds[engine] or \
                any(d.kind is not WorkKind.LATENCY or d.firm for d in demands):
            return False
        kv = cluster.engines[engine].capacity_tokens
        if kv is not None and occ.tokens[engine] + extra_tokens > kv:
            return False
        lat = _Latency(**vars(ledger.latency[engine]))
        for r, d in zip(requests, demands):
            lat.add(r.tokens, r.max_new_tokens, d.cap)
        if lat.cap is None or lat.rows == 0:
            return False
        mean = max(1, lat.tokens // lat.rows)
        budget = cost.step_s(max(1, math.ceil(lat.cap / mean)), lat.cap)
        ctx = occ.tokens[engine] + extra_tokens - lat.new_tokens / 2
        return cost.step_s(occ.count[engine] + len(requests), int(ctx)) <= budget

    def split_throughput(self, members: Sequence[QueuedRequest], occ: Occupancy, ledger: CostLedger,
                         cluster: ClusterView, *,
                         prefer: Collection[str] = ()) -> dict[str, list[QueuedRequest]] | None:
        """Throughput work ``members`` assigned member by member to the engine where each finishes first
        (cost_aware, rule a), or None to leave the decision to Algorithm 1's FindEngine: not throughput work, a
        step cost unknown on a candidate, or a split that does not finish ``SPLIT_GAIN`` sooner than the whole
        set on the engine FindEngine picks (or that leaves a member unplaced while FindEngine has room).

        The split uses FindEngine's engine and engines already running work: it never takes *another* idle
        engine, which Algorithm 1 keeps free for the other kind of work (taking idle engines for the map stages
        made chats wait in the GPU mixed experiment). Engines running latency work take members only within
        their token cap (room kept for latency work) and their latency budget, and a member goes there only if
        it finishes sooner by more than the latency it adds to the latency requests there (rule c,
        :meth:`CostLedger.latency_harm_s`)."""
        demands = [self._demand(m, cluster) for m in members]
        if any(d.kind is not WorkKind.THROUGHPUT for d in demands):
            return None
        names = set(members[0].candidates).intersection(*(m.candidates for m in members[1:]))
        if not names or any(ledger.cost(e) is None for e in names):
            return None
        whole = self.find_engine(members, occ, cluster, prefer=prefer)
        if whole is not None:
            names = {e for e in names if e == whole or occ.count[e] > 0}
        trial_occ = occ.copy()
        trial = ledger.copy(trial_occ)
        new_tokens: dict[str, int] = {}
        parts: dict[str, list[QueuedRequest]] = {}
        for m, d in sorted(zip(members, demands), key=lambda md: (-md[0].tokens, md[0].ticket)):
            best: tuple | None = None
            for e in names:
                extra = trial_occ.extra_tokens(e, [m.request])
                if not trial_occ.fits(e, extra, d.cap) or \
                        (trial.latency[e].rows and not trial.admits(e, [m.request], [d], extra)):
                    continue
                finish = trial.finish_s(e, max(new_tokens.get(e, 0), m.request.max_new_tokens), 1, extra,
                                        max(0, extra - m.request.max_new_tokens))
                # next to latency work, the seconds it adds to the latency requests count against it
                key = (finish + trial.latency_harm_s(e, m.request, extra), e not in prefer, e)
                if best is None or key < best[0]:
                    best = (key, e, extra)
            if best is None:
                continue
            _, e, extra = best
            trial.add(e, m.request, d, extra)
            trial_occ.add(e, m.request, d)
            new_tokens[e] = max(new_tokens.get(e, 0), m.request.max_new_tokens)
            parts.setdefault(e, []).append(m)
        if not parts:
            return None
        if whole is None:
            return parts
        if sum(map(len, parts.values())) < len(members) or set(parts) == {whole}:
            return None
        split_s = max(trial.finish_s(e, new_tokens[e]) for e in parts)
        requests = [m.request for m in members]
        extra = occ.extra_tokens(whole, requests)
        whole_s = ledger.finish_s(whole, max(r.max_new_tokens for r in requests), len(members), extra,
                                  max(0, extra - sum(r.max_new_tokens for r in requests)))
        return parts if split_s < (1 - SPLIT_GAIN) * whole_s else None

    def _paced(self, q: QueuedRequest, ledger: CostLedger, cluster: ClusterView) -> bool:
        """Whether ``q`` is placed by :meth:`fill_throughput`: throughput work, pacing on, a clock, and a step
        cost known on every candidate."""
        return (self.backlog_s is not None and cluster.now is not None and bool(q.candidates)
                and self._demand(q, cluster).kind is WorkKind.THROUGHPUT
                and all(ledger.cost(e) is not None for e in q.candidates))

    def fill_throughput(self, members: Sequence[QueuedRequest], occ: Occupancy, ledger: CostLedger,
                        cluster: ClusterView) -> list[tuple[QueuedRequest, str]]:
        """Paced placement of throughput ``members`` (in queue order), one by one, each on the engine where it
        finishes first (CostLedger.finish_s plus the latency it adds to latency work there), among engines whose
        pending prefill is under ``backlog_s`` and which have room under their caps. Engines running latency
        work are used only when every candidate runs some (then within their latency budget, rule c of
        cost_aware). The rest waits; if an engine was skipped for its backlog, :meth:`next_round_at` is when the
        first such backlog drains under the bound. Each placement is recorded in ``occ`` and ``ledger`` here."""
        assert self.backlog_s is not None and cluster.now is not None
        names = set(members[0].candidates).intersection(*(m.candidates for m in members[1:]))
        free = {e for e in names if WorkKind.LATENCY not in occ.kinds[e]}
        out = []
        for m in members:
            pool = self.throughput_pool(m, names, free, occ, ledger)
            d = self._demand(m, cluster)
            best: tuple | None = None
            for e in pool:
                cost = ledger.cost(e)
                assert cost is not None
                backlog = ledger.prefill[e] * cost.prefill_token_s
                if backlog >= self.backlog_s:
                    wake = cluster.now + backlog - self.backlog_s + 1e-3
                    self._wake_at = wake if self._wake_at is None else min(self._wake_at, wake)
                    continue
                extra = occ.extra_tokens(e, [m.request])
                if not self.throughput_room(e, m, d, extra, occ, ledger):
                    continue
                finish = ledger.finish_s(e, m.request.max_new_tokens, 1, extra,
                                         max(0, extra - m.request.max_new_tokens))
                key = (finish + ledger.latency_harm_s(e, m.request, extra), e)
                if best is None or key < best:
                    best = key
            if best is None:
                break  # nothing has room now: the rest keeps its place in the queue
            engine = best[1]
            out.append((m, engine))
            ledger.add(engine, m.request, d, occ.extra_tokens(engine, [m.request]))
            occ.add(engine, m.request, d)
        return out

    def throughput_room(self, e: str, m: QueuedRequest, d: Demand, extra: int, occ: Occupancy,
                        ledger: CostLedger) -> bool:
        """Whether throughput request ``m`` (demand ``d``, adding ``extra`` tokens) has room on ``e`` now: under
        the engine's caps and, next to latency work, within its latency budget (cost_aware rule c)."""
        return occ.fits(e, extra, d.cap) and not (ledger.latency[e].rows and
                                                  not ledger.admits(e, [m.request], [d], extra))

    def throughput_pool(self, m: QueuedRequest, names: Collection[str], free: Collection[str], occ: Occupancy,
                        ledger: CostLedger) -> list[str]:
        """The engines :meth:`fill_throughput` may place throughput request ``m`` on (before backlog and room):
        Algorithm 1's split -- the engines running no latency work (``free``) when there are any, else all
        ``names``. A subclass may add latency engines where sharing costs the latency work nothing."""
        return sorted(free or names)

    def share_latency_engine(self, q: QueuedRequest, occ: Occupancy, cluster: ClusterView) -> str | None:
        """A busy engine running only latency work with soft caps that ``q`` (latency work without a TPOT
        target) may join beyond its cap, or None (see the module docstring)."""
        demand = self._demand(q, cluster)
        if demand.kind is not WorkKind.LATENCY or demand.firm:
            return None
        ends: dict[str, int] = {}
        for e in q.candidates:
            if occ.count[e] == 0 or occ.kinds[e] != {WorkKind.LATENCY} or occ.firm[e]:
                continue
            kv = cluster.engines[e].capacity_tokens
            limit = self.caps.throughput_cap_tokens if kv is None else min(kv, self.caps.throughput_cap_tokens)
            end = occ.tokens[e] + occ.extra_tokens(e, [q.request])
            if end <= limit:
                ends[e] = end
        return min(ends, key=lambda e: (ends[e], e)) if ends else None

    def _demand(self, q: QueuedRequest, cluster: ClusterView) -> Demand:
        cost = cluster.engines[q.candidates[0]].step_cost if q.candidates else None
        return self.demand(q.request, q.info, cluster.group_tokens(q.group_key, q.tokens), cost)


def _share_prefix(a: QueuedRequest, b: QueuedRequest) -> bool:
    """Both wait with a common PrefixHash (Algorithm 1, SharedReqsInQueue) and can run on a common engine."""
    return bool(set(a.request.prefix_hashes) & set(b.request.prefix_hashes)) and \
        bool(set(a.candidates) & set(b.candidates))


def _without_group(q: QueuedRequest) -> QueuedRequest:
    label = q.info.label
    if label is None or label.task_group is None:
        return q
    return dataclasses.replace(q, info=dataclasses.replace(q.info, label=dataclasses.replace(label, task_group=None)))
