"""Global scheduling policies on hand-built cluster states (no engines): the FIFO baselines, Algorithm 1 and
FindEngine of the app-centric policy; the dispatcher's queue and capacity hints on fake engines; the engine
scheduler honouring the hint."""

from __future__ import annotations

import asyncio

import pytest

from parrot.common.sampling import SamplingParams
from parrot.engine.context import Context, Op, OpKind
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.manager import EngineRegistry
from parrot.manager.dispatcher import Dispatcher
from parrot.manager.perf import PerfCriteria
from parrot.manager.perf_deduction import PerfTargets, RequestLabel, SchedInfo
from parrot.manager.policies import (
    AppCentricPolicy,
    CapacityConfig,
    ClusterView,
    Demand,
    DispatchRequest,
    EngineView,
    PlacedRequest,
    QueuedRequest,
    WorkKind,
    make_policy,
)
from fakes import FakeEngine

CAPS = CapacityConfig(latency_cap_tokens=1000, throughput_cap_tokens=8000)
LAT = Demand(1000, WorkKind.LATENCY)
THR = Demand(8000, WorkKind.THROUGHPUT)


def engine(name: str, *placed: tuple[int, Demand], capacity: int = 10_000) -> EngineView:
    reqs = tuple(PlacedRequest(f"{name}-p{i}", "other", tokens, d) for i, (tokens, d) in enumerate(placed))
    return EngineView(name, "m", 4096, None, capacity, reqs)


_tickets = iter(range(1, 1_000_000))


def queued(tokens: int, *, label: RequestLabel | None = None, app: float = 0.0, depth: int = 0, at: float = 0.0,
           session: str = "s", engines=("e0", "e1"), hashes: tuple[str, ...] = ()) -> QueuedRequest:
    t = next(_tickets)
    req = DispatchRequest(f"r{t}", session, prompt_tokens=tokens, prefix_hashes=hashes)
    return QueuedRequest(t, req, SchedInfo(label, depth, app), at, tuple(engines))


def placed(policy, queue, *engines_, prefix=None, groups=None):
    cluster = ClusterView({e.name: e for e in engines_}, prefix_tokens=prefix, group_tokens=groups)
    by_ticket = {q.ticket: q for q in queue}
    return {by_ticket[p.ticket].request.request_id: p.engine for p in policy.place(queue, cluster)}


def names(queue):
    return [q.request.request_id for q in queue]


# ---- baselines -------------------------------------------------------------------------------------------------
def test_fifo_latency_least_queue_dispatch_and_head_of_line_blocking():
    policy = make_policy("fifo-latency", CAPS)
    q = [queued(400, at=i) for i in range(5)] + [queued(50, at=9)]
    got = placed(policy, q, engine("e0"), engine("e1"))
    r = names(q)
    # least queue alternates; a third 400-token request would exceed the 1000-token cap on both engines
    assert got == {r[0]: "e0", r[1]: "e1", r[2]: "e0", r[3]: "e1"}
    assert r[5] not in got  # the small one waits behind the head (FIFO), although it would fit


def test_fifo_throughput_same_code_large_cap():
    policy = make_policy("fifo-throughput", CAPS)
    q = [queued(400, at=i) for i in range(6)]
    got = placed(policy, q, engine("e0"), engine("e1"))
    assert sorted(got.values()) == ["e0"] * 3 + ["e1"] * 3
    assert policy.demand(q[0].request, q[0].info, 400) == Demand(8000, WorkKind.LATENCY)


def test_idle_engine_takes_a_request_beyond_every_cap():
    got = placed(make_policy("fifo-latency", CAPS), [q := queued(5000)], engine("e0", (10, LAT)), engine("e1"))
    assert got == {q.request.request_id: "e1"}


# ---- Algorithm 1 -----------------------------------------------------------------------------------------------
def test_task_group_is_placed_as_a_whole_beyond_the_latency_cap():
    group = RequestLabel(PerfCriteria.LATENCY, "g0")
    maps = [queued(400, label=group, at=i) for i in range(4)]
    policy = AppCentricPolicy(CAPS)
    got = placed(policy, maps, engine("e0"), engine("e1"), groups={("s", "g0"): 1600})
    assert set(got) == set(names(maps)) and len(set(got.values())) == 1  # all four together, 1600 > 1000
    assert policy.demand(maps[0].request, maps[0].info, 1600) == Demand(1600, WorkKind.LATENCY)
    # the same requests without a label are latency work of unknown objective: capped at 1000 per engine
    plain = [queued(400, at=i) for i in range(4)]
    got = placed(policy, plain, engine("e0"), engine("e1"))
    assert sorted(got.values()) == ["e0", "e0", "e1", "e1"]


