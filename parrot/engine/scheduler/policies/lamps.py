"""LAMPS (``lamps``): waiting requests by predicted memory over time, starving ones first; paused contexts get the
handling predicted when their op was queued. No torch.

Order (LAMPS §4.3-4.4): once any waiting op carries the manager's predictions (an ``OpHint``), waiting ops go by
:func:`~parrot.engine.scheduler.tool_handling.memory_time` through a
:class:`~parrot.engine.scheduler.lamps.LampsRanker` (ascending score, starving ops first, ties by service order);
without any hint there is nothing to rank by and the order is the service order (FCFS). LAMPS ranks *requests*
waiting to start; a request here is a fill and then a generate on one context, so a generate whose request already
started on this engine is the running request's next phase and goes before every ranked op::

    waiting:  f1(new, 900 out)  g2(started)  f3(new, 4 out)
    order:    g2 | f3  f1                               started first (service order), then by score

Paused contexts: LAMPS §4.2, the least-waste handling from the op's predictions when it is queued, used at the
pause (:class:`~.pauses.PredictedPauses`).
"""

from __future__ import annotations

from collections.abc import Sequence

from parrot.engine.runtime.context import Op, OpKind
from parrot.engine.scheduler.lamps import LampsRanker
from parrot.engine.scheduler.policies.base import EnginePolicy, EngineView
from parrot.engine.scheduler.policies.pauses import PredictedPauses
from parrot.engine.scheduler.tool_handling import memory_time


class LampsOrder(EnginePolicy):
    def __init__(self, name: str, starvation_threshold: int = 100, refresh_interval: int = 1) -> None:
        super().__init__(name)
        self.ranker: LampsRanker[int] = LampsRanker(starvation_threshold, refresh_interval)

    def order(self, view: EngineView) -> list[Op]:
        waiting = view.waiting
        if not any(o.hint is not None for o in waiting):
            return list(waiting)
        started = [o for o in waiting if _started(o)]
        running = view.running_tokens()  # one sum per ranking (a waiting op's context has no running op)
        ranked = self.ranker.order([o for o in waiting if not _started(o)], lambda o: o.seq_no,
                                   lambda o: self.key(o, view, running))
        return started + ranked

    def key(self, op: Op, view: EngineView, running_tokens: int | None = None) -> float:
        """What the ranker orders waiting ops by (ascending): here the segment's :meth:`score`."""
        return self.score(op, view, running_tokens)

    def after_admission(self, admitted: Sequence[Op], still_waiting: Sequence[Op]) -> None:
        """LAMPS §4.4: one pass counted per iteration waited."""
        self.ranker.after_admission((o.seq_no for o in admitted), (o.seq_no for o in still_waiting))

    def forget(self, op: Op) -> None:
        self.ranker.forget(op.seq_no)

    def score(self, op: Op, view: EngineView, running_tokens: int | None = None) -> float:
        """LAMPS' rank of a waiting op: its request segment's memory over time (prompt, of which the KV already held
        or cached costs no prefill, predicted output, the tool call's handling, with the running batch as the rest
        of memory), lower admitted first. A fill is scored as the segment its hint describes (the generate that
        follows it); without a hint its output is the engine's mean. ``running_tokens``: the running ops' context
        tokens, if the caller has summed them already."""
        hint = op.hint
        pred = hint.predicted_output_tokens if hint is not None else None
        out = pred if pred is not None else int(view.mean_output_tokens)
        if op.kind is OpKind.GENERATE and op.sampling is not None:
            out = min(out, op.sampling.max_tokens)
        tool_s = view.expected_tool_s(hint.tool) if hint is not None and hint.tool is not None else None
        prompt = len(op.ctx.tokens)
        return memory_time(prompt_tokens=prompt, output_tokens=max(0, out), tool_s=tool_s,
                           handling=op.handling if tool_s is not None else None, costs=view.costs,
                           other_tokens=view.running_tokens(exclude=op.ctx) if running_tokens is None
                           else running_tokens,
                           cached_tokens=min(prompt, view.cached_tokens(op)))


class LampsPolicy(LampsOrder, PredictedPauses):
    """Memory-over-time ranking with starvation prevention; predicted handling (``lamps``)."""


def _started(op: Op) -> bool:
    """A generate whose request already began on this engine: its prompt's KV is (or was, before a preemption)
    computed here."""
    return op.is_generate and (op.ctx.num_computed > 0 or op.num_preemptions > 0)
