"""How an engine policy keeps a context paused for a tool call (LAMPS §2.3, INFERCEPT). No torch.

Each class implements the pause half of :class:`~.base.EnginePolicy`; a policy combines one with an order::

    PreservePauses    keep the KV while the tool runs                               (preserve, fcfs, preble)
    DiscardPauses     free it; the resume recomputes it (vLLM)                      (discard)
    SwapPauses        copy it to the host store and back (unregistered: tests, profiling)
    LeastWastePauses  least INFERCEPT waste at the pause, from the actual context and batch  (infercept)
    PredictedPauses   least waste from the op's predictions when it is queued, used at the pause;
                      at the pause itself when nothing was predicted (LAMPS §4.2)           (lamps, lamps-fcfs)

The waste model is :mod:`parrot.engine.scheduler.tool_handling`'s.
"""

from __future__ import annotations

from parrot.engine.runtime.context import Context, Op
from parrot.protocol.interface import ToolHint
from parrot.engine.scheduler.policies.base import EnginePolicy, EngineView, least_waste
from parrot.engine.scheduler.tool_handling import Handling


class _DecidedAtPause(EnginePolicy):
    def handling_when_queued(self, op: Op, view: EngineView) -> Handling | None:
        """Nothing is decided before the pause."""
        return None


class PreservePauses(_DecidedAtPause):
    def handling_at_pause(self, ctx: Context, tool: ToolHint, queued: Handling | None,
                          view: EngineView) -> Handling:
        return Handling.PRESERVE


class DiscardPauses(_DecidedAtPause):
    def handling_at_pause(self, ctx: Context, tool: ToolHint, queued: Handling | None,
                          view: EngineView) -> Handling:
        return Handling.DISCARD


class SwapPauses(_DecidedAtPause):
    def handling_at_pause(self, ctx: Context, tool: ToolHint, queued: Handling | None,
                          view: EngineView) -> Handling:
        return Handling.SWAP


class LeastWastePauses(_DecidedAtPause):
    def handling_at_pause(self, ctx: Context, tool: ToolHint, queued: Handling | None,
                          view: EngineView) -> Handling:
        return least_waste(len(ctx.tokens), ctx, tool, view)


class PredictedPauses(EnginePolicy):
    def handling_when_queued(self, op: Op, view: EngineView) -> Handling | None:
        """LAMPS §4.2: from the op's predicted output (else the engine's mean) and tool duration, the batch now."""
        assert op.hint is not None and op.hint.tool is not None
        pred = op.hint.predicted_output_tokens
        c = len(op.ctx.tokens) + (pred if pred is not None else int(view.mean_output_tokens))
        return least_waste(c, op.ctx, op.hint.tool, view)

    def handling_at_pause(self, ctx: Context, tool: ToolHint, queued: Handling | None,
                          view: EngineView) -> Handling:
        return queued if queued is not None else least_waste(len(ctx.tokens), ctx, tool, view)