def test_group_members_join_the_engine_already_running_part_of_the_group():
    group = RequestLabel(PerfCriteria.LATENCY, "g0")
    rest = [queued(300, label=group, at=i) for i in range(2)]
    early = PlacedRequest("early", "s", 300, Demand(900, WorkKind.LATENCY), "g0")  # placed before the label came
    e1 = EngineView("e1", "m", 4096, None, 10_000, (early,))
    # e0 is as similar (latency work) and emptier, but the group stays together on e1
    got = placed(AppCentricPolicy(CAPS), rest, engine("e0", (100, LAT)), e1, groups={("s", "g0"): 900})
    assert set(got.values()) == {"e1"}


def test_latency_work_goes_where_latency_work_runs_throughput_where_throughput_runs():
    policy = AppCentricPolicy(CAPS)
    chat = queued(100, engines=("e0", "e1", "e2"))
    bulk = queued(2000, label=RequestLabel(PerfCriteria.THROUGHPUT), engines=("e0", "e1", "e2"))
    e0, e1, e2 = engine("e0", (300, LAT)), engine("e1", (3000, THR)), engine("e2")
    got = placed(policy, [chat, bulk], e0, e1, e2)
    assert got == {chat.request.request_id: "e0", bulk.request.request_id: "e1"}  # idle e2 stays free
    # a latency request on an engine full of throughput work would cut its capacity from 8000 to 1000: it
    # does not fit there, so it takes the idle engine
    lone = queued(100, engines=("e1", "e2"))
    assert placed(policy, [lone], e1, e2) == {lone.request.request_id: "e2"}
    # ... but it may join throughput work that is small enough (the capacity reduction is acceptable)
    small = engine("e1", (500, THR))
    assert placed(policy, [lone := queued(100, engines=("e1",))], small) == {lone.request.request_id: "e1"}


def test_order_keeps_apps_together_and_a_blocked_request_does_not_block_others():
    policy = AppCentricPolicy(CAPS)
    later_app_first_step = queued(300, app=2.0, depth=0, at=1.0, engines=("e0",))
    early_app_second_step = queued(300, app=1.0, depth=1, at=2.0, engines=("e0",))
    early_app_big_step = queued(900, app=1.0, depth=2, at=0.5, engines=("e0",))
    q = [later_app_first_step, early_app_second_step, early_app_big_step]
    assert [x.ticket for x in sorted(q, key=policy.order_key)] == \
        [early_app_second_step.ticket, early_app_big_step.ticket, later_app_first_step.ticket]
    got = placed(policy, q, engine("e0", (100, LAT)))
    # 100 + 300 fits under 1000; the 900-token step does not fit now, the later app's step still does
    assert got == {early_app_second_step.request.request_id: "e0", later_app_first_step.request.request_id: "e0"}


def test_deadlines_and_ttft_go_first_and_tpot_tightens_the_cap():
    policy = AppCentricPolicy(CAPS)
    relaxed = queued(100, app=0.0, at=0.0)
    urgent = queued(100, app=5.0, at=3.0, label=RequestLabel(PerfCriteria.LATENCY, targets=PerfTargets(ttft_s=1.0)))
    bulk = queued(100, app=0.0, at=0.0, label=RequestLabel(PerfCriteria.THROUGHPUT))
    assert [x.ticket for x in sorted([bulk, relaxed, urgent], key=policy.order_key)] == \
        [urgent.ticket, relaxed.ticket, bulk.ticket]
    strict = RequestLabel(PerfCriteria.LATENCY, targets=PerfTargets(tpot_s=0.0175))  # base 15 ms + 5 us/token
    assert policy.demand(DispatchRequest("x"), SchedInfo(strict), 0).cap == 500
    assert policy.demand(DispatchRequest("x"), SchedInfo(RequestLabel(PerfCriteria.LATENCY)), 0).cap == 1000


