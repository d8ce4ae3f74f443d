"""The tool benchmark's harness: workloads (arrivals, mixes, fresh prompts), statistics, ratios, the report, and a
quick run on real `parrot serve` processes (tiny random model) once the servers know ``--engine-policy``."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from parrot.bench import tool_bench as tb
from parrot.bench.tool_clients import step_template
from parrot.bench.tool_stats import RunStats, ratios
from parrot.common.report import p99
from parrot.workloads.arrivals import poisson_arrivals
from parrot.workloads.tools import CPU_MIXES, CPU_TOOLS, WorkloadConfig, make_requests
from parrot.common.template import parse_template, placeholders


def test_poisson_arrivals_rate_and_order():
    xs = poisson_arrivals(4000, 2.0, random.Random(1))
    assert xs[0] == 0.0 and all(b >= a for a, b in zip(xs, xs[1:]))
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.06)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, random.Random(1))


def test_make_requests_deterministic_fresh_and_in_mix():
    a = make_requests("multi", 60, 1.5, seed=3)
    assert a == make_requests("multi", 60, 1.5, seed=3)
    assert a != make_requests("multi", 60, 1.5, seed=4)
    # every prompt is fresh: no two requests share their first 20 words after the tag
    heads = {" ".join(r.system.split()[2:30]) for r in a}
    assert len(heads) == len(a)
    kinds = {k.name: k for k in CPU_MIXES["multi"]}
    cfg = WorkloadConfig()
    for r in a:
        k = kinds[r.kind]
        assert k.calls[0] <= len(r.segments) <= k.calls[1]
        assert all(s.tool == k.tool for s in r.segments)
        assert all(cfg.out_tokens[0] <= s.out_tokens <= cfg.out_tokens[1] for s in r.segments)
        assert "{{" not in r.system and "{{" not in r.question
    assert len({r.kind for r in a}) >= 4
    # durations follow the tool's distribution, scaled
    search = [s.duration_s for r in make_requests("single", 400, 1.0, 0) for s in r.segments if s.tool == "search"]
    assert statistics.mean(search) == pytest.approx(CPU_TOOLS["search"].mean_s, rel=0.1)
    scaled = make_requests("single", 50, 1.0, 0, WorkloadConfig(duration_scale=0.1))
    assert max(s.duration_s for r in scaled for s in r.segments) < 1.0
    with pytest.raises(ValueError):
        make_requests("nope", 1, 1.0, 0)


def test_stats_p99_and_ratios():
    assert p99([1.0]) == 1.0
    assert p99(list(range(1, 101))) == 99
    assert p99(list(range(1, 11))) == 10
    s = RunStats([1.0, 2.0, 3.0], [0.1, 0.3], failed=1, errors=["x"])
    sm = s.summary()
    assert sm["requests"] == 4 and sm["completed"] == 3 and sm["mean_s"] == 2.0 and sm["p99_s"] == 3.0
    assert sm["ttft_mean_s"] == pytest.approx(0.2) and sm["ttft_p99_s"] == 0.3
    assert RunStats().summary()["mean_s"] is None
    res = {"lamps": {"mean_s": 1.0, "p99_s": 2.0, "ttft_mean_s": 0.1, "ttft_p99_s": None},
           "infercept": {"mean_s": 2.0, "p99_s": 4.0, "ttft_mean_s": 0.4, "ttft_p99_s": 1.0}}
    r = ratios(res, "infercept")
    assert r["lamps"] == {"mean_s": 0.5, "p99_s": 0.5, "ttft_mean_s": 0.25, "ttft_p99_s": None}
    assert r["infercept"]["mean_s"] == 1.0
    assert ratios(res, "discard")["lamps"]["mean_s"] is None


def test_step_templates_continue_each_other():
    r = make_requests("multi", 5, 1.0, 0)[0]
    prev = None
    for k in range(len(r.segments) + 1):
        text = step_template(r, k, final=k == len(r.segments))
        segs = parse_template(text)
        names = [p.name for p in placeholders(segs)]
        assert names[0] == "question" and names.count("question") == 1
        if prev is not None:  # round k's prompt starts with round k-1's prompt, then its output as an input
            assert text.startswith(prev.replace(f"{{{{output:t{k - 1}}}}}", f"{{{{input:t{k - 1}}}}}"))
        prev = text


def test_config_validation_and_report():
    with pytest.raises(ValueError):
        tb.BenchConfig(variants=("lamps", "fifo"))
    with pytest.raises(ValueError):
        tb.BenchConfig(clients=("grpc",))
    one = {"requests": 2, "completed": 2, "failed": 0, "mean_s": 1.0, "p50_s": 1.0, "p99_s": 1.5,
           "ttft_mean_s": 0.2, "ttft_p99_s": 0.3, "errors": [], "wall_s": 3.0, "latencies_s": [0.5, 1.5],
           "engine": {"tool_pauses": {"preserve": 1, "discard": 2}, "preemptions": 0, "tokens_computed": 900}}
    res = {"lamps": one, "infercept": {**one, "mean_s": 2.0}, "discard": {**one, "mean_s": 4.0}}
    data = {"conditions": {"cpu (lscpu)": "AMD EPYC"}, "config": {"variants": ["lamps", "infercept", "discard"]},
            "runs": [
        {"client": "sv", "rate": 1.0, "seed": 0, "order": list(res), "tool_time_s_mean": 2.0, "calls_mean": 2.5,
         "kinds": {"qa": 2}, "variants": res, "vs_infercept": ratios(res, "infercept"),
         "vs_discard": ratios(res, "discard")}]}
    text = tb.report(data)
    assert "AMD EPYC" in text and "### sv client, 1 req/s" in text
    row = next(line for line in text.splitlines() if line.startswith("| **lamps**"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["1.00", "1.50"] and cells[5] == "0.50x" and cells[9] == "0.25x"
    assert cells[13] == "p1 / s0 / d2" and cells[14] == "- / - / -" and cells[-1] == "2/2"
    assert tb.counter_delta({"a": 5, "d": {"x": 3}, "s": "t"}, {"a": 2, "d": {"x": 1}}) == {"a": 3, "d": {"x": 2}}


def _tool_policy_available() -> bool:
    from parrot.engine.settings import EngineSettings

    return "engine_policy" in EngineSettings.model_fields


@pytest.mark.skipif(not _tool_policy_available(), reason="engine settings have no engine_policy yet")
def test_quick_run_on_real_servers(tmp_path):
    data = tb.main(["--quick", "--out", str(tmp_path)])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert any(f.endswith(".json") for f in files) and any(f.endswith(".md") for f in files)
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["conditions"]["cpu path (engine numerics)"] == data["numerics"]["path"]
    assert [(r["client"], r["rate"]) for r in data["runs"]] == [("sv", 8.0), ("openai", 8.0)]
    for run in data["runs"]:
        for name, r in run["variants"].items():
            assert r["failed"] == 0, (run["client"], name, r["errors"])
            assert r["completed"] == 3 and r["mean_s"] > 0 and r["ttft_mean_s"] is not None
            assert r["ttft_mean_s"] <= r["mean_s"]
            pauses = r["engine"]["tool_pauses"]
            assert sum(pauses.values()) >= 3, (run["client"], name, pauses)  # every request paused at least once
        assert run["variants"]["discard"]["engine"]["tool_pauses"].get("preserve", 0) == 0
    assert data["predictors"]["lamps"]["output_length"]["observations"] > 0
    assert "MAE tokens" in (tmp_path / f"{tb.result_name(data)}.md").read_text()
