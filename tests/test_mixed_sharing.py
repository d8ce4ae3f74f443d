"""The ``parrot`` policy (parrot/manager/policies/mixed_sharing.py): throughput work shares an engine running
latency work when the prompt tokens per iteration the latency work's step target leaves (the engine enforces it)
are worth it and finish the request no later than the best engine without latency work, else Algorithm 1's split;
latency work carries its engine's step target; each decision is counted for /api/v1/stats. Hand-built cluster
states on the A6000 LLaMA-7B roofline."""

from __future__ import annotations

import dataclasses

from parrot.common.perf import PerfCriteria, PinnedTargets
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


def cluster(cost: StepCost = GPU) -> ClusterView:
    """e0 runs one chat (300-token prompt, 200 new tokens, latency cap 4096); e1 is idle."""
    chat = PlacedRequest("chat", None, 500, Demand(4096, WorkKind.LATENCY), None, (), 300, placed_at=0.0)
    return ClusterView({"e0": EngineView("e0", "m", 8192, None, 50_000, (chat,), step_cost=cost),
                        "e1": EngineView("e1", "m", 8192, None, 50_000, (), step_cost=cost)}, now=0.0)


def map_request(prompt: int, new: int, ticket: int = 1) -> QueuedRequest:
    label = RequestLabel(PerfCriteria.THROUGHPUT, None)
    return QueuedRequest(ticket, DispatchRequest(f"r{ticket}", "app", prompt_tokens=prompt, max_new_tokens=new),
                         SchedInfo(label, 0, 0.0), 0.0, ("e0", "e1"))


def test_parrot_is_the_sharing_policy_the_split_its_ablation():
    policy = make_policy("parrot", CAPS)
    assert isinstance(policy, SharingPolicy) and policy.name == "parrot" and policy.share_slack == 0.10
    assert {"share": 0, "split": 0}.items() <= policy.decision_counts().items()
    split = make_policy("parrot-split", CAPS)
    assert isinstance(split, AppCentricWithE2) and not isinstance(split, SharingPolicy)
    assert split.name == "parrot-split"
    assert make_policy("parrot", CapacityConfig(share_slack=1.5)).share_slack == 1.5


def test_a_linear_step_cost_keeps_the_split_free_prompt_tokens_share():
    # GPU roofline as a sum: 10 % of the chat's ~26 ms step is ~16 prompt tokens per iteration: below the
    # 32-token floor, so the map goes to the idle engine
    policy = SharingPolicy(CAPS)
    placed = policy.place([map_request(1024, 50)], cluster())
    assert [p.engine for p in placed] == ["e1"]
    assert policy.decision_counts()["split"] == 1 and policy.decision_counts()["share"] == 0
    # an engine whose decode step leaves compute idle (prompt tokens nearly free next to the weights' stream):
    # the allowance is hundreds of tokens, and the map finishes sooner sharing e0 than queued behind e1's backlog
    cheap = StepCost(base_s=0.025, decode_row_s=1e-6, decode_ctx_s=1e-8, prefill_token_s=1e-5)
    c = cluster(cheap)
    busy = PlacedRequest("other-map", "app", 41_000, Demand(50_000, WorkKind.THROUGHPUT), None, (), 40_000,
                         placed_at=0.0)
    c.engines["e1"] = dataclasses.replace(c.engines["e1"], placed=(busy,))
    policy = SharingPolicy(CAPS)
    occ = Occupancy(c)
    ledger = CostLedger(c, occ)
    assert policy.allowance("e0", map_request(1024, 50), occ, ledger) > 200
    placed = policy.place([map_request(1024, 50)], c)
    assert [p.engine for p in placed] == ["e0"] and policy.decision_counts()["share"] == 1


def test_latency_work_carries_its_engines_step_target_an_explicit_one_wins():
    policy = SharingPolicy(CAPS)
    chat = QueuedRequest(7, DispatchRequest("chat2", None, prompt_tokens=200, max_new_tokens=100),
                         SchedInfo(RequestLabel(PerfCriteria.LATENCY, None), 0, 0.0), 0.0, ("e0",))
    [p] = policy.place([chat], cluster())
    # the latency work on e0 after it (the placed chat's 500 tokens and its 300) alone, plus the 10 % slack
    assert p.engine == "e0" and abs(p.tpot_s - GPU.step_s(2, 800) * 1.1) < 1e-12
    explicit = dataclasses.replace(chat, info=SchedInfo(RequestLabel(PerfCriteria.LATENCY, None,
                                                                     targets=PinnedTargets(tpot_s=0.05)), 0, 0.0))
    [p] = SharingPolicy(CAPS).place([explicit], cluster())
    assert p.tpot_s is None  # the dispatcher passes the request's own target on (Lease.tpot_s)
    [p] = SharingPolicy(CAPS).place([map_request(8, 50)], cluster())
    assert p.tpot_s is None  # throughput work carries none: it is what the engine limits


def test_an_openai_completion_carries_the_target_of_the_latency_work_it_joins():
    # unstructured requests (no session, token ids known) are placed by E2; they are latency work all the same
    chat = QueuedRequest(9, DispatchRequest("cmpl", None, prompt_tokens=100, max_new_tokens=50,
                                            prompt_token_ids=tuple(range(100))), SchedInfo(None, 0, 0.0), 0.0, ("e0",))
    [p] = SharingPolicy(CAPS).place([chat], cluster())
    assert p.engine == "e0" and abs(p.tpot_s - GPU.step_s(2, 500 + 150) * 1.1) < 1e-12
    [p] = make_policy("parrot-split", CAPS).place([chat], cluster())
    assert p.tpot_s is None


def test_the_split_keeps_throughput_off_latency_engines_and_sends_no_target():
    policy = make_policy("parrot-split", CAPS)
    placed = policy.place([map_request(8, 50)], cluster())
    assert [(p.engine, p.tpot_s) for p in placed] == [("e1", None)]


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
