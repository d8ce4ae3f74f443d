"""Flows benchmarks (issue 34): the workload builders (parrot.workloads.flows), the simulator's experiments in quick
mode (parrot.sim.flow_experiments) and the real benchmark at its smallest (parrot.bench.flow_bench)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from parrot.manager.flows.spec import parse_flow
from parrot.workloads import flows as F


# ---- builders ----------------------------------------------------------------------------------------------------
def test_agent_flow_is_a_valid_deterministic_loop():
    body = F.react_agent_flow("v_1", "v_2", max_steps=6, think_tokens=24)
    parse_flow(json.loads(json.dumps(body)), max_loop_steps=64)  # the server's own check; JSON-clean
    loop = body["steps"][1]["loop"]
    assert loop["max_steps"] == 6 and loop["on_max"] == "last"
    # the loop can only end at max_steps: until looks for the string every thought stops on
    assert loop["until"]["value"] == F.NEVER
    think = loop["steps"][0]["generate"]["sampling"]["thought"]
    assert F.NEVER in think["stop"] and think["ignore_eos"] and think["max_tokens"] == 24
    branch = loop["steps"][1]["branch"]
    assert branch["cases"][0]["when"]["value"] == "calculate"
    assert branch["cases"][0]["steps"][0]["tool"]["name"] == "calculator"
    assert branch["default"][0]["tool"]["name"] == "search_text"
    assert body["outputs"] == ["thought", "history2"]


def test_agent_flow_with_inline_inputs():
    body = F.agent_flow(F.AgentConfig(max_steps=3), question="what is 2 {{ 3?", doc="One two three four.")
    parse_flow(body, max_loop_steps=64)
    assert body["inputs"] == {}
    assert body["steps"][0]["text"]["template"] == F.AGENT_HEAD + "what is 2 { { 3?"
    with pytest.raises(ValueError):
        F.agent_flow(F.AgentConfig(), "v_1", "v_2", question="q")


def test_non_deterministic_agent_stops_on_final_answer():
    body = F.react_agent_flow("v_1", "v_2", max_steps=8, deterministic=False)
    parse_flow(body, max_loop_steps=64)
    assert body["steps"][1]["loop"]["until"]["value"] == F.FINAL


@pytest.mark.parametrize("source", ["seeded", "model"])
def test_router_flow_is_valid(source):
    body = F.router_flow("v_1", "v_2" if source == "seeded" else None, label_source=source, speculate=False)
    parse_flow(body, max_loop_steps=64)
    branch = body["steps"][-1]["branch"]
    assert [c["steps"][0]["generate"]["name"] for c in branch["cases"]] == [f"handle_{x}" for x in F.LABELS]
    assert body["speculate"] is False
    if source == "model":
        assert json.loads(body["steps"][0]["generate"]["sampling"]["route"]["constraint"]["spec"]) == list(F.LABELS)


def test_seeded_decisions_follow_the_distribution():
    labels = F.draw_labels(2000, seed=3)
    assert labels == F.draw_labels(2000, seed=3)
    share = {x: labels.count(x) / len(labels) for x in F.LABELS}
    assert abs(share["billing"] - 0.8) < 0.03 and abs(share["technical"] - 0.15) < 0.03
    reqs = F.router_requests(50, seed=1)
    assert len({q for q, _ in reqs}) == 50 and [x for _, x in reqs] == F.draw_labels(50, seed=1)


def test_client_loop_runs_the_same_program():
    cfg = F.AgentConfig(max_steps=4, think_tokens=8)
    prompts = []

    class Fake:
        async def generate(self, prompt, sampling):
            prompts.append(prompt)
            assert sampling == cfg.think_sampling()
            return " I will calculate 6 * 7" if len(prompts) == 1 else " lighthouse keepers"

    doc = "The lighthouse keepers lived on the rock for years. Ships passed at night."
    res = asyncio.run(F.run_client_agent(Fake(), "[0] q?", doc, cfg))
    assert res.iterations == 4 and len(prompts) == 4
    assert prompts[0] == F.prompt0("[0] q?") + "\nThought:"
    assert "Observation: 42" in prompts[1]  # the calculator branch, the server's tool
    assert "Observation: The lighthouse keepers lived on the rock for years." in prompts[2]
    assert res.history.startswith(prompts[3][:-len("\nThought:")])


def test_write_section_replaces_only_its_block(tmp_path):
    p = tmp_path / "flows.md"
    F.write_section(p, "real", "A1")
    F.write_section(p, "sim", "S1")
    F.write_section(p, "real", "A2")
    text = p.read_text()
    assert "A2" in text and "A1" not in text and "S1" in text and text.startswith("# Flows")


# ---- the simulator ---------------------------------------------------------------------------------------------
def test_sim_agent_flow_beats_the_client_loop_over_the_network():
    from parrot.sim.flow_experiments import agent

    _, data = agent(quick=True)
    m = data["modes"]
    assert all(r["iterations"] == 6 for r in m.values())
    assert m["flow+rtt"]["calls_per_agent"] < m["client+rtt"]["calls_per_agent"]
    assert m["flow+rtt"]["mean_s"] < m["client+rtt"]["mean_s"]
    assert m["flow+rtt"]["mean_s"] < m["openai+rtt"]["mean_s"]
    assert agent(quick=True)[1] == data  # deterministic for a seed


def test_sim_router_speculation_hits_and_misses():
    from parrot.sim.flow_experiments import router

    _, data = router(quick=True)
    on, off = data["arms"]["speculation on"], data["arms"]["speculation off"]
    assert on["hit"] > 0 and on["miss"] > 0 and on["hit"] > on["miss"]
    assert off["hit"] == off["miss"] == 0
    assert on["mean_s"] <= off["mean_s"]
    assert on["majority_mean_s"] < off["majority_mean_s"]  # a hit starts the handler with the router


# ---- the real server, smallest setting ---------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_real_bench_smallest(tmp_path):
    from parrot.bench import flow_bench as B

    # every decision the majority label: after min_runs (5) warm-up runs every request is speculated, and hits
    bc = replace(B.QUICK, agents=1, iterations=3, modes=("flow", "client"), router_requests=4, router_warmup=5,
                 router_rate=20.0, probs=(1.0, 0.0, 0.0))
    data = B.run_all(bc)
    ag = data["agent"]["summary"]
    assert ag["flow"]["iterations"] == ag["client"]["iterations"] == 3
    assert ag["flow"]["calls_per_agent"] == 3 and ag["client"]["calls_per_agent"] == 7
    on, off = data["router"]["speculation on"], data["router"]["speculation off"]
    assert on["hit"] == 4 and on["miss"] == 0 and off["hit"] + off["miss"] == 0
    data["conditions"] = B.conditions(data, bc, "test")
    text, md = B.tables(data)
    assert "flow" in text and "| speculation on |" in md