def test_prefix_sharers_in_queue_are_co_located_and_held_prefixes_attract():
    policy = AppCentricPolicy(CAPS)
    a, b = queued(450, hashes=("h1", "h2"), at=0), queued(450, hashes=("h1", "h3"), at=2)
    other = queued(450, hashes=("x",), at=1)
    got = placed(policy, [a, other, b], engine("e0"), engine("e1"))
    # in plain order b would not fit next to a and other (1350 > 1000); as sharers a and b go first, together
    assert got[a.request.request_id] == got[b.request.request_id] != got[other.request.request_id]
    # CtxInEngine: e1 holds 64 tokens of the request's prefix; e0 runs the same kind of work and is emptier
    c = queued(100, hashes=("h9",))
    prefix = lambda e, r: 64 if e == "e1" and "h9" in r.prefix_hashes else 0  # noqa: E731
    e0, e1 = engine("e0", (50, LAT)), engine("e1", (200, LAT))
    assert placed(policy, [c], e0, e1) == {c.request.request_id: "e0"}
    assert placed(policy, [c], e0, e1, prefix=prefix) == {c.request.request_id: "e1"}


def test_unknown_policy_name_is_rejected():
    with pytest.raises(ValueError, match="fifo-latency"):
        make_policy("fastest")
    with pytest.raises(ValueError):
        CapacityConfig(latency_cap_tokens=10, throughput_cap_tokens=5)


# ---- the dispatcher on fake engines ------------------------------------------------------------------------------
class CapRecordingEngine(FakeEngine):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.caps: list[int | None] = []

    async def set_token_cap(self, max_running_tokens: int | None) -> bool:
        self.caps.append(max_running_tokens)
        return True


def test_dispatcher_queues_until_release_and_pushes_caps():
    async def main():
        e0 = CapRecordingEngine("e0")
        registry = EngineRegistry([e0, FakeEngine("e1")])
        await registry.refresh()
        d = Dispatcher(registry, make_policy("fifo-latency", CAPS))
        a = await d.acquire(DispatchRequest("a", prompt_tokens=600))
        b = await d.acquire(DispatchRequest("b", prompt_tokens=600))
        assert {a.engine, b.engine} == {"e0", "e1"}
        waiting = asyncio.ensure_future(d.acquire(DispatchRequest("c", prompt_tokens=600)))
        await asyncio.sleep(0.05)
        assert not waiting.done() and d.stats()["queued"] == 1
        a.release()
        c = await asyncio.wait_for(waiting, 1)
        assert c.engine == a.engine
        await asyncio.sleep(0.05)
        assert e0.caps and e0.caps[-1] == 1000  # the latency cap of what runs there
        for lease in (b, c):
            lease.release()
        await asyncio.sleep(0.05)
        assert e0.caps[-1] is None  # nothing of ours runs there any more: cap lifted
        await d.close()

    asyncio.run(main())


def test_cancelled_waiter_leaves_the_queue_and_takes_no_capacity():
    async def main():
        registry = EngineRegistry([FakeEngine("e0")])
        await registry.refresh()
        d = Dispatcher(registry, make_policy("fifo-latency", CAPS))
        a = await d.acquire(DispatchRequest("a", prompt_tokens=900))
        waiting = asyncio.ensure_future(d.acquire(DispatchRequest("b", prompt_tokens=900)))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert d.stats()["queued"] == 0
        a.release()
        assert d.stats()["engines"]["e0"]["tokens"] == 0
        await d.close()

    asyncio.run(main())


# ---- the engine side of the hint ---------------------------------------------------------------------------------
def test_engine_scheduler_admits_under_the_token_cap():
    pool = BlockPool(200, 16)
    s = Scheduler(pool, max_num_seqs=8, max_batch_tokens=4096)
    s.token_cap = 250
    ops = [Op(OpKind.GENERATE, Context(f"c{i}", None, tokens=list(range(100))), sampling=SamplingParams(),
              arrival=i) for i in range(4)]
    for op in ops:
        s.add(op)
    plan = s.schedule()
    assert [c.op for c in plan.chunks] == ops[:2]  # 100 + 100 <= 250; a third would make 300
    s.token_cap = None
    for c in plan.chunks:
        c.op.ctx.num_computed += c.num_tokens
    plan = s.schedule()
    assert {c.op.ctx.id for c in plan.chunks} >= {"c2", "c3"}  # cap lifted: the rest is admitted

