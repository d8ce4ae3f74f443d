"""LAMPS Fig. 3 reproduced: Table 1's three requests, budget 6, one request computing per unit."""

import pytest

from parrot.engine.scheduler.lamps import LampsRanker
from parrot.engine.scheduler.tool_handling import Handling
from parrot.sim.unit_schedule import (TABLE1, LampsPriority, UnitDeadlock, UnitRequest, fcfs, lamps_score,
                                      run_policy, simulate, sjf)


@pytest.mark.parametrize("policy, completion, average", [
    ("fcfs", {"R1": 8, "R2": 15, "R3": 12}, 11.66),       # Fig. 3(a), INFERCEPT
    ("sjf", {"R1": 12, "R2": 14, "R3": 5}, 10.33),        # Fig. 3(b)
    ("sjf_total", {"R1": 11, "R2": 18, "R3": 4}, 11.0),   # Fig. 3(c)
    ("lamps", {"R1": 12, "R2": 14, "R3": 4}, 10.0),       # Fig. 3(d)
])
def test_fig3_average_completion(policy, completion, average):
    s = run_policy(policy)
    assert s.completion == completion, s.gantt()
    assert s.average == pytest.approx(average, abs=0.01)


def test_lamps_order_comes_from_memory_time():
    scores = {r.name: lamps_score(r, 6) for r in TABLE1}
    # R1: decode 1+2+3+4+5 = 15, preserve 2 units x 5 = 10, post token holds 6 -> 31
    # R2: decode 1, recompute 1 token x (own 1 + batch 5) = 6, post holds 2 -> 9
    # R3: decode 1+2 = 3, swap free, post holds 3 -> 6
    assert scores == {"R1": 31.0, "R2": 9.0, "R3": 6.0}
    order = LampsRanker().order(list(TABLE1), key=lambda r: r.name, score=lambda r: lamps_score(r, 6))
    assert [r.name for r in order] == ["R3", "R2", "R1"]
    assert run_policy("lamps").timeline[:4] == ("R3", "R3", "R2", "R3")


def test_own_curve_alone_ranks_like_sjf():
    """Without the batch's stall in the DISCARD/SWAP regions the area ranks R2 first (SJF's order)."""
    lp = LampsPriority(6, batch_context=False)
    assert [r.name for r in lp(list(TABLE1))] == ["R2", "R3", "R1"]
    s = simulate(TABLE1, 6, lp, on_unit=lp.counted)
    assert s.completion == run_policy("sjf").completion


def test_fcfs_holds_r3_back_while_r1_is_preserved():
    s = run_policy("fcfs")
    assert s.timeline[5] == "R2"     # R2's pre-API token fits beside R1's 5 and is discarded before 7
    assert s.timeline[6] is None     # R3 would still hold memory when R1 comes back
    assert s.timeline[7] == "R1"


def test_more_memory_removes_the_waits():
    s = simulate(TABLE1, 12, sjf)
    assert s.completion["R2"] < run_policy("sjf").completion["R2"]


def test_deadlock_and_validation():
    with pytest.raises(UnitDeadlock):
        simulate([UnitRequest("big", total=4, api_after=2, api_duration=1, handling=Handling.PRESERVE)], 3, fcfs)
    with pytest.raises(ValueError):
        UnitRequest("x", total=2, api_after=3, api_duration=1, handling=Handling.SWAP)
    with pytest.raises(ValueError):
        run_policy("srpt")
