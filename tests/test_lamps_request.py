"""``lamps-request``: LAMPS' memory-over-time rank over a request's remaining segments (``OpHint.later``), the hint's
backward-compatible wire form, and the simulator's zero-load bound."""

from __future__ import annotations

import pytest

from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.runtime.context import Context, Op, OpKind
from parrot.engine.scheduler.policies import engine_policy_names, make_engine_policy
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.protocol.interface import OpHint, ToolHint

BS = 4
SEARCH = ToolHint("search", 1.0)


def _op(sch: Scheduler, seq: int, n_tokens: int, hint: OpHint | None) -> Op:
    ctx = Context(f"c{seq}", None, tokens=list(range(seq * 1000, seq * 1000 + n_tokens)))
    op = Op(OpKind.FILL, ctx, arrival=float(seq), hint=hint)
    sch.add(op)
    return op


def _first_admitted(policy: str, ops_spec) -> int:
    sch = Scheduler(BlockPool(1024, BS), 1, 4096, policy=make_engine_policy(policy))
    ops = [_op(sch, i, n, h) for i, (n, h) in enumerate(ops_spec)]
    (chunk,) = sch.schedule().chunks
    return ops.index(chunk.op)


def test_the_policy_is_registered():
    assert "lamps-request" in engine_policy_names()


def test_the_hint_s_later_segments_cross_the_wire_and_old_hints_still_parse():
    h = OpHint(12, SEARCH, 3, predicted_return_tokens=40, later=(OpHint(8, SEARCH, predicted_return_tokens=5),
                                                                  OpHint(20)))
    assert OpHint.from_wire(h.to_wire()) == h
    old = {"predicted_output_tokens": 12, "tool": SEARCH.to_wire(), "priority": 0}
    assert OpHint.from_wire(old) == OpHint(12, SEARCH)
    assert OpHint(12, SEARCH).to_wire() == old  # a hint without the new fields sends what it sent before


def test_a_resumed_request_with_little_left_goes_before_a_new_request_with_many_calls():
    """The per-segment score (``lamps``) ranks the resumed segment (grown context) behind the newcomer's first
    segment; the request-level score counts the newcomer's five later calls and admits the resumed one first."""
    many = tuple(OpHint(64, SEARCH, predicted_return_tokens=64) for _ in range(5)) + (OpHint(64),)
    newcomer = (200, OpHint(16, SEARCH, predicted_return_tokens=64, later=many))
    resumed = (1200, OpHint(32))  # its last segment: nothing later
    assert _first_admitted("lamps", [newcomer, resumed]) == 0
    assert _first_admitted("lamps-request", [newcomer, resumed]) == 1


def test_without_later_segments_the_rank_is_lamps_own():
    for spec in ([(40, OpHint(500)), (40, OpHint(5))], [(400, OpHint(5)), (40, OpHint(50, SEARCH))]):
        assert _first_admitted("lamps-request", spec) == _first_admitted("lamps", spec)


def test_later_segments_only_add_to_the_score():
    sch = Scheduler(BlockPool(1024, BS), 4, 4096, policy=make_engine_policy("lamps-request"))
    alone = _op(sch, 0, 100, OpHint(16, SEARCH, predicted_return_tokens=8))
    more = _op(sch, 1, 100, OpHint(16, SEARCH, predicted_return_tokens=8, later=(OpHint(16),)))
    policy = sch.policy
    assert policy.score(more, sch.view) > policy.score(alone, sch.view) > 0


@pytest.mark.parametrize("mix", ["multi", "toolbench"])
def test_the_zero_load_bound_is_below_every_simulated_latency(mix):
    """Requests far apart (no queueing): each measured latency is at or just above its bound."""
    from parrot.sim.tool_experiments import gpu_40gb, run_policy, zero_load_latency_s
    from parrot.workloads.tools import make_workload

    cost = gpu_40gb()
    reqs = make_workload(mix, 8, 0.01, seed=1)
    run = run_policy(reqs, "lamps-request", cost)
    for q, r in zip(reqs, run.requests):
        bound = zero_load_latency_s(q, cost)
        assert bound <= r.latency_s < bound + 0.5, (q.rid, bound, r.latency_s)
