"""The shipped Azure LLM trace excerpt and Preble 5.3's mixed workload built on it."""

import pytest

from parrot.workloads.azure_trace import TraceRow, azure_mixed, load_trace


def test_the_excerpt_is_the_documented_window():
    rows = load_trace()
    assert len(rows) == 2300
    assert sum(r.kind == "code" for r in rows) == 781 and sum(r.kind == "conv" for r in rows) == 1519
    assert rows[0].t_s == 0.0 and rows[0].kind == "code" and rows[-1].t_s < 300
    assert all(a.t_s <= b.t_s for a, b in zip(rows, rows[1:]))
    # the trace's shape (Preble 3.6): code prompts are long and outputs short, conversations the other way round
    code = [r for r in rows if r.kind == "code"]
    conv = [r for r in rows if r.kind == "conv"]
    ratio = lambda rs: sum(r.context_tokens for r in rs) / sum(r.generated_tokens for r in rs)  # noqa: E731
    assert ratio(code) > 50 > ratio(conv)


def test_mixed_workload_keeps_the_trace_arrivals_scaled_and_fills_each_kind():
    reqs = azure_mixed(200, seed=1)
    rows = load_trace()[:200]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.7 * r.t_s for r in rows])
    for req, row in zip(reqs, rows):
        assert req.group.startswith(row.kind + ":")
        assert ("[toolbench]" in req.prompt) == (row.kind == "code")
        assert ("[video" in req.prompt) == (row.kind == "conv")
    assert azure_mixed(200, seed=1) == reqs and azure_mixed(200, seed=2) != reqs  # seeded


def test_bad_requests_and_files_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="fewer than"):
        azure_mixed(10, trace=[TraceRow(0.0, "code", 10, 2)])
    with pytest.raises(ValueError, match="time_scale"):
        azure_mixed(5, time_scale=0)
    bad = tmp_path / "t.csv"
    bad.write_text("t_s,kind,context_tokens,generated_tokens\n0.5,chat,10,2\n")
    with pytest.raises(ValueError, match="t.csv:2"):
        load_trace(bad)
