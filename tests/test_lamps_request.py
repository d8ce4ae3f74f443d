"""``lamps-request``: LAMPS' memory-over-time rank over a request's remaining segments (``OpHint.later``), the hint's
backward-compatible wire form, and the simulator's zero-load bound."""

from __future__ import annotations

import dataclasses

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


# ---- aging: virtual finish time = request start + remaining score / aging_tokens ------------------------------------
def _aged(arrivals_and_specs, **kw) -> tuple[Scheduler, list[Op]]:
    from parrot.engine.scheduler.policies.lamps_request import LampsRequestPolicy

    sch = Scheduler(BlockPool(1024, BS), 1, 4096, policy=LampsRequestPolicy("lamps-request", **kw))
    ops = []
    for seq, (arrival, n, hint) in enumerate(arrivals_and_specs):
        ctx = Context(f"c{seq}", None, tokens=list(range(seq * 1000, seq * 1000 + n)))
        op = Op(OpKind.FILL, ctx, arrival=arrival, hint=hint)
        sch.add(op)
        ops.append(op)
    return sch, ops


_MANY = tuple(OpHint(64, SEARCH, predicted_return_tokens=64) for _ in range(5)) + (OpHint(64),)
_LONG = OpHint(16, SEARCH, predicted_return_tokens=64, later=_MANY)  # a request with six calls left
_SHORT = OpHint(16)


def test_a_long_request_is_passed_only_by_newcomers_within_its_score_over_k():
    """The key is start + score / K: a short newcomer goes first only while it arrives less than
    (S_long - S_short) / K seconds after the long request; later ones queue behind it. Under remaining-score
    order alone (``lamps``' rule over the request, K -> infinity of score) every short newcomer goes first."""
    sch, (long_op, probe) = _aged([(0.0, 600, _LONG), (0.0, 200, _SHORT)])
    s_long, s_short = (sch.policy.score(o, sch.view) for o in (long_op, probe))
    window = (s_long - s_short) / sch.policy.aging_tokens
    assert window > 0
    for arrival, long_first in ((0.9 * window, False), (1.1 * window, True)):
        sch, (long_op, newcomer) = _aged([(0.0, 600, _LONG), (arrival, 200, _SHORT)])
        assert sch.policy.order(sch.view)[0] is (long_op if long_first else newcomer), arrival
        # pure remaining-score order: the newcomer, however late
        assert sch.policy.score(newcomer, sch.view) < sch.policy.score(long_op, sch.view)


def test_a_stream_of_short_newcomers_passes_an_old_long_request_finitely_often():
    """A short newcomer every 10 s, one op admitted per iteration: the long request (window ~360 s) goes first after
    about window / 10 newcomers, well before the starvation guard (100 iterations) would put it first; by remaining
    score alone every newcomer passes it until then."""
    sch, (long_op,) = _aged([(0.0, 600, _LONG)])
    window = (sch.policy.score(long_op, sch.view) - 0.0) / sch.policy.aging_tokens
    policy = sch.policy
    for t in range(1, 100):
        ctx = Context(f"n{t}", None, tokens=list(range(100_000 + t * 1000, 100_000 + t * 1000 + 200)))
        op = Op(OpKind.FILL, ctx, arrival=10.0 * t, hint=_SHORT)
        sch.add(op)
        assert policy.score(op, sch.view) < policy.score(long_op, sch.view)
        first = policy.order(sch.view)[0]
        if first is long_op:
            break
        sch.remove(first)  # admitted and done
        policy.after_admission([first], [o for o in sch.view.waiting])
    else:
        raise AssertionError("the long request was passed by 99 newcomers")
    assert not policy.ranker.is_starving(long_op.seq_no)
    assert window - 10 <= 10.0 * t <= window + 10


def test_the_request_start_ages_a_resumed_segment_by_its_request_s_age():
    """Two ops arriving together: without a stated age (each segment counts from its own arrival) the smaller score
    goes first; when the long one's hint says its request has run for a long time (``OpHint.elapsed_s``: it
    started at arrival - elapsed_s), it goes first."""
    specs = [(10.0, 600, _LONG), (10.0, 200, _SHORT)]
    sch, (long_op, short_op) = _aged(specs)
    assert sch.policy.order(sch.view)[0] is short_op
    old = dataclasses.replace(_LONG, elapsed_s=1e6)
    sch, (long_op, short_op) = _aged([(10.0, 600, old), (10.0, 200, _SHORT)])
    assert sch.policy.order(sch.view)[0] is long_op
    assert OpHint.from_wire(old.to_wire()) == old  # on the wire only when set
    assert "elapsed_s" not in _LONG.to_wire()
    with pytest.raises(ValueError):
        OpHint(elapsed_s=-1.0)


def test_aging_tokens_must_be_positive():
    from parrot.engine.scheduler.policies.lamps_request import LampsRequestPolicy

    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            LampsRequestPolicy("lamps-request", aging_tokens=bad)
