"""What an engine (local) scheduling policy sees and decides: admission order and tool-pause handling. No torch.

The :class:`~parrot.engine.scheduler.scheduler.Scheduler` owns the queues, the budgets, the KV and preemption. Each
iteration it asks its policy for the waiting queue's admission order, admits down that order until a budget, the
token cap or KV stops it (the op that could not be admitted waits at the head, and the ops behind it), then tells
the policy who got in and who still waits. When a context pauses for a tool call it asks the policy how to keep its
KV; the scheduler does it. The policy reads the engine only through an :class:`EngineView` and writes nothing of it::

    Scheduler                                  EnginePolicy
    add(op) ------------------------------->   handling_when_queued(op, view)   (op has a tool hint)
    schedule(): ---------------------------->   order(view)                      -> [ops, admission order]
                admit down the order
                ---------------------------->   after_admission(admitted, still_waiting)
    remove(op) ----------------------------->   forget(op)                        (finished / aborted)
    pause(ctx, tool) ----------------------->   handling_at_pause(ctx, tool, queued, view)

A handling the engine cannot do (swap without a host store) becomes discard (the scheduler's rule, not the
policy's). Policies are made per engine by the registry (:mod:`parrot.engine.scheduler.policies`): one that keeps
state (LAMPS' counters) must not be shared between engines.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from parrot.engine.runtime.context import Context, Op
from parrot.protocol.interface import ToolHint
from parrot.engine.scheduler.tool_handling import Handling, ToolCosts, choose_handling


class EngineView(Protocol):
    """A read-only view of one engine's scheduler state (the scheduler is its only writer)."""

    @property
    def waiting(self) -> Sequence[Op]:
        """Waiting ops in service order: priority (``OpHint.priority``, lower first), then arrival (FCFS)."""
        ...

    @property
    def running(self) -> Sequence[Op]:
        ...

    @property
    def costs(self) -> ToolCosts:
        """The engine's measured recompute / swap / decode-step times."""
        ...

    @property
    def mean_output_tokens(self) -> float:
        """Mean output of the generates finished here (a prediction for ops without one)."""
        ...

    @property
    def allowed_handlings(self) -> tuple[Handling, ...]:
        """What this engine can do with a paused context (swap only with a host store)."""
        ...

    def cached_tokens(self, op: Op) -> int:
        """Tokens of ``op``'s context whose KV exists now (computed, or cached blocks admission would take)."""
        ...

    def running_tokens(self, exclude: Context | None = None) -> int:
        """Context tokens of the running ops (but ``exclude``'s)."""
        ...

    def expected_tool_s(self, tool: ToolHint) -> float:
        """The tool's expected duration: the hint's, else the mean of its past pauses here, else a default."""
        ...


@dataclass(frozen=True)
class EnginePolicyConfig:
    """The knobs the registry's factories take (each policy uses the ones it names)."""

    priority_groups: int = 10  # preble: priority groups P
    starvation_threshold: int = 100  # lamps: iterations waited before an op is starving
    refresh_interval: int = 1  # lamps: score refresh every N orderings

    def __post_init__(self) -> None:
        for name in ("priority_groups", "starvation_threshold", "refresh_interval"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")


class EnginePolicy(abc.ABC):
    """An engine's scheduling policy: the waiting queue's admission order, and the handling of paused contexts.

    Concrete policies combine one order (e.g. :class:`~.fcfs.FcfsOrder`) and one handling (e.g.
    :class:`~.pauses.PreservePauses`); ``name`` is the registry name it was made under.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # ---- admission order ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def order(self, view: EngineView) -> list[Op]:
        """``view.waiting`` in the order to admit it (a permutation of it; called only when ops wait)."""

    @abc.abstractmethod
    def after_admission(self, admitted: Sequence[Op], still_waiting: Sequence[Op]) -> None:
        """One iteration's outcome (called when something was admitted or still waits); read the sequences now,
        do not keep them."""

    @abc.abstractmethod
    def forget(self, op: Op) -> None:
        """``op`` left the queues (finished or aborted): drop whatever the policy keeps about it."""

    # ---- paused contexts ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def handling_when_queued(self, op: Op, view: EngineView) -> Handling | None:
        """The handling of the pause that follows ``op`` (it carries a tool hint), decided when it is queued; None:
        decided at the pause. Recorded on ``op.handling`` and handed back to :meth:`handling_at_pause`."""

    @abc.abstractmethod
    def handling_at_pause(self, ctx: Context, tool: ToolHint, queued: Handling | None,
                          view: EngineView) -> Handling:
        """How to keep ``ctx``'s KV while ``tool`` runs; ``queued``: what :meth:`handling_when_queued` chose for the
        op before the pause (None if nothing)."""


def least_waste(ctx_tokens: int, exclude: Context | None, tool: ToolHint, view: EngineView) -> Handling:
    """INFERCEPT's choice: the handling of least waste for a context of ``ctx_tokens`` with the running batch (but
    ``exclude``) as the other requests (:func:`~parrot.engine.scheduler.tool_handling.choose_handling`)."""
    other = view.running_tokens(exclude=exclude)
    return choose_handling(context_tokens=ctx_tokens, other_tokens=other, batch_tokens=ctx_tokens + other,
                           tool_s=view.expected_tool_s(tool), costs=view.costs, allowed=view.allowed_handlings)
