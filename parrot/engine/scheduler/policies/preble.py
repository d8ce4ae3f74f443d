"""Preble's local policy (§4.3): waiting ops in priority groups by cached-token ratio; paused contexts preserved.
No torch.

A waiting op's priority is its cached-token ratio in ``P`` steps, ``g = floor(P * cached / tokens)`` (63 of 100
tokens cached, P = 10 -> group 6; fully cached -> group P). Admission takes groups in rounds, highest first,
``g + 1`` ops from group ``g`` per round, service order (FCFS) inside a group, so every group is served in
proportion to its priority and none starves::

    groups (P = 3):   g3: a b c d   g2: e f   g1: (none)   g0: h i
    order:            a b c d | e f | h | i            (round 1: 4 from g3, 3 from g2, 1 from g0; round 2: ...)

The order is recomputed at every iteration (caching changes as prefixes are computed or evicted) and keeps no
state. A context paused for a tool call keeps its KV (Preble has no tool calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from parrot.engine.runtime.context import Op
from parrot.engine.scheduler.policies.base import EnginePolicy, EngineView
from parrot.engine.scheduler.policies.pauses import PreservePauses

T = TypeVar("T")


def priority_group(cached: int, tokens: int, groups: int) -> int:
    """Group 0..``groups`` of an op with ``cached`` of its ``tokens`` cached."""
    if tokens <= 0:
        return groups
    return min(groups, max(0, (groups * cached) // tokens))


def preble_order(waiting: Sequence[T], groups: int, cached: Callable[[T], int], tokens: Callable[[T], int]) -> list[T]:
    """``waiting`` (service order) in Preble's admission order; ``cached(op)`` / ``tokens(op)`` count an op's cached
    and total context tokens."""
    by_group: list[list[T]] = [[] for _ in range(groups + 1)]
    for op in waiting:
        by_group[priority_group(cached(op), tokens(op), groups)].append(op)
    order: list[T] = []
    pos = [0] * (groups + 1)
    while len(order) < len(waiting):
        for g in range(groups, -1, -1):
            take = by_group[g][pos[g]:pos[g] + g + 1]
            pos[g] += len(take)
            order.extend(take)
    return order


class PrebleOrder(EnginePolicy):
    def __init__(self, name: str, groups: int = 10) -> None:
        if groups < 1:
            raise ValueError(f"priority_groups must be >= 1, got {groups!r}")
        super().__init__(name)
        self.groups = groups

    def order(self, view: EngineView) -> list[Op]:
        return preble_order(view.waiting, self.groups, view.cached_tokens, lambda op: len(op.ctx.tokens))

    def after_admission(self, admitted: Sequence[Op], still_waiting: Sequence[Op]) -> None:
        """The groups are recomputed every iteration: no per-op state."""
        return None

    def forget(self, op: Op) -> None:
        """No per-op state."""
        return None


class PreblePreserve(PrebleOrder, PreservePauses):
    """Preble's priority groups; a paused context keeps its KV (``preble``)."""
