"""The engine's wait-queue order for admission (a local policy): FCFS, or Preble's priority groups (§4.3). No torch.

``preble``: a waiting op's priority is its cached-token ratio in ``P`` steps, ``g = floor(P * cached / tokens)``
(63 of 100 tokens cached, P = 10 -> group 6; fully cached -> group P). Admission takes groups in rounds, highest
first, ``g + 1`` ops from group ``g`` per round, FCFS inside a group, so every group is served in proportion to
its priority and none starves::

    groups (P = 3):   g3: a b c d   g2: e f   g1: (none)   g0: h i
    order:            a b c d | e f | h | i            (round 1: 4 from g3, 3 from g2, 1 from g0; round 2: ...)

The order is recomputed at every iteration (caching changes as prefixes are computed or evicted); the scheduler
admits down the order until a budget, the token cap or KV stops it (the op that could not be admitted waits at
the head: the same head-of-line rule as FCFS).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

LOCAL_POLICIES = ("fcfs", "preble")

T = TypeVar("T")


def priority_group(cached: int, tokens: int, groups: int) -> int:
    """Group 0..``groups`` of an op with ``cached`` of its ``tokens`` cached."""
    if tokens <= 0:
        return groups
    return min(groups, max(0, (groups * cached) // tokens))


def admission_order(waiting: Sequence[T], policy: str, groups: int, cached: Callable[[T], int],
                    tokens: Callable[[T], int] | None = None) -> list[T]:
    """``waiting`` (FCFS order) in the order ``policy`` admits it; ``cached(op)`` / ``tokens(op)`` count an op's
    cached and total context tokens (default: ``len(op.ctx.tokens)``)."""
    if policy == "fcfs":
        return list(waiting)
    if policy != "preble":
        raise ValueError(f"unknown local policy {policy!r} (known: {', '.join(LOCAL_POLICIES)})")
    size = tokens or (lambda op: len(op.ctx.tokens))  # type: ignore[attr-defined]
    by_group: list[list[T]] = [[] for _ in range(groups + 1)]
    for op in waiting:
        by_group[priority_group(cached(op), size(op), groups)].append(op)
    order: list[T] = []
    pos = [0] * (groups + 1)
    while len(order) < len(waiting):
        for g in range(groups, -1, -1):
            take = by_group[g][pos[g]:pos[g] + g + 1]
            pos[g] += len(take)
            order.extend(take)
    return order
