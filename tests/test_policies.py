"""Global scheduling policies on hand-built cluster states (no engines): the FIFO baselines, Algorithm 1 and
FindEngine of the app-centric policy; the dispatcher's queue and capacity hints on fake engines; the engine
scheduler honouring the hint."""

from __future__ import annotations

import asyncio

import pytest

from parrot.common.perf import PerfCriteria, PinnedTargets
from parrot.common.sampling import SamplingParams
from parrot.engine.runtime.context import Context, Op, OpKind
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.manager import EngineRegistry
from parrot.manager.dispatcher import Dispatcher
from parrot.manager.perf_deduction import RequestLabel, SchedInfo
from parrot.manager.policies import (
    AppCentricPolicy,
    CapacityConfig,
    ClusterView,
    Demand,
    DispatchRequest,
    EngineView,
    Occupancy,
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
    firm = Demand(1000, WorkKind.LATENCY, firm=True)  # a TPOT target runs there: its cap is never exceeded
    got = placed(policy, q, engine("e0", (100, firm)))
    # 100 + 300 fits under 1000; the 900-token step does not fit now, the later app's step still does
    assert got == {early_app_second_step.request.request_id: "e0", later_app_first_step.request.request_id: "e0"}


def test_deadlines_and_ttft_go_first_and_tpot_tightens_the_cap():
    policy = AppCentricPolicy(CAPS)
    relaxed = queued(100, app=0.0, at=0.0)
    urgent = queued(100, app=5.0, at=3.0, label=RequestLabel(PerfCriteria.LATENCY, targets=PinnedTargets(ttft_s=1.0)))
    bulk = queued(100, app=0.0, at=0.0, label=RequestLabel(PerfCriteria.THROUGHPUT))
    assert [x.ticket for x in sorted([bulk, relaxed, urgent], key=policy.order_key)] == \
        [urgent.ticket, relaxed.ticket, bulk.ticket]
    strict = RequestLabel(PerfCriteria.LATENCY, targets=PinnedTargets(tpot_s=0.0175))  # base 15 ms + 5 us/token
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
    prefix = lambda e, hashes: 64 if e == "e1" and "h9" in hashes else 0  # noqa: E731
    e0, e1 = engine("e0", (50, LAT)), engine("e1", (200, LAT))
    assert placed(policy, [c], e0, e1) == {c.request.request_id: "e0"}
    assert placed(policy, [c], e0, e1, prefix=prefix) == {c.request.request_id: "e1"}


# ---- the sharing pass: latency work shares a latency engine rather than wait behind it (Fig. 12b/13) --------------
def test_concurrent_chain_steps_of_different_apps_share_an_engine_beyond_its_latency_cap():
    policy = AppCentricPolicy(CAPS)
    step = RequestLabel(PerfCriteria.LATENCY)
    running = engine("e0", (800, LAT))  # app A's chain step
    b = queued(700, label=step, app=2.0, session="B", engines=("e0",))
    c = queued(700, app=3.0, session="C", engines=("e0",))  # unknown objective: latency work too
    got = placed(policy, [c, b], running)
    # neither fits under the 1000-token latency cap (800 + 700); waiting would serialize the apps, so both
    # join the engine that runs only latency work: B, C and A advance together
    assert got == {b.request.request_id: "e0", c.request.request_id: "e0"}
    # ... but never beyond the engine's KV capacity
    small_kv = engine("e0", (800, LAT), capacity=2000)
    assert placed(policy, [b, c], small_kv) == {b.request.request_id: "e0"}  # 1500 <= 2000 < 2200


def test_the_sharing_pass_keeps_kinds_apart_and_respects_tpot_targets():
    policy = AppCentricPolicy(CAPS)
    latency_full, bulk_engine = engine("e0", (800, LAT)), engine("e1", (7000, THR))
    q = queued(700, engines=("e0", "e1"))
    assert placed(policy, [q], latency_full, bulk_engine) == {q.request.request_id: "e0"}
    # never onto an engine running throughput work, however much room its own cap leaves
    assert placed(policy, [queued(700, engines=("e1",))], bulk_engine) == {}
    # throughput work never uses it (it waits for room under the latency engine's cap)
    bulk = queued(700, label=RequestLabel(PerfCriteria.THROUGHPUT), engines=("e0",))
    assert placed(policy, [bulk], latency_full) == {}
    # a TPOT target is a per-token promise: neither the request that has one nor one running next to it yields
    strict = queued(700, label=RequestLabel(PerfCriteria.LATENCY, targets=PinnedTargets(tpot_s=0.02)), engines=("e0",))
    assert policy.demand(strict.request, strict.info, 700) == Demand(1000, WorkKind.LATENCY, firm=True)
    assert placed(policy, [strict], latency_full) == {}
    firm_engine = engine("e0", (800, Demand(1000, WorkKind.LATENCY, firm=True)))
    assert placed(policy, [queued(700, engines=("e0",))], firm_engine) == {}


def test_latency_work_overflows_a_latency_engine_before_cutting_a_throughput_engines_capacity():
    policy = AppCentricPolicy(CAPS)
    chat = queued(300, engines=("e0", "e1"))
    chats_full, light_bulk = engine("e0", (900, LAT)), engine("e1", (200, THR))
    # e1 has room under the chat's 1000-token cap, but a chat there would cut e1 from 8000 to 1000 tokens
    assert placed(policy, [chat], chats_full, light_bulk) == {chat.request.request_id: "e0"}
    # only when no latency engine can take it does it join the throughput work
    firm_full = engine("e0", (900, Demand(1000, WorkKind.LATENCY, firm=True)))
    assert placed(policy, [chat], firm_full, light_bulk) == {chat.request.request_id: "e1"}


def test_the_sharing_pass_prefers_where_the_request_adds_least():
    policy = AppCentricPolicy(CAPS)
    e0 = engine("e0", (900, LAT))
    e1 = EngineView("e1", "m", 4096, None, 10_000, (PlacedRequest("u", "s9", 950, LAT, None, ("sys",), 900),))
    q = queued(900, hashes=("sys", "mine"))
    held = lambda e, hashes: 800 if e == "e1" and "sys" in hashes else 0  # noqa: E731
    # e1 holds more tokens, but q shares 800 of them: it ends at 950 + 100 there, at 1800 on e0
    assert placed(policy, [q], e0, e1, prefix=held) == {q.request.request_id: "e1"}
    assert placed(policy, [q], e0, e1) == {q.request.request_id: "e0"}


# ---- a shared prompt prefix counts once toward an engine's tokens (GPTs serving, Fig. 17) ------------------------
SYS = 3000  # tokens of a GPTs app's system prompt, held on the engine (its prefix context / running forks)
# the users want <= 55 ms per output token: with CapacityConfig's TPOT profile (15 ms + 5 us per running token)
# a firm cap of 8000 running tokens, which the sharing pass never exceeds
TPOT = PinnedTargets(tpot_s=0.055)


def gpts_placed(name: str, n: int, *, hashes=("sys",), cap: int = 8000) -> tuple[PlacedRequest, ...]:
    """``n`` requests of one app on engine ``name``: 3000-token system prompt + 100-token query, 400 new."""
    return tuple(PlacedRequest(f"{name}-u{i}", f"user{i}", 3500, Demand(cap, WorkKind.LATENCY, firm=True), None,
                               (*hashes, f"{name}-q{i}"), 3100) for i in range(n))


def held_on(*engines_: str, tokens: int = SYS):
    return lambda e, hashes: tokens if e in engines_ and "sys" in hashes else 0


def gpts_queued(i: int, *, engines=("e0", "e1")) -> QueuedRequest:
    t = next(_tickets)
    req = DispatchRequest(f"r{t}", f"new{i}", prompt_tokens=3100, max_new_tokens=400, prefix_hashes=("sys", f"q{t}"))
    return QueuedRequest(t, req, SchedInfo(RequestLabel(PerfCriteria.LATENCY, targets=TPOT), 0, float(i)), float(i),
                         tuple(engines))


def test_shared_prefix_counts_once_toward_the_engines_tokens():
    caps = CapacityConfig(latency_cap_tokens=8000, throughput_cap_tokens=64000)
    e0 = EngineView("e0", "m", 4096, None, 50_000, gpts_placed("e0", 2))
    cluster = ClusterView({"e0": e0}, prefix_tokens=held_on("e0"))
    assert e0.tokens == 7000  # in full
    assert cluster.engine_tokens("e0") == 3500 + 500  # the 3000-token system prompt once
    # a newcomer of the same app adds only its own 500 tokens: 4000 + 500 <= 8000 (in full: 10500 > 8000)
    q = gpts_queued(0, engines=("e0",))
    assert placed(AppCentricPolicy(caps), [q], e0, prefix=held_on("e0")) == {q.request.request_id: "e0"}
    # without knowing the prefix's size there (nothing holds it yet) every request counts in full
    assert placed(AppCentricPolicy(caps), [q], e0) == {}
    # an engine whose attention re-reads the prefix per request (plain paged attention) counts it per request
    paged = EngineView("e0", "m", 4096, None, 50_000, gpts_placed("e0", 2), shared_prefix_attention=False)
    assert ClusterView({"e0": paged}, prefix_tokens=held_on("e0")).engine_tokens("e0") == 7000
    assert placed(AppCentricPolicy(caps), [q], paged, prefix=held_on("e0")) == {}


def test_sharers_fill_engines_to_their_cap_and_a_cached_prefix_alone_is_not_credited():
    caps = CapacityConfig(latency_cap_tokens=8000, throughput_cap_tokens=64000)
    queue = [gpts_queued(i) for i in range(12)]
    e0 = EngineView("e0", "m", 4096, None, 50_000, gpts_placed("e0", 1))
    e1 = EngineView("e1", "m", 4096, None, 50_000)
    cluster = ClusterView({"e0": e0, "e1": e1}, prefix_tokens=held_on("e0", "e1"))
    occ = Occupancy(cluster)
    # e1 holds the prompt only as a cache (nobody placed there uses it): its first user counts it in full
    assert occ.extra_tokens("e1", [queue[0].request]) == 3500
    assert occ.extra_tokens("e1", [q.request for q in queue[:3]]) == 3500 + 2 * 500
    assert occ.extra_tokens("e0", [queue[0].request]) == 500
    got = placed(AppCentricPolicy(caps), queue, e0, e1, prefix=held_on("e0", "e1"))
    # all twelve run at once: e0 and e1 together hold 3500 + 3500 + 11 x 500 = 12,500 <= 2 x 8000;
    # counted in full (3500 each) only two more fit on e0 and e1 together
    assert len(got) == 12
    on = {e: [q.request for q in queue if got[q.request.request_id] == e] for e in ("e0", "e1")}
    assert occ.tokens["e0"] + occ.extra_tokens("e0", on["e0"]) <= 8000 and occ.extra_tokens("e1", on["e1"]) <= 8000
    assert len(placed(AppCentricPolicy(caps), queue, e0, e1)) == 3
    # a set of sharers is no single request: an idle engine does not take it beyond its cap
    assert not Occupancy(cluster).fits("e1", 9000, 8000, members=12)
    assert Occupancy(cluster).fits("e1", 9000, 8000)


def test_fifo_baseline_counts_a_shared_prefix_once_too():
    policy = make_policy("fifo-latency", CapacityConfig(latency_cap_tokens=8000, throughput_cap_tokens=64000))
    e0 = EngineView("e0", "m", 4096, None, 50_000, gpts_placed("e0", 2))
    q = [gpts_queued(i, engines=("e0",)) for i in range(10)]
    got = placed(policy, q, e0, prefix=held_on("e0"))
    assert len(got) == 8  # 4000 + 8 * 500 = 8000 (same mechanics; only OpenAI requests carry no prefix hashes)


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


def test_dispatcher_pushes_a_cap_that_admits_what_the_policy_placed():
    async def main():
        e0 = CapRecordingEngine("e0")
        registry = EngineRegistry([e0])
        await registry.refresh()
        d = Dispatcher(registry, make_policy("parrot", CAPS))
        a = await d.acquire(DispatchRequest("a", prompt_tokens=800))
        await asyncio.sleep(0.05)
        assert e0.caps[-1] == 1000
        b = await asyncio.wait_for(d.acquire(DispatchRequest("b", prompt_tokens=700)), 1)  # the sharing pass
        await asyncio.sleep(0.05)
        assert b.engine == "e0" and e0.caps[-1] == 1500  # else the engine would keep b waiting locally
        for lease in (a, b):
            lease.release()
        await d.close()

    asyncio.run(main())


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
        s.kv.mark_computed(c.op.ctx, c.num_tokens)
    plan = s.schedule()
    assert {c.op.ctx.id for c in plan.chunks} >= {"c2", "c3"}  # cap lifted: the rest is admitted

