"""Tool-calling workloads (LAMPS Table 2 mixes) and the simulated-engine driver of parrot.sim.tool_experiments."""

import statistics

import pytest

from parrot.sim.tool_experiments import LAMPS_NO_RANKING, gpu_40gb, run_policy
from parrot.workloads.tools import TABLE2_KINDS, make_workload, with_prediction_error


def test_workload_is_seeded_and_follows_table2():
    a = make_workload("multi", 300, 2.0, seed=3)
    assert a == make_workload("multi", 300, 2.0, seed=3)
    assert a != make_workload("multi", 300, 2.0, seed=4)
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals)
    assert 300 / arrivals[-1] == pytest.approx(2.0, rel=0.15)  # Poisson at the rate
    for r in a:
        assert r.segments[-1].tool is None and all(s.tool is not None for s in r.segments[:-1])
        assert r.total_tokens <= 3584 + TABLE2_KINDS[r.kind].output_tokens[0] * 2
        assert 1 <= r.num_calls <= 12
    durations = {k: [s.tool.duration_s for r in a if r.kind == k for s in r.segments if s.tool] for k in TABLE2_KINDS
                 if k != "toolbench"}
    assert statistics.fmean(durations["math"]) < 1e-3 < statistics.fmean(durations["ve"]) < 0.2
    assert 0.5 < statistics.fmean(durations["qa"]) < 0.9
    assert statistics.fmean(durations["chatbot"]) > 15 and statistics.fmean(durations["image"]) > 10
    single = make_workload("single", 50, 1.0)
    assert all(r.num_calls == 1 for r in single)
    with pytest.raises(ValueError):
        make_workload("nope", 1, 1.0)


def test_prediction_error_perturbs_hints_only():
    base = make_workload("multi", 100, 2.0)
    assert all(s.predicted_output_tokens == s.output_tokens for r in base for s in r.segments)
    noisy = with_prediction_error(base, 0.3, seed=1)
    assert [s.output_tokens for r in noisy for s in r.segments] == [s.output_tokens for r in base for s in r.segments]
    rel = [abs(s.predicted_output_tokens - s.output_tokens) / s.output_tokens for r in noisy for s in r.segments]
    assert 0.15 < statistics.fmean(rel) < 0.35  # E|N(0, 0.3)| = 0.24
    assert with_prediction_error(base, 0.0) == base


def test_driver_pauses_and_resumes_through_the_engine():
    cost = gpu_40gb()
    reqs = make_workload("multi", 12, 2.0, seed=1)
    calls = sum(r.num_calls for r in reqs)
    for policy, handlings in (("preserve", {"preserve"}), ("discard", {"discard"}),
                              ("lamps", {"preserve", "swap", "discard"})):
        r = run_policy(reqs, policy, cost)
        by = {k: v for k, v in r.pauses["by_handling"].items() if v}
        assert sum(by.values()) == calls and set(by) <= handlings, (policy, by)
        assert r.pauses["resumed"] == calls
        tool_s = [sum(s.tool.duration_s for s in q.segments if s.tool) for q in reqs]
        assert all(x.latency_s > t for x, t in zip(r.requests, tool_s))
        assert all(0 < x.ttft_s < x.latency_s for x in r.requests)
        if policy == "preserve":  # an unloaded engine resumes from the kept KV: every full block matched
            assert r.resume_hit > 0.9
    assert run_policy(reqs, LAMPS_NO_RANKING, cost).pauses["resumed"] == calls
