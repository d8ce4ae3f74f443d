"""Policies that admit waiting ops first come, first served, with each tool-pause handling. No torch.

Order: the waiting queue as it is kept, by service key (``OpHint.priority``, lower first, then arrival), so with
every priority 0 it is plain arrival order. Paused contexts, by registry name::

    fcfs        FCFS   preserve (the plain engine: a paused context keeps its KV)
    preserve    FCFS   preserve (the tool benchmark's name for the same policy)
    discard     FCFS   discard, recomputed at the resume (vLLM)
    infercept   FCFS   least waste, chosen at the pause (INFERCEPT)
    lamps-fcfs  FCFS   LAMPS' predicted handling (LAMPS §6.3's "handling only" ablation)

The order keeps no state.
"""

from __future__ import annotations

from collections.abc import Sequence

from parrot.engine.runtime.context import Op
from parrot.engine.scheduler.policies.base import EnginePolicy, EngineView
from parrot.engine.scheduler.policies.pauses import (DiscardPauses, LeastWastePauses, PredictedPauses, PreservePauses,
                                                     SwapPauses)


class FcfsOrder(EnginePolicy):
    def order(self, view: EngineView) -> list[Op]:
        return list(view.waiting)

    def after_admission(self, admitted: Sequence[Op], still_waiting: Sequence[Op]) -> None:
        """FCFS keeps no per-op state."""
        return None

    def forget(self, op: Op) -> None:
        """FCFS keeps no per-op state."""
        return None


class FcfsPreserve(FcfsOrder, PreservePauses):
    """FCFS; a paused context keeps its KV (``fcfs``, ``preserve``)."""


class FcfsDiscard(FcfsOrder, DiscardPauses):
    """FCFS; a paused context's KV is freed and recomputed at the resume (``discard``: vLLM)."""


class FcfsLeastWaste(FcfsOrder, LeastWastePauses):
    """FCFS; the least-waste handling chosen at the pause (``infercept``)."""


class FcfsPredicted(FcfsOrder, PredictedPauses):
    """FCFS; LAMPS' handling predicted when the op is queued (``lamps-fcfs``)."""


class FcfsSwap(FcfsOrder, SwapPauses):
    """FCFS; every paused context is swapped to the host store (discarded without one). Not in the registry: for
    tests and the swap-rate measurement of :mod:`parrot.sim.profile`."""
