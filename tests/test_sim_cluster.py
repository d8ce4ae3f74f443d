"""The simulated cluster: the real manager over simulated engines on the virtual clock."""

from __future__ import annotations

import asyncio
import time

import pytest

from parrot.manager.graph import VarStatus
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from parrot.sim.cluster import ClusterConfig, SimCluster
from parrot.sim.experiments import validate
from parrot.sim.vloop import run_virtual
from parrot.workloads import synth as W


def _run(config, body):
    async def main():
        async with SimCluster(config) as cluster:
            return await body(cluster)

    return run_virtual(main())


def test_two_dependent_calls_flow_through_the_manager_with_dag_timestamps():
    """Conformance: ``code = write(task); test = check(task, code)`` on the simulated engine."""

    async def body(c: SimCluster):
        m = c.manager
        s = m.create_session()
        task = m.create_variable(s, "task", "a snake game")
        out = {"max_tokens": 12, "ignore_eos": True, "stop": []}
        r1 = m.submit(s, SubmitSpec("You are an engineer. Write code for {{input:task}}. Code: {{output:code}}",
                                    [PlaceholderSpec("task", False, task.var_id),
                                     PlaceholderSpec("code", True, None, out)]))
        code = r1.outputs[0]
        r2 = m.submit(s, SubmitSpec("Test {{input:task}} given {{input:code}}. Tests: {{output:test}}",
                                    [PlaceholderSpec("task", False, task.var_id), PlaceholderSpec("code", False, code),
                                     PlaceholderSpec("test", True, None, out)]))
        view = await m.get_variable(s, r2.outputs[0], criteria="latency", timeout_s=600)
        code_view = await m.get_variable(s, code, timeout_s=0)
        dag = m.dag(s)
        now = c.clock()
        await m.delete_session(s)
        return view, code_view, dag, now

    view, code_view, dag, now = _run(ClusterConfig(cost_model="llama7b-a100", latency_ms=(0, 0)), body)
    assert view.status is VarStatus.READY and code_view.status is VarStatus.READY
    assert code_view.value.split() == ["tok"] * 12 and view.value.split() == ["tok"] * 12
    t1, t2 = (r["timestamps"] for r in dag.requests)
    # virtual time: starts at 0, the DAG order holds, and the second call waited for the first
    assert 0 <= t1["submitted"] <= t1["dispatched"] <= t1["first_token"] <= t1["finished"] <= now < 10
    assert t2["dispatched"] >= t1["finished"]
    assert t2["first_token"] <= t2["finished"]
    assert t2["finished"] - t1["dispatched"] >= 24 * 0.008  # 24 decode steps of a LLaMA-7B on an A100


def _small_mix(policy: str, seed: int):
    apps = [W.app("map_reduce", 4, 256, 16, seed), W.app("chain", 3, 256, 16, seed + 1)]
    cfg = ClusterConfig(engines=2, cost_model="llama7b-a6000", policy=policy, seed=seed, latency_cap_tokens=2048)

    async def body(c: SimCluster):
        mode = "parrot" if policy == "parrot" else "baseline"
        times = await asyncio.gather(*(c.run_app(a, mode) for a in apps),
                                     *(c.complete(f"[chat {i}] hello there", 20) for i in range(3)))
        return [t if isinstance(t, float) else t.latency_s for t in times], c.engine_stats()

    return _run(cfg, body)


@pytest.fixture
def no_real_sleep(monkeypatch):
    """A simulation must not wait in real time: ``time.sleep`` raises."""
    def refuse(seconds):
        raise AssertionError(f"real time.sleep({seconds}) in a simulation")

    monkeypatch.setattr(time, "sleep", refuse)


@pytest.mark.parametrize("policy", ["parrot", "fifo-latency"])
def test_small_cluster_run_is_deterministic_for_a_seed(policy, no_real_sleep):
    """Two runs with one seed agree exactly; the emulated round trips pass on the virtual clock only."""
    a, b = _small_mix(policy, 3), _small_mix(policy, 3)
    assert a == b
    times, stats = a
    assert all(x > 0.199 for x in times)  # every app / chat call includes one emulated RTT (200-300 ms)
    assert sum(s["steps"] for s in stats.values()) > 0


def test_parrot_beats_the_per_call_baseline_on_a_chain():
    """Paper §8.2: one RTT per app instead of one per call makes a chain faster (and it is all virtual time)."""
    app = W.app("chain", 4, 256, 16, 0)
    cfg = ClusterConfig(cost_model="llama13b-a100", seed=0)
    base = _run(ClusterConfig(**{**cfg.__dict__, "policy": "fifo-latency"}), lambda c: c.run_app(app, "baseline"))
    parrot = _run(cfg, lambda c: c.run_app(app, "parrot"))
    assert base - parrot > 3 * 0.2  # at least three of the four round trips saved


def test_validate_reads_app_bench_json(tmp_path):
    p = tmp_path / "app_bench-1.json"
    p.write_text('{"conditions": {"latency_ms": [200, 300], "chunk_words": 40, "background": 0}, "args": {}, '
                 '"rows": [{"app": "chain", "chunks": 2, "output_len": 8, "baseline_s": 2.0, "parrot_s": 1.5}]}')
    text = validate([str(p)], cost_model="llama7b-a100")
    assert "chain x2 len8" in text and "baseline" in text and "parrot" in text and "within 15%" in text
