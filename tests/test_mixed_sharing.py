"""The ``parrot-share`` policy (parrot/manager/policies/mixed_sharing.py): throughput work shares an engine running
latency work only when the step cost predicts the latency work's step stays within its target, else Algorithm 1's
split; each decision is counted for /api/v1/stats. Hand-built cluster states on the A6000 LLaMA-7B roofline."""

from __future__ import annotations

from parrot.common.perf import PerfCriteria
from parrot.common.step_cost import StepCost
from parrot.manager.perf_deduction import RequestLabel, SchedInfo
from parrot.manager.policies import (
    AppCentricWithE2,
    CapacityConfig,
    ClusterView,
    Demand,
    DispatchRequest,
    EngineView,
    Occupancy,
    PlacedRequest,
    QueuedRequest,
    SharingPolicy,
    WorkKind,
    make_policy,
)
from parrot.manager.policies.cost_aware import CostLedger

GPU = StepCost(base_s=0.025, decode_row_s=0.000145, decode_ctx_s=1.37e-6, prefill_token_s=0.000145)
CAPS = CapacityConfig(latency_cap_tokens=4096, throughput_cap_tokens=50_000)


def cluster() -> ClusterView:
    """e0 runs one chat (300-token prompt, 200 new tokens, latency cap 4096); e1 is idle."""
    chat = PlacedRequest("chat", None, 500, Demand(4096, WorkKind.LATENCY), None, (), 300, placed_at=0.0)
    return ClusterView({"e0": EngineView("e0", "m", 8192, None, 50_000, (chat,), step_cost=GPU),
                        "e1": EngineView("e1", "m", 8192, None, 50_000, (), step_cost=GPU)}, now=0.0)


def map_request(prompt: int, new: int, ticket: int = 1) -> QueuedRequest:
    label = RequestLabel(PerfCriteria.THROUGHPUT, None)
    return QueuedRequest(ticket, DispatchRequest(f"r{ticket}", "app", prompt_tokens=prompt, max_new_tokens=new),
                         SchedInfo(label, 0, 0.0), 0.0, ("e0", "e1"))


def test_registered_beside_parrot_and_counts_its_decisions():
    policy = make_policy("parrot-share", CAPS)
    assert isinstance(policy, SharingPolicy) and isinstance(policy, AppCentricWithE2)
    assert policy.name == "parrot-share"
    assert {"share": 0, "split": 0}.items() <= policy.decision_counts().items()


def test_a_map_prompt_keeps_the_split_a_short_prompt_shares():
    policy = SharingPolicy(CAPS)
    placed = policy.place([map_request(1024, 50)], cluster())
    assert [p.engine for p in placed] == ["e1"]
    assert policy.decision_counts()["split"] == 1 and policy.decision_counts()["share"] == 0

    policy = SharingPolicy(CAPS)
    policy.place([map_request(8, 50)], cluster())
    assert policy.decision_counts()["share"] == 1 and policy.decision_counts()["split"] == 0


def test_the_prediction_is_the_latency_step_with_the_request_in_its_batch():
    policy = SharingPolicy(CAPS)
    c = cluster()
    occ = Occupancy(c)
    ledger = CostLedger(c, occ)
    step, target = policy.shared_step_s("e0", map_request(1024, 50), occ, ledger)
    # the chat's row over its 500 tokens plus the map's row, its 1074 tokens and its 1024-token prompt in one step;
    # the chat's own prompt (placed just now, 300 tokens) still to prefill, spread over its 200 steps
    assert abs(step - (GPU.step_s(2, 500 + 1074, 1024) + GPU.prefill_token_s * 300 / 200)) < 1e-9
    # the target: e0 filled with 500-token chats up to the 4096-token cap
    assert abs(target - GPU.step_s(9, 4096)) < 1e-9
    assert step > target
    assert policy.shared_step_s("e1", map_request(8, 50), occ, ledger) == (0.0, None)  # no latency work there


def test_the_default_parrot_policy_is_unchanged():
    assert type(make_policy("parrot", CAPS)) is AppCentricWithE2
    policy = AppCentricWithE2(CAPS)
    assert [p.engine for p in policy.place([map_request(8, 50)], cluster())] == ["e1"]


def test_fig19_prints_each_ratio_beside_its_bounds():
    from parrot.sim import bounds as B
    from parrot.sim import experiments as X
    from parrot.sim.cost_model import load_model

    text = X.mixed(quick=True)
    for row in ("chat vs fifo-latency [floor]", "chat vs fifo-throughput [chats alone]",
                "map-reduce vs fifo-throughput [apps alone]", "of bound"):
        assert row in text
    # the chats alone are a best case above the floor (the chats' own load), and below Parrot's chats with the apps
    alone = B.chats_alone("parrot", 10, quick=True)
    assert load_model("llama7b-a6000").decode_s(1, 0) < alone <= X.mixed_results(quick=True)["parrot"][0]
