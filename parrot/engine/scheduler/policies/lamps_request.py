"""LAMPS ranked per request (``lamps-request``): a waiting op's score is the memory over time of its request's
*remaining* segments, not of the next one alone, aged by how long the request has been in the system. No torch.

``lamps`` scores the segment a waiting op starts (LAMPS §4.2: "each call is treated independently"), so a
multi-call request's later segment, carrying its grown context, ranks behind new requests' first segments. Here
the op's hint also lists the request's later segments (``OpHint.later``, each with the tokens its tool returns) and
the score sums their memory-over-time curves, the context growing segment by segment::

    segment:   now (this op)            later[0]                 later[1]
    context:   | P | o0 |~tool0~| r0 | o1 |~tool1~| r1 | o2 |
    score:     mt(P, o0, tool0)  +  mt(P+o0+r0, o1, tool1)  +  mt(P+o0+r0+o1+r1, o2)

``mt`` is :func:`~parrot.engine.scheduler.tool_handling.memory_time`: a later segment's prompt is held (cached)
but for the tool's returned tokens, and its pause gets the least-waste handling predicted now (LAMPS §4.2 with
the running batch as the other requests). An op without ``later`` scores as under ``lamps``.

Aging (the tail): shortest-remaining-first alone keeps putting a long multi-call request back behind every
shorter newcomer, once per segment, so its latency grows with the load (the p99). Waiting ops are therefore
admitted by a *virtual finish time*: the time the op's request started plus its remaining score spread over
``aging_tokens`` tokens of memory::

    key(op) = request_start(op) + score(op) / K          K = aging_tokens (token-s per s), ascending key first

    a: started   0 s, score 9000 tok-s  ->  0 + 9000/50 = 180
    b: started 100 s, score 2000 tok-s  ->  100 + 2000/50 = 140         order: b a
    c: started 150 s, score 2000 tok-s  ->  150 + 2000/50 = 190         order: b a c   (a is no longer passed)

Invariant: an op goes before one whose request started ``d`` seconds earlier only if its score is lower by more
than ``K * d``. So requests of one age keep shortest-remaining order, and a request with score ``S`` can be passed
only by requests that start less than ``S / K`` seconds after it: finitely many at any rate, whatever the
starvation guard does (``K`` -> 0: pure remaining-score order; ``K`` -> infinity: FCFS by request start).
``request_start`` is when the op's request began on the engine's clock: the op's arrival less the request's
elapsed time its sender states (``OpHint.elapsed_s``: each segment of a tool-calling request arrives as a new
context, so the engine cannot tell on its own); without it, the op's own arrival (the age counted is then the
segment's wait only, which does not bound the tail: docs/results/tools/sim.md).

The rest of the admission order is ``lamps``' (started generates first, then ascending key, starving ops first by
the counters of §4.4, unchanged), and so is the handling of a paused context (least waste predicted when its op is
queued, LAMPS §4.2).
"""

from __future__ import annotations

from parrot.engine.runtime.context import Op
from parrot.engine.scheduler.policies.base import EngineView
from parrot.engine.scheduler.policies.lamps import LampsOrder
from parrot.engine.scheduler.policies.pauses import PredictedPauses
from parrot.engine.scheduler.tool_handling import choose_handling, memory_time

AGING_TOKENS = 50.0
"""``K`` of the virtual finish time: token-seconds of remaining score worth one second of a request's age."""


def request_start(op: Op) -> float:
    """When ``op``'s request began on the engine's clock: its arrival less ``OpHint.elapsed_s`` (else its arrival)."""
    elapsed = op.hint.elapsed_s if op.hint is not None else None
    return op.arrival - elapsed if elapsed is not None else op.arrival


class LampsRequestOrder(LampsOrder):
    def __init__(self, name: str, starvation_threshold: int = 100, refresh_interval: int = 1,
                 aging_tokens: float = AGING_TOKENS) -> None:
        """``aging_tokens``: ``K`` of :meth:`key` (> 0)."""
        super().__init__(name, starvation_threshold, refresh_interval)
        if not aging_tokens > 0.0:
            raise ValueError(f"aging_tokens must be > 0, got {aging_tokens!r}")
        self.aging_tokens = aging_tokens

    def key(self, op: Op, view: EngineView, running_tokens: int | None = None) -> float:
        """The op's virtual finish time (seconds, engine clock): its request's start plus :meth:`score` over
        ``aging_tokens``; lower is admitted first."""
        return request_start(op) + self.score(op, view, running_tokens) / self.aging_tokens

    def score(self, op: Op, view: EngineView, running_tokens: int | None = None) -> float:
        """:meth:`LampsOrder.score` of the segment ``op`` starts, plus the memory over time of the request's later
        segments (``op.hint.later``) from the context this one leaves."""
        area = super().score(op, view, running_tokens)
        hint = op.hint
        if hint is None or not hint.later:
            return area
        other = view.running_tokens(exclude=op.ctx) if running_tokens is None else running_tokens
        mean_out = int(view.mean_output_tokens)
        out = hint.predicted_output_tokens if hint.predicted_output_tokens is not None else mean_out
        returned = hint.predicted_return_tokens or 0
        ctx = len(op.ctx.tokens) + max(0, out) + returned
        for seg in hint.later:
            out = max(0, seg.predicted_output_tokens if seg.predicted_output_tokens is not None else mean_out)
            tool_s = view.expected_tool_s(seg.tool) if seg.tool is not None else None
            handling = None
            if tool_s is not None:
                c = ctx + out
                handling = choose_handling(context_tokens=c, other_tokens=other, batch_tokens=c + other,
                                           tool_s=tool_s, costs=view.costs, allowed=view.allowed_handlings)
            area += memory_time(prompt_tokens=ctx, output_tokens=out, tool_s=tool_s, handling=handling,
                                costs=view.costs, other_tokens=other, cached_tokens=max(0, ctx - returned))
            returned = seg.predicted_return_tokens or 0
            ctx += out + returned
        return area


class LampsRequestPolicy(LampsRequestOrder, PredictedPauses):
    """Request-level memory-over-time ranking aged by request start, with starvation prevention; predicted
    handling (``lamps-request``)."""
