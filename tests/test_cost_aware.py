"""Cost-model-aware scheduling: the engines' step-time statistics (fit, pooling, wire, reported by the engine
core), the dispatcher attaching the fit to the cluster view, and the app-centric policy's decisions on
hand-built cluster states where the cost model says split vs keep whole, mix kinds or not, and which cap a TPOT
target means."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from parrot.common.perf import PerfCriteria, PinnedTargets
from parrot.common.sampling import SamplingParams
from parrot.common.step_cost import StepCost, StepStats
from parrot.protocol.interface import EngineStatus
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
from parrot.manager.policies.cost_aware import CostLedger, cap_for_tpot
from parrot.sim.cost_model import load_model
from parrot.sim.sim_engine import SimEngine
from parrot.sim.vloop import run_virtual
from fakes import FakeEngine

# a 1-thread CPU engine (parrot/sim/cost_models/this-machine-1t.json, rounded) and a GPU (A6000, LLaMA-7B roofline)
CPU = StepCost(base_s=0.030, decode_row_s=0.0022, decode_ctx_s=5e-6, prefill_token_s=0.00114)
GPU = StepCost(base_s=0.025, decode_row_s=0.000145, decode_ctx_s=1.37e-6, prefill_token_s=0.000145)
CAPS = CapacityConfig(latency_cap_tokens=512, throughput_cap_tokens=16384)
THR = Demand(16384, WorkKind.THROUGHPUT)


def lat(cap: int = 512) -> Demand:
    return Demand(cap, WorkKind.LATENCY)


def view(name: str, cost: StepCost | None, *placed: tuple[int, int, Demand], capacity: int = 40_000) -> EngineView:
    """An engine running ``placed`` = (prompt tokens, max new tokens, demand) requests."""
    reqs = tuple(PlacedRequest(f"{name}-p{i}", f"other{i}", prompt + new, d, None, (), prompt)
                 for i, (prompt, new, d) in enumerate(placed))
    return EngineView(name, "m", 8192, None, capacity, reqs, step_cost=cost)


_tickets = iter(range(1, 1_000_000))


def request(prompt: int, new: int, *, label: RequestLabel | None = None, engines=("e0", "e1")) -> QueuedRequest:
    t = next(_tickets)
    return QueuedRequest(t, DispatchRequest(f"r{t}", "app", prompt_tokens=prompt, max_new_tokens=new),
                         SchedInfo(label, 0, 0.0), 0.0, tuple(engines))


def group(n: int, prompt: int, new: int, name: str = "maps") -> list[QueuedRequest]:
    label = RequestLabel(PerfCriteria.THROUGHPUT, name)
    return [request(prompt, new, label=label) for _ in range(n)]


def place(queue, *engines, caps=CAPS) -> dict[str, str]:
    """request id -> engine, for the app-centric policy (group tokens computed from the queue)."""
    groups: dict = {}
    for q in queue:
        if q.group_key is not None:
            groups[q.group_key] = groups.get(q.group_key, 0) + q.tokens
    cluster = ClusterView({e.name: e for e in engines}, group_tokens=groups)
    by_ticket = {q.ticket: q for q in queue}
    return {by_ticket[p.ticket].request.request_id: p.engine for p in AppCentricPolicy(caps).place(queue, cluster)}


# ---- step statistics ---------------------------------------------------------------------------------------------
def test_step_stats_fit_recovers_the_cost_and_assumes_free_batching_when_unidentified():
    rng = random.Random(0)
    stats = StepStats()
    for _ in range(200):
        rows, prefill = rng.randint(0, 12), rng.choice([0, 0, 32, 190, 512])
        ctx = rows * rng.randint(50, 600)
        if rows or prefill:
            stats.add(rows, ctx, prefill, CPU.step_s(rows, ctx, prefill))
    fit = stats.fit()
    assert fit is not None
    for name in ("base_s", "decode_row_s", "decode_ctx_s", "prefill_token_s"):
        assert getattr(fit, name) == pytest.approx(getattr(CPU, name), rel=0.02)
    # an engine that only ever decoded one sequence at a time: the per-row slope cannot be told from the base
    # cost, and is attributed to the base (batching free until shown otherwise)
    lone = StepStats()
    for _ in range(20):
        lone.add(1, 100, 0, 0.0325)
    fit = lone.fit()
    assert fit is not None and fit.decode_row_s < 1e-4 and fit.step_s(1, 100) == pytest.approx(0.0325, rel=0.01)
    # too few iterations: no fit
    few = StepStats()
    few.add(1, 100, 0, 0.03)
    assert few.fit() is None


def test_step_stats_pool_across_engines_and_survive_the_wire():
    single, batched = StepStats(), StepStats()
    for _ in range(20):
        single.add(1, 200, 0, CPU.step_s(1, 200))
        batched.add(12, 2400, 0, CPU.step_s(12, 2400))
        batched.add(0, 0, 256, CPU.step_s(0, 0, 256))
    pooled = StepStats.pooled([StepStats.from_wire(single.to_wire()), StepStats.from_wire(batched.to_wire())])
    fit = pooled.fit()
    assert fit is not None and fit.step_s(6, 1200) == pytest.approx(CPU.step_s(6, 1200), rel=0.02)
    with pytest.raises(ValueError):
        StepStats.from_wire({"n": 1, "xx": [[0.0]], "xy": [0.0]})
    with pytest.raises(ValueError):
        StepStats.from_wire({"xy": []})


def test_engine_core_reports_step_statistics_of_its_own_iterations():
    cost = load_model("this-machine-1t")

    async def main():
        e = SimEngine("e", cost, profiled=False)
        assert e.status().extra["step_stats"]["n"] == 0
        for i in range(4):
            await e.fill([100 + i] * (50 + 60 * i), f"c{i}")
        await asyncio.gather(*(e.generate(SamplingParams(max_tokens=12, ignore_eos=True), f"c{i}")
                               for i in range(4)))
        await e.fill([7] * 30, "solo")
        await e.generate(SamplingParams(max_tokens=12, ignore_eos=True), "solo")
        stats = StepStats.from_wire(e.status().extra["step_stats"])
        e.shutdown()
        return stats

    stats = run_virtual(main())
    assert stats.n >= 20
    fit = stats.fit()
    assert fit is not None
    # the fit predicts the simulated engine's iterations (the cost model minus its small attention term)
    assert fit.step_s(4, 4 * 200) == pytest.approx(cost.decode_s(4, 4 * 200), rel=0.05)
    assert fit.step_s(0, 0, 110) == pytest.approx(cost.prefill_s(110), rel=0.1)


def test_dispatcher_puts_the_pooled_fit_of_reported_statistics_on_the_cluster_view():
    stats = StepStats()
    for rows in (1, 4, 12):
        for _ in range(4):
            stats.add(rows, rows * 300, 0, CPU.step_s(rows, rows * 300))
            stats.add(0, 0, 100 * rows, CPU.step_s(0, 0, 100 * rows))

    class Reporting(FakeEngine):
        async def status(self) -> EngineStatus:
            st = await super().status()
            return dataclasses.replace(st, extra={"step_stats": stats.to_wire()})

    async def main(engines):
        registry = EngineRegistry(engines)
        await registry.refresh()
        cluster = Dispatcher(registry, make_policy("parrot", CAPS))._cluster()
        return {n: v.step_cost for n, v in cluster.engines.items()}

    got = asyncio.run(main([Reporting("e0"), FakeEngine("e1")]))
    assert got["e0"] is not None and got["e0"] == got["e1"]  # same model: the fit is shared
    assert got["e0"].step_s(8, 2400) == pytest.approx(CPU.step_s(8, 2400), rel=0.02)
    assert asyncio.run(main([FakeEngine("e0")])) == {"e0": None}  # nothing reported: decide on tokens


# ---- rule a: split a throughput task group or keep it whole ------------------------------------------------------
def test_a_throughput_group_is_split_when_batching_costs_and_kept_whole_when_it_is_nearly_free():
    def run(cost):
        maps = group(6, 150, 32)
        got = place(maps, view("e0", cost, (150, 32, THR)), view("e1", cost, (150, 32, THR)))
        assert set(got) == {m.request.request_id for m in maps}
        return sorted(got.values())

    assert run(None) == ["e0"] * 6  # Algorithm 1: the group as a whole
    assert run(GPU) == ["e0"] * 6  # one more sequence costs ~1% of a step: whole is as fast
    cpu = run(CPU)  # ~7% of a step per sequence and 4% per prompt token: both engines finish it sooner
    assert cpu.count("e0") == 3 and cpu.count("e1") == 3


def test_a_split_never_takes_an_idle_engine_that_algorithm_1_keeps_free():
    maps = group(6, 150, 32)
    got = place(maps, view("e0", CPU, (150, 32, THR)), view("e1", CPU))
    assert set(got.values()) == {"e0"}


def test_a_lone_throughput_request_goes_where_it_finishes_first():
    # e1 is FindEngine's choice (same kind, emptier in tokens) but its batch of long prompts will run for a while;
    # e0's two requests are short: on this cost e0 finishes the newcomer sooner
    bulk = request(200, 32, label=RequestLabel(PerfCriteria.THROUGHPUT))
    e0 = view("e0", CPU, *[(100, 300, THR)] * 2)
    e1 = view("e1", CPU, (700, 8, THR))
    assert place([bulk], e0, e1) == {bulk.request.request_id: "e0"}
    assert place([bulk], dataclasses.replace(e0, step_cost=None), e1) == {bulk.request.request_id: "e1"}


# ---- rule c: throughput work in a latency engine's spare time -------------------------------------------------
def test_c_throughput_joins_a_latency_engine_only_within_its_time_budget():
    def run(cap):
        bulk = request(200, 32, label=RequestLabel(PerfCriteria.THROUGHPUT))
        chat = view("e0", CPU, (100, 30, lat(cap)))
        busy = view("e1", CPU, *[(200, 32, THR)] * 8)
        return place([bulk], chat, busy, caps=CapacityConfig(cap, 16384))[bulk.request.request_id]

    # 512 latency tokens = 4 chats: a step of ~41 ms; one prompt of 200 tokens stalls the chat's 30 steps by
    # ~7.6 ms each, plus its own row: over budget, although e0 would finish it much sooner
    assert run(512) == "e1"
    # 2048 latency tokens: a ~73 ms budget; the chat engine lends its spare time
    assert run(2048) == "e0"


def test_c_throughput_stays_off_a_latency_engine_when_it_gains_less_than_it_costs_the_latency_work():
    bulk = request(200, 32, label=RequestLabel(PerfCriteria.THROUGHPUT))
    chats = view("e0", CPU, *[(100, 30, lat(2048))] * 3)
    light = view("e1", CPU, (200, 32, THR))
    # within e0's budget and only a little slower on e1, but on e0 it would add ~0.3 s to each of three chats
    ledger = CostLedger(ClusterView({"e0": chats, "e1": light}), Occupancy(ClusterView({"e0": chats, "e1": light})))
    assert ledger.admits("e0", [bulk.request], [THR], 232)
    assert ledger.latency_harm_s("e0", bulk.request, 232) > 0.8
    assert place([bulk], chats, light, caps=CapacityConfig(2048, 16384)) == {bulk.request.request_id: "e1"}


# ---- rule b: a TPOT target in seconds becomes a cap through the measured cost ------------------------------------
def test_b_a_tpot_target_becomes_the_cap_at_which_the_engine_meets_it():
    caps = CapacityConfig(latency_cap_tokens=8192, throughput_cap_tokens=16384)
    policy = AppCentricPolicy(caps)
    label = RequestLabel(PerfCriteria.LATENCY, targets=PinnedTargets(tpot_s=0.050))
    req = DispatchRequest("x", prompt_tokens=400, max_new_tokens=100)
    static = policy.demand(req, SchedInfo(label), 500).cap
    assert static == caps.cap_for_tpot(0.050) == 7000  # the configured profile: 15 ms + 5 us per token
    measured = policy.demand(req, SchedInfo(label), 500, CPU).cap
    assert measured == cap_for_tpot(CPU, 0.050, 500, min_cap=caps.min_cap_tokens, max_cap=8192)
    # a step of requests like this one at the measured cap takes the target
    assert CPU.step_s(measured // 500, measured) == pytest.approx(0.050, rel=0.05)
    assert measured < static / 2


# ---- progress: what was placed long ago is mostly done ---------------------------------------------------------
def test_the_ledger_estimates_placed_work_from_its_placement_time():
    def batch(placed_at: float, now: float = 100.0) -> tuple[float, float, float]:
        reqs = tuple(PlacedRequest(f"p{i}", "s", 232, THR, None, (), 200, placed_at) for i in range(4))
        cluster = ClusterView({"e0": EngineView("e0", "m", 8192, None, 40_000, reqs, step_cost=CPU)}, now=now)
        ledger = CostLedger(cluster, Occupancy(cluster))
        return (*ledger.batch("e0", 32), ledger.prefill["e0"])

    rows, tokens, backlog = batch(placed_at=100.0)  # just placed: all four prompts pending, all four rows
    assert (rows, tokens, backlog) == (4.0, 4 * 232.0, 800)
    # 1 s ago: the 800 prompt tokens took 0.91 s (FCFS, 0.23 s each), then 2-18 of 32 steps of ~43 ms each
    rows, tokens, backlog = batch(placed_at=100.0 - 1.0)
    assert backlog == 0 and rows == pytest.approx(2.76, abs=0.01) and tokens == pytest.approx(232 * rows)
    assert batch(placed_at=0.0) == (0.0, 0.0, 0)  # 100 s ago: done
