"""LAMPS ranked per request (``lamps-request``): a waiting op's score is the memory over time of its request's
*remaining* segments, not of the next one alone. No torch.

``lamps`` scores the segment a waiting op starts (LAMPS §4.2: "each call is treated independently"), so a
multi-call request's later segment, carrying its grown context, ranks behind new requests' first segments. Here
the op's hint also lists the request's later segments (``OpHint.later``, each with the tokens its tool returns) and
the score sums their memory-over-time curves, the context growing segment by segment::

    segment:   now (this op)            later[0]                 later[1]
    context:   | P | o0 |~tool0~| r0 | o1 |~tool1~| r1 | o2 |
    score:     mt(P, o0, tool0)  +  mt(P+o0+r0, o1, tool1)  +  mt(P+o0+r0+o1+r1, o2)

``mt`` is :func:`~parrot.engine.scheduler.tool_handling.memory_time`: a later segment's prompt is held (cached)
but for the tool's returned tokens, and its pause gets the least-waste handling predicted now (LAMPS §4.2 with
the running batch as the other requests). A resumed request thus ranks by the work it has left: shortest
remaining memory-time first. An op without ``later`` scores as under ``lamps``. The rest of the admission order
is ``lamps``' (started generates first, then ascending score, starving ops first by the counters of §4.4), and so
is the handling of a paused context (least waste predicted when its op is queued, LAMPS §4.2).
"""

from __future__ import annotations

from parrot.engine.runtime.context import Op
from parrot.engine.scheduler.policies.base import EngineView
from parrot.engine.scheduler.policies.lamps import LampsOrder
from parrot.engine.scheduler.policies.pauses import PredictedPauses
from parrot.engine.scheduler.tool_handling import choose_handling, memory_time


class LampsRequestOrder(LampsOrder):
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
    """Request-level memory-over-time ranking with starvation prevention; predicted handling (``lamps-request``)."""
