"""The simulated client's HTTP calls cost the cost model's api_call_s / api_completion_s (measured by parrot
profile): exactly that much virtual time per call, and a sequential client whose later submits arrive later."""

from __future__ import annotations

import dataclasses

import pytest

from parrot.sim.cluster import ClusterConfig, SimCluster
from parrot.sim.cost_model import load_model
from parrot.sim.vloop import run_virtual
from parrot.workloads.apps import APPS

CONFIG = ClusterConfig(engines=1, cost_model="llama7b-a100", latency_ms=(0.0, 0.0))


def _run(api_call_s: float, api_completion_s: float, body):
    cost = dataclasses.replace(load_model(CONFIG.cost_model), api_call_s=api_call_s, api_completion_s=api_completion_s)

    async def main():
        async with SimCluster(CONFIG, cost) as cluster:
            return await body(cluster)

    return run_virtual(main())


def test_each_parrot_api_call_and_each_completion_costs_its_profiled_time():
    async def call(c: SimCluster):
        return (await c.run_parrot_call("Say {{input:a}} {{input:b}}: {{output:answer}}", {"a": "x", "b": "y"}, 8,
                                        rtt=False, output="answer")).latency_s

    async def complete(c: SimCluster):
        return (await c.complete("Say x y:", 8, rtt=False)).latency_s

    base = _run(0.0, 0.0, call)
    # two variables created with values and the get's answer add up; the submit's answer overlaps the engine's
    # work on the request (it runs once submitted), which takes longer than 0.05 s here
    assert base > 0.05
    assert _run(0.05, 0.0, call) == pytest.approx(base + 3 * 0.05)
    assert _run(0.0, 0.07, complete) == pytest.approx(_run(0.0, 0.0, complete) + 0.07)
    assert _run(0.05, 0.0, complete) == pytest.approx(_run(0.0, 0.0, complete))  # completions: their own cost


def test_inline_inputs_client_submits_step_by_step():
    """app_bench's client: each map is submitted with its chunk as a value, so with slow calls the maps start one
    call apart instead of together; the declared client sets every input at the end."""
    app = APPS["map_reduce"](["alpha beta gamma"] * 4, 4)
    calls = 4 * 2 + 1 + 1  # per map a variable and a submit, the reduce's submit, the get's answer

    def run(inline: bool, api: float) -> float:
        async def body(c: SimCluster):
            return await c.run_parrot_app(app, rtt=False, inline_inputs=inline)

        return _run(api, 0.0, body)

    engine_only = run(True, 0.0)
    assert run(False, 0.0) == pytest.approx(engine_only)  # no call cost: the two clients are the same program
    slow = run(True, 1.0)
    assert calls * 1.0 <= slow < calls * 1.0 + engine_only  # the maps ran while the client was still submitting
    # the declared client: 4 pending variables, 5 submits, 4 sets, the get's answer; the engine's work (all of it
    # after the last set reaches the service) hides behind that set's answer
    assert engine_only < 1.0
    assert run(False, 1.0) == pytest.approx((4 + 5 + 4 + 1) * 1.0)
