"""The Preble simulator benchmark's parts: Table 1 sizes by model window, the oracle-partition baseline run end to
end on a simulated cluster (every request known to the oracle, groups dealt), and the Azure-trace mix at a rate."""

from __future__ import annotations

import statistics

import pytest

from parrot.sim.preble_experiments import main, requests_of, run_one
from parrot.sim.cluster import ClusterConfig
from parrot.sim.tokenizer import WordTokenizer
from parrot.workloads.preble import workload


def _mean_tokens(reqs) -> float:
    tok = WordTokenizer()
    return statistics.mean(len(tok.encode(r.prompt)) for r in reqs)


def test_long_context_workloads_keep_table_1_sizes_when_the_window_allows():
    short = workload("videoqa", 200, 4.0, window=4096)
    long = workload("videoqa", 200, 4.0, window=32768)  # ~23 videos
    assert max(len(WordTokenizer().encode(r.prompt)) for r in short) <= 4096
    assert _mean_tokens(long) > 2 * _mean_tokens(short)  # Table 1: 9,865 tokens on average
    docs = workload("loogle", 24, 4.0, window=32768)
    assert 12_000 < _mean_tokens(docs) < 32768
    assert workload("toolbench", 10, 4.0, window=32768) == workload("toolbench", 10, 4.0)  # others unchanged


def test_oracle_partition_runs_end_to_end_and_knows_every_request():
    cfg = ClusterConfig(engines=2, cost_model="llama7b-a6000", policy="least-loaded", latency_ms=(0.0, 0.0))
    r = run_one("toolbench", 30, 4.0, cfg, policy="oracle")
    assert r["oracle_unknown"] == 0 and r["oracle_groups"] >= 2
    assert r["mean"] > 0 and r["p99"] >= r["mean"]


def test_azure_mix_follows_the_trace_at_the_asked_rate():
    reqs = requests_of("azure", 200, rate=20.0)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert (len(reqs) - 1) / span == pytest.approx(20.0, rel=1e-6)
    assert {r.group.split(":")[0] for r in reqs} == {"code", "conv"}


def test_sim_command_prints_every_baseline_column(capsys):
    main(["sim", "--engines", "2", "--workloads", "azure", "--rates", "8", "--requests", "40"])
    out = capsys.readouterr().out
    assert "or/e2 mean" in out and "rr/e2 p99" in out and "azure" in out
