"""Test helper: walk a status transition table (every legal change accepted, every other one raised)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

import pytest


def walk_transitions(table: Mapping, start, make: Callable[[], object], move: Callable[[object, object], None],
                     error: type[BaseException]) -> int:
    """For every pair (old, new) of the table's statuses: ``make()`` a fresh object (in ``start``), bring it to
    ``old`` along legal moves, then ``move(obj, new)``: it must succeed iff ``new in table[old]``, else raise
    ``error`` and leave the status as it was. Returns the number of legal pairs."""
    paths = {start: []}  # status -> the moves that reach it from start
    todo = deque([start])
    while todo:
        s = todo.popleft()
        for nxt in table[s]:
            if nxt not in paths:
                paths[nxt] = paths[s] + [nxt]
                todo.append(nxt)
    assert set(paths) == set(table), f"unreachable from {start}: {set(table) - set(paths)}"
    legal = 0
    for old in table:
        for new in table:
            obj = make()
            for s in paths[old]:
                move(obj, s)
            assert obj.status is old
            if new in table[old]:
                move(obj, new)
                assert obj.status is new
                legal += 1
            else:
                with pytest.raises(error):
                    move(obj, new)
                assert obj.status is old
    return legal
