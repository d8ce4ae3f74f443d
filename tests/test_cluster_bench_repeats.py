"""cluster_bench --repeats: medians per policy, ratio of the medians, and the per-run ratios (no servers)."""

import pytest

from parrot.bench.cluster_bench import median_run, parse_args, report


def test_median_run_takes_the_median_of_numbers_and_keeps_the_runs():
    runs = [{"e2e_s": 3.0, "apps_e2e_s": [3.0], "n": 10}, {"e2e_s": 1.0, "apps_e2e_s": [1.0], "n": 12},
            {"e2e_s": 2.0, "apps_e2e_s": [2.0], "n": 11}]
    m = median_run(runs)
    assert m["e2e_s"] == 2.0 and m["n"] == 11
    assert m["apps_e2e_s"] == [3.0]  # non-numbers: the first run's
    assert m["runs"] == runs


def test_a_single_run_is_reported_as_before():
    m = median_run([{"e2e_s": 2.0}])
    assert m == {"e2e_s": 2.0}


def test_report_shows_medians_and_per_run_ratios():
    parrot = median_run([{"e2e_s": 1.0}, {"e2e_s": 2.0}, {"e2e_s": 4.0}])
    base = median_run([{"e2e_s": 3.0}, {"e2e_s": 3.0}, {"e2e_s": 2.0}])
    text, panels = report({"map_reduce": {"parrot": parrot, "fifo-throughput": base}},
                          ["parrot", "fifo-throughput"])
    assert "medians of 3 runs" in text
    assert "1.5" in text  # 3.0 / 2.0: the ratio of the medians
    assert "fifo-throughput / parrot per run: e2e s 3.00 1.50 0.50" in text
    assert panels["map_reduce: e2e s"] == {"parrot": 2.0, "fifo-throughput": 3.0}


def test_repeats_must_be_positive():
    assert parse_args(["--repeats", "3"]).repeats == 3
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])
