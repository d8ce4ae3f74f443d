"""The graph's status state machines: requests move only along REQUEST_TRANSITIONS, variables along
VAR_TRANSITIONS; an illegal change raises IllegalTransition and changes nothing."""

from __future__ import annotations

import pytest

from parrot.common.errors import StepFailed, VariableAlreadySet
from parrot.common.template import parse_template
from parrot.manager.graph import (
    REQUEST_TRANSITIONS,
    VAR_TRANSITIONS,
    Graph,
    IllegalTransition,
    PlaceholderBinding,
    RequestStatus,
    VarStatus,
)
from status_tables import walk_transitions


def _pairs(table) -> set:
    return {(a, b) for a, nexts in table.items() for b in nexts}


def test_request_status_moves_only_along_the_transition_table():
    S = RequestStatus
    used = {  # every change parrot/manager/executor.py makes
        (S.WAITING, S.READY),  # inputs materialized (_start)
        (S.READY, S.RUNNING),  # an engine leased (_run)
        (S.RUNNING, S.READY),  # the engine was lost: rescheduled
        (S.RUNNING, S.FINISHED),
        (S.WAITING, S.FAILED), (S.READY, S.FAILED), (S.RUNNING, S.FAILED),  # failed input / run, session closed
    }
    assert _pairs(REQUEST_TRANSITIONS) == used
    g = Graph("s", clock=lambda: 5.0)

    def make():
        return g.add_request("f", parse_template("{{output:x}}"), [PlaceholderBinding("x", True, None)])

    assert walk_transitions(REQUEST_TRANSITIONS, S.WAITING, make, g.set_status, IllegalTransition) == len(used)


def test_an_illegal_request_change_leaves_status_and_times_alone():
    times = iter(range(100))
    g = Graph("s", clock=lambda: float(next(times)))
    req = g.add_request("f", parse_template("{{output:x}}"), [PlaceholderBinding("x", True, None)])
    for s in (RequestStatus.READY, RequestStatus.RUNNING, RequestStatus.FINISHED):
        g.set_status(req, s)
    before = req.times.to_dict()
    with pytest.raises(IllegalTransition, match="finished -> running"):
        g.set_status(req, RequestStatus.RUNNING)
    assert req.status is RequestStatus.FINISHED and req.times.to_dict() == before


def test_variable_status_moves_only_along_the_transition_table():
    assert _pairs(VAR_TRANSITIONS) == {(VarStatus.PENDING, VarStatus.READY), (VarStatus.PENDING, VarStatus.FAILED)}
    g = Graph("s")
    walk_transitions(VAR_TRANSITIONS, VarStatus.PENDING, g.add_variable, Graph._set_var_status, IllegalTransition)
    # the public calls keep their caller-facing answers before the table is consulted
    v = g.add_variable("v", "x")
    with pytest.raises(VariableAlreadySet):
        g.materialize(v.var_id, "y")
    assert not g.fail_variable(v.var_id, StepFailed("late", cause_code="x")) and v.status is VarStatus.READY
    w = g.add_variable("w")
    assert g.fail_variable(w.var_id, StepFailed("boom", cause_code="x")) and w.done and w._done.is_set()
