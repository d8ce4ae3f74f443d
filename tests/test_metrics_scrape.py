"""Issue 20's must-show: `parrot serve --engines 2` (real processes, the real default model, an API key) under a
small real workload (Parrot-API apps sharing a prefix, OpenAI completions with n=3, streamed chat, a repeated
prompt); /metrics of the server and of each engine process scraped before, during and after, every scrape parsed by
the Prometheus text parser, and every metric of the issue's list present and moving."""

from __future__ import annotations

import pytest

from parrot.bench.metrics_scrape import ENGINE_REQUIRED, REQUIRED, run

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_every_metric_moves_on_the_server_and_the_engine_processes(tmp_path, default_model_path):
    result = run(engines=2, rounds=1, log_dir=tmp_path)
    assert result.failures == []
    report = result.report()
    rows = report["server"]
    assert report["scrapes_during"] >= 3
    for item, families in REQUIRED.items():
        for fam in families:
            assert fam in result.server["after"].types, f"{fam} ({item}) missing from /metrics"
            assert rows[fam]["moved"], f"{fam} ({item}) did not change: {rows[fam]}"
    after = result.server["after"]
    assert after.types["parrot_requests"] == "counter"
    assert after.types["parrot_time_to_first_token_seconds"] == "histogram"
    # 6 Parrot-API requests, 2 + 2 + 8 completions, 2 chats: all finished, under the server's policy
    req = after.samples["parrot_requests"]
    finished = {dict(labels)["api"]: v for (name, labels), v in req.items()
                if name == "parrot_requests_total" and dict(labels)["status"] == "finished"
                and dict(labels)["policy"] == "fifo-latency"}
    assert finished == {"parrot": 6, "completions": 12, "chat": 2}
    assert rows["parrot_engine_up"]["before"] is None and rows["parrot_engine_up"]["after"] == 2
    assert rows["parrot_queue_length"]["during_max"] >= 1  # the capped policy made requests wait
    assert rows["parrot_engine_shared_prefix_decode_rows"]["after"] > 0
    assert 0 < rows["parrot_engine_prefix_cache_hit_rate"]["after"] <= 1
    # each engine process's own /metrics: the same families, from its live status
    assert set(report["engines"]) == {"engine-0", "engine-1"}
    for name, fams in report["engines"].items():
        for fam in ENGINE_REQUIRED:
            assert fams[fam]["moved"], f"{name}: {fam} did not change: {fams[fam]}"
    assert sum(f["parrot_engine_shared_prefix_decode_rows"]["after"] for f in report["engines"].values()) == \
        rows["parrot_engine_shared_prefix_decode_rows"]["after"]
