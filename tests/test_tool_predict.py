"""The manager's LAMPS predictors (parrot.manager.tool_predict): the binned output-length classifier learns per
template / tools / prompt size online and reports its prequential accuracy; tool durations are running stats
with the client's hint as the prior; both are exposed in GET /api/v1/stats and /metrics."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from fastapi.testclient import TestClient

from parrot.api import ServerSettings, create_app
from parrot.manager.tool_predict import (BIN_TOKENS, DEFAULT_TOKENS, BinnedLengthPredictor, Predictors,
                                         PromptFeatures, ToolDurations, bin_of)
from fakes import FakeEngine


def f(template="t", prompt=100, max_tokens=512, tools=(), model="m"):
    return PromptFeatures(model, prompt, max_tokens, template, tuple(tools))


def test_no_history_predicts_the_default_capped_at_max_tokens():
    p = BinnedLengthPredictor()
    assert p.predict(f()) == DEFAULT_TOKENS
    assert p.predict(f(max_tokens=10)) == 10
    assert p.accuracy().observations == 0 and p.accuracy().mean_abs_error is None


def test_learns_per_template_and_beats_a_global_mean_on_a_mixed_workload():
    """Three applications with different answer lengths (a label, a sentence, a paragraph), noisy: the per-template
    histograms predict each well; one global estimate cannot. Accuracy is measured before learning each sample."""
    rng = random.Random(7)
    apps = {"classify": 3, "qa": 40, "summarize": 220}
    p = BinnedLengthPredictor()
    seen: list[int] = []
    global_err = []
    for _ in range(600):
        app = rng.choice(list(apps))
        n = max(1, round(rng.gauss(apps[app], apps[app] * 0.1)))
        if seen:
            global_err.append(abs(statistics.median(seen) - n))
        seen.append(n)
        p.observe(f(app, prompt=rng.randint(50, 400)), n)
    acc = p.accuracy()
    assert acc.observations == 600
    baseline = statistics.mean(global_err)
    assert acc.mean_abs_error < 0.25 * baseline, (acc, baseline)
    assert acc.within_bin_rate > 0.5 and acc.within_15_rate > 0.75  # summarize (sd 22) spans several bins
    assert abs(p.predict(f("classify", prompt=64)) - 3) <= 1
    assert abs(p.predict(f("summarize", prompt=300)) - 220) <= 25
    assert p.predict(f("summarize", max_tokens=100)) == 100  # never beyond what may be generated


def test_prompt_size_and_tools_refine_a_template():
    p = BinnedLengthPredictor()
    for _ in range(5):
        p.observe(f("chat", prompt=20), 10)  # short prompts: short answers
        p.observe(f("chat", prompt=2000), 300)  # long documents: long answers
        p.observe(f("chat", prompt=20, tools=("search",)), 60)  # offered a tool: it writes a call
    assert bin_of(p.predict(f("chat", prompt=24))) == bin_of(10)
    assert bin_of(p.predict(f("chat", prompt=1800))) == bin_of(300)
    assert bin_of(p.predict(f("chat", prompt=24, tools=("search",)))) == bin_of(60)
    # an unseen prompt size falls back to the template's histogram, an unseen template to the model's
    assert p.predict(f("chat", prompt=200)) in (10, 60, 300)
    assert p.predict(f("other", prompt=20)) in (10, 60, 300)
    assert p.predict(f("other", model="m2")) == DEFAULT_TOKENS


def test_adapts_after_a_shift_and_bounds_its_memory():
    p = BinnedLengthPredictor(max_keys=12)
    for _ in range(600):
        p.observe(f("a"), 20)
    for _ in range(1200):
        p.observe(f("a"), 200)
    assert bin_of(p.predict(f("a"))) == bin_of(200)  # old counts were halved away
    for i in range(50):
        p.observe(f(f"t{i}", prompt=i), 5)
    assert len(p._hists) <= 12
    with pytest.raises(ValueError):
        BinnedLengthPredictor(min_support=0)


def test_bins_are_lamps_fifty_by_ten():
    assert BIN_TOKENS == 10 and bin_of(0) == 0 and bin_of(9) == 0 and bin_of(10) == 1 and bin_of(10_000) == 49


def test_tool_durations_running_stats_and_client_hint():
    d = ToolDurations()
    assert d.predict("search") is None and d.predict("search", 0.7) == 0.7
    xs = [0.5, 0.7, 0.6, 1.2]
    for x in xs:
        d.observe("search", x)
    d.observe("search", -1.0)
    d.observe("search", math.nan)
    s = d.get("search")
    assert s.count == 4 and s.mean_s == pytest.approx(statistics.mean(xs))
    assert s.std_s == pytest.approx(statistics.stdev(xs))
    assert d.predict("search", 9.0) == pytest.approx(statistics.mean(xs))  # observations win over the hint
    assert [t.name for t in d.all()] == ["search"]
    small = ToolDurations(max_tools=2)
    for name in "abc":
        small.observe(name, 1.0)
    assert [t.name for t in small.all()] == ["b", "c"]


def test_stats_merge_engine_pause_counts():
    p = Predictors()
    p.paused("preserve")
    p.paused("preserve")
    p.paused("free")
    stats = p.stats([{"paused": 1, "by_handling": {"preserve": 2}, "resumed": 1},
                     {"paused": 0, "by_handling": {"swap": 1, "preserve": 1}, "resumed": 1, "note": "x"}])
    assert stats["pauses_requested"] == {"preserve": 2, "free": 1}
    assert stats["engine_pauses"] == {"paused": 1, "by_handling": {"preserve": 3, "swap": 1}, "resumed": 2}


def test_predictions_reach_stats_and_metrics_through_the_openai_path():
    with TestClient(create_app(ServerSettings(engine_heartbeat_s=0), [FakeEngine()])) as c:
        for i in range(4):
            r = c.post("/v1/completions", json={"model": "fake-model", "prompt": f"Hello {i}", "max_tokens": 8})
            assert r.status_code == 200
        stats = c.get("/api/v1/stats").json()["tools"]["output_length"]
        assert stats["observations"] == 4 and stats["mean_abs_error"] is not None
        metrics = c.get("/metrics").text
    assert "parrot_output_length_predictions_total 4.0" in metrics
    assert "parrot_output_length_prediction_mae_tokens" in metrics
