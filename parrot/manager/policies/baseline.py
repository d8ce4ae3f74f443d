"""Request-centric policies: the paper's baselines (§8.1) and the plain least-loaded dispatcher.

* ``fifo-latency`` / ``fifo-throughput`` (:class:`FifoPolicy`): what FastChat does in front of vLLM engines.
  Every request is treated alike (the service does not know the application): one FIFO queue, dispatch to
  the engine with the fewest requests in flight ("shortest queue"), and a per-engine cap on running tokens,
  tuned for per-request latency (small) or for throughput (large). When the queue's head fits on no engine,
  everyone waits behind it (strict FIFO). Token accounting is the shared one (a prompt prefix shared by
  requests on one engine counts once); OpenAI-style requests carry no prefix hashes, so for them it is a sum.
* ``least-loaded`` (:class:`LeastLoadedPolicy`): never queues; fewest in-flight requests, with optional
  prefix affinity. Engines batch whatever they receive.
"""

from __future__ import annotations

from collections.abc import Sequence

from parrot.common.step_cost import StepCost
from parrot.manager.perf_deduction import SchedInfo
from parrot.manager.policies.base import (
    ClusterView,
    Demand,
    DispatchRequest,
    EngineLoad,
    Occupancy,
    PerRequestPolicy,
    Placement,
    Policy,
    QueuedRequest,
    WorkKind,
)


class FifoPolicy(Policy):
    """FIFO queue + least-queue dispatch + one token cap for every request (labels are ignored)."""

    def __init__(self, cap_tokens: int, *, name: str = "fifo") -> None:
        if cap_tokens < 1:
            raise ValueError(f"cap_tokens must be >= 1, got {cap_tokens!r}")
        self.cap_tokens = cap_tokens
        self.name = name

    def demand(self, request: DispatchRequest, info: SchedInfo, group_tokens: int,
               cost: StepCost | None = None) -> Demand:
        return Demand(self.cap_tokens, WorkKind.LATENCY)

    def place(self, queue: Sequence[QueuedRequest], cluster: ClusterView) -> list[Placement]:
        occ = Occupancy(cluster)
        out: list[Placement] = []
        for q in sorted(queue, key=lambda q: (q.enqueued_at, q.ticket)):
            room = [e for e in q.candidates if occ.fits(e, occ.extra_tokens(e, [q.request]), self.cap_tokens)]
            if not room:
                break  # head-of-line: nobody overtakes the oldest request
            engine = min(room, key=lambda e: (occ.count[e], occ.tokens[e], e))
            occ.add(engine, q.request, Demand(self.cap_tokens, WorkKind.LATENCY))
            out.append(Placement(q.ticket, engine))
        return out


class LeastLoadedPolicy(PerRequestPolicy):
    """Fewest in-flight requests, then fewest tokens (in flight here + engine-reported), then name.

    With ``prefix_affinity`` an engine holding the request's longest shared prefix wins instead, as long as it
    has at most ``affinity_slack`` more requests in flight than the least loaded candidate (so one popular
    system prompt cannot pile every request onto one engine).
    """

    name = "least-loaded"

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


class RoundRobinPolicy(PerRequestPolicy):
    """Data-parallel round robin (Preble §5.2's SGLang/vLLM baseline): each request goes to the next candidate in
    name order after the engine the previous request got; each engine keeps its own prefix cache."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, request: DispatchRequest, candidates: Sequence[EngineLoad]) -> str:
        names = sorted(c.name for c in candidates)
        pick = next((n for n in names if self._last is not None and n > self._last), names[0])
        self._last = pick
        return pick
