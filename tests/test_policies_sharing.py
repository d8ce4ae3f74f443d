"""The app-centric policy's cost-aware decisions for latency work that shares a long prompt prefix (GPTs, paper
Fig. 17), and pacing of throughput work (Fig. 19), on hand-built cluster states."""

from __future__ import annotations

from parrot.common.perf import PerfCriteria
from parrot.common.step_cost import StepCost
from parrot.manager.perf_deduction import RequestLabel, SchedInfo
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
)

GPU = StepCost(base_s=0.025, decode_row_s=0.000145, decode_ctx_s=1.37e-6, prefill_token_s=0.000145)
CAPS = CapacityConfig(latency_cap_tokens=10_000, throughput_cap_tokens=50_000)
LAT = Demand(10_000, WorkKind.LATENCY)
SYS = ("h-sys",)  # the boundary hash after a 3,000-token system prompt


def sharers(name: str, n: int) -> EngineView:
    reqs = tuple(PlacedRequest(f"{name}-{i}", f"s{i}", 3100 + 500, LAT, None, SYS, 3100, 0.0) for i in range(n))
    return EngineView(name, "m", 8192, None, 50_000, reqs, step_cost=GPU)


def test_a_user_of_a_busy_app_joins_its_engine_rather_than_prefilling_the_prompt_elsewhere():
    """Engine a holds the app's 3,000-token prompt and 14 of its users (beyond the 10k token cap counted once
    with a full own part each); engine b is busy with 2 unrelated users. Spilling to b would make b prefill and
    then read the whole prompt every step; joining a costs a's users one short row per step."""
    policy = AppCentricPolicy(CAPS)
    other = tuple(PlacedRequest(f"b-{i}", f"o{i}", 600, LAT, None, (f"h-other{i}",), 100, 0.0) for i in range(2))
    b = EngineView("b", "m", 8192, None, 50_000, other, step_cost=GPU)
    cluster = ClusterView({"a": sharers("a", 14), "b": b},
                          prefix_tokens=lambda e, hs: 3000 if e == "a" and "h-sys" in hs else 0, now=1.0)
    q = QueuedRequest(1, DispatchRequest("new", "s99", prompt_tokens=3100, max_new_tokens=500, prefix_hashes=SYS),
                      SchedInfo(RequestLabel(PerfCriteria.LATENCY), 0, 1.0), 1.0, ("a", "b"))
    assert [p.engine for p in policy.place([q], cluster)] == ["a"]


def test_throughput_work_is_paced_and_a_round_is_requested_when_the_backlog_drains():
    policy = AppCentricPolicy(CAPS, backlog_s=0.25)
    cluster = ClusterView({"e": EngineView("e", "m", 8192, None, 50_000, (), step_cost=GPU)}, now=10.0)
    label = RequestLabel(PerfCriteria.THROUGHPUT)
    maps = [QueuedRequest(i, DispatchRequest(f"m{i}", "s", prompt_tokens=1000, max_new_tokens=50),
                          SchedInfo(label, 0, 1.0), 1.0, ("e",)) for i in range(8)]
    placed = policy.place(maps, cluster)
    # 1,000 tokens prefill in 0.145 s: the second map starts the backlog past 0.25 s, the third waits
    assert [p.ticket for p in placed] == [0, 1]
    wake = policy.next_round_at()
    assert wake is not None and 10.0 < wake < 10.1
    assert AppCentricPolicy(CAPS, backlog_s=None).next_round_at() is None
