"""The adapter's context tree (parrot.backends.contexts): forks share, appends after a fork do not leak into
children, freeing keeps what children need."""

from __future__ import annotations

import pytest

from parrot.backends.contexts import ContextTree
from parrot.common.errors import UnknownContext


def test_fork_shares_parent_and_appends_stay_private():
    t = ContextTree()
    t.open("p", None)
    t.append("p", [1, 2, 3])
    t.open("a", "p")
    t.append("a", [4])
    t.open("b", "p")
    t.append("b", [5, 6])
    assert t.sequence("a") == [1, 2, 3, 4] and t.sequence("b") == [1, 2, 3, 5, 6]
    t.append("p", [9])  # the parent grows after forking: its children must not see it
    assert t.sequence("p") == [1, 2, 3, 9] and t.sequence("a") == [1, 2, 3, 4]
    t.open("c", "p")  # a later fork sees the parent as it is now
    assert t.sequence("c") == [1, 2, 3, 9] and t.length("c") == 4
    assert t.total_items() == 3 + 1 + 2 + 1  # shared items counted once


def test_free_keeps_children_and_rejects_unknown():
    t = ContextTree()
    t.open("p", None)
    t.append("p", [1, 2])
    t.open("a", "p")
    t.append("a", [3])
    t.free("p")
    assert "p" not in t and t.sequence("a") == [1, 2, 3]
    with pytest.raises(UnknownContext):
        t.open("b", "p")
    with pytest.raises(UnknownContext):
        t.free("p")
    t.free("a")
    assert len(t) == 0 and t.total_items() == 0


def test_existing_context_keeps_its_parent():
    t = ContextTree()
    t.open("p", None)
    t.append("p", [1])
    node, created = t.open("a", "p")
    assert created
    again, created = t.open("a", None)
    assert again is node and not created
