"""The ``parrot`` policy: the paper's application-centric Algorithm 1 for requests with Semantic-Variable structure
and Preble's E2 (:mod:`parrot.manager.policies.e2`) for the unstructured ones, in one server."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from parrot.common.step_cost import StepCost
from parrot.manager.perf_deduction import SchedInfo
from parrot.manager.policies.app_centric import AppCentricPolicy
from parrot.manager.policies.base import (
    CapacityConfig,
    ClusterView,
    Demand,
    DispatchRequest,
    Occupancy,
    Placement,
    QueuedRequest,
    WorkKind,
)
from parrot.manager.policies.cost_aware import CostLedger
from parrot.manager.policies.e2 import E2Config, E2Policy


class AppCentricWithE2(AppCentricPolicy):
    """``--policy parrot``: Algorithm 1 (app-centric) for requests with Semantic-Variable structure, E2 for the
    unstructured ones (no session, prompt token ids known: OpenAI completions). Each round places the structured
    queue first, then E2 places the rest (the app-centric round sees E2's earlier placements as load).

    An unstructured request has no declared objective, so it is latency work (paper §8.1: request-centric
    services treat every request as latency-sensitive) with the latency cap: throughput work then keeps within
    that engine's latency budget. E2 chooses among the engines running no throughput work when there are any
    (Algorithm 1's separation of kinds: a chat must not decode behind a map stage's prefills) and have room for
    it, else among all."""

    def __init__(self, caps: CapacityConfig | None = None, e2: E2Config | None = None, **kw) -> None:
        super().__init__(caps, **kw)
        self.e2 = E2Policy(e2)

    def decision_counts(self) -> dict[str, int]:
        """E2's counters: the unstructured requests' decisions (structured ones follow Algorithm 1)."""
        return self.e2.decision_counts()

    @staticmethod
    def unstructured(request: DispatchRequest) -> bool:
        return request.session_id is None and request.prompt_token_ids is not None

    def demand(self, request: DispatchRequest, info: SchedInfo, group_tokens: int,
               cost: StepCost | None = None) -> Demand:
        if self.unstructured(request):
            return Demand(self.caps.latency_cap_tokens, WorkKind.LATENCY)
        return super().demand(request, info, group_tokens, cost)

    def place(self, queue: Sequence[QueuedRequest], cluster: ClusterView) -> list[Placement]:
        free = [q for q in queue if self.unstructured(q.request)]
        out = super().place([q for q in queue if not self.unstructured(q.request)], cluster) if len(free) < len(queue) \
            else []
        if free:
            throughput = {e for e, v in cluster.engines.items()
                          if any(p.demand.kind is WorkKind.THROUGHPUT for p in v.placed)}
            placed_now = {p.ticket: p.engine for p in out}
            for q in queue:
                if q.ticket in placed_now and not self.unstructured(q.request) \
                        and super().demand(q.request, q.info, q.tokens).kind is WorkKind.THROUGHPUT:
                    throughput.add(placed_now[q.ticket])
            occ = Occupancy(cluster)
            self._ledger = CostLedger(cluster, occ)
            free = [replace(q, candidates=self._latency_engines(q, throughput, occ, cluster)) for q in free]
            out += self.e2.place(free, cluster)
        return out

    def _latency_engines(self, q: QueuedRequest, throughput: set[str], occ: Occupancy,
                         cluster: ClusterView) -> tuple[str, ...]:
        """The candidates E2 may choose from for ``q``: the engines running no throughput work that have room
        for it (its latency cap in tokens, or the cap's step time, AppCentricPolicy._within_budget), else every
        candidate (the latency engines are full: a queue there costs more than a map stage's prefills)."""
        demand = self.demand(q.request, q.info, q.tokens)
        ok = []
        for e in q.candidates:
            if e in throughput:
                continue
            extra = occ.extra_tokens(e, [q.request])
            if occ.fits(e, extra, demand.cap) or self._within_budget(e, [q.request], [demand], extra, occ, cluster):
                ok.append(e)
        return tuple(ok) or q.candidates
