"""Prometheus metrics and structured logs on fake state: the engine status families, the manager's observed and
scraped metrics over a fake engine, placement reasons, /metrics behind the API key, request / session ids on log
records. The real-server scrape during a workload is tests/test_metrics_scrape.py."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from parrot.api import ServerSettings, create_app
from parrot.common.errors import StepFailed
from parrot.common.log_context import ContextFilter, JsonFormatter, configure_logging, set_log_context
from parrot.common.perf import PerfCriteria
from parrot.protocol.interface import EngineStatus
from parrot.protocol.metrics import NAMES, render_status, status_families
from parrot.manager import Manager
from parrot.manager.completion_types import ChoiceSpec, CompletionSpec
from parrot.manager.completions import CompletionService
from parrot.manager.metrics import placement_reason
from parrot.manager.perf_deduction import RequestLabel, SchedInfo
from parrot.manager.policies import ClusterView, Demand, DispatchRequest, EngineView, PlacedRequest, QueuedRequest
from parrot.manager.policies.base import WorkKind
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from fakes import FakeEngine
from test_manager_executor import run as run_manager


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of a Prometheus text exposition (parsed by the official parser)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def status(**extra) -> EngineStatus:
    return EngineStatus(name="e0", model="m", max_model_len=512, num_running=3, num_waiting=2, running_tokens=300,
                        waiting_tokens=40, kv_blocks_total=100, kv_blocks_used=30, kv_blocks_shared=5,
                        kv_blocks_cached=7, block_size=16, num_contexts=4, num_preempted_total=1, extra=extra)


def test_engine_status_families_read_every_field_and_the_hit_rate():
    s = status(steps=10, tokens_computed=500, prefix_cache_query_tokens=400, prefix_cache_hit_tokens=100,
               prefix_cache_hit_blocks=6, shared_prefix_decode_rows=12, kv_blocks_evicted=2)
    text = render_status(s).decode()
    got = samples(text)
    lab = (("engine", "e0"), ("model", "m"))
    assert got[("parrot_engine_up", lab)] == 1
    assert got[("parrot_engine_running_requests", lab)] == 3
    assert got[("parrot_engine_waiting_requests", lab)] == 2
    assert got[("parrot_engine_running_tokens", lab)] == 300
    assert got[("parrot_engine_kv_blocks_used", lab)] == 30
    assert got[("parrot_engine_kv_blocks_shared", lab)] == 5
    assert got[("parrot_engine_kv_blocks_cached", lab)] == 7
    assert got[("parrot_engine_prefix_cache_hit_rate", lab)] == 0.25
    assert got[("parrot_engine_shared_prefix_decode_rows_total", lab)] == 12
    assert got[("parrot_engine_preemptions_total", lab)] == 1
    types = families(text)
    assert types["parrot_engine_steps"] == "counter" and types["parrot_engine_kv_blocks_used"] == "gauge"
    assert set(NAMES) <= set(types)
    # an engine that does not count something (an adapter) leaves that counter out instead of claiming 0
    bare = {f.name: f.samples for f in status_families([status()])}
    assert bare["parrot_engine_steps"] == [] and bare["parrot_engine_prefix_cache_hit_rate"][0].value == 0.0
    assert bare["parrot_engine_paused_contexts"] == [] and bare["parrot_engine_tool_pauses"] == []


def test_engine_tool_pause_and_host_store_metrics():
    s = status(tool_pauses={"paused": 2, "by_handling": {"preserve": 3, "swap": 1}, "resumed": 1, "expired": 1,
                            "demoted": 1},
               host_store={"blocks": 12, "capacity": 64, "stored": 20, "hits": 8, "evicted": 0})
    got = samples(render_status(s).decode())
    lab = (("engine", "e0"), ("model", "m"))
    assert got[("parrot_engine_paused_contexts", lab)] == 2
    assert got[("parrot_engine_host_kv_blocks", lab)] == 12
    assert got[("parrot_engine_tool_pauses_total", tuple(sorted((*lab, ("handling", "preserve")))))] == 3
    assert got[("parrot_engine_tool_pauses_total", tuple(sorted((*lab, ("handling", "swap")))))] == 1
    assert got[("parrot_engine_tool_pauses_resumed_total", lab)] == 1
    assert got[("parrot_engine_tool_pauses_expired_total", lab)] == 1
    assert got[("parrot_engine_tool_pauses_demoted_total", lab)] == 1
    assert got[("parrot_engine_host_kv_blocks_restored_total", lab)] == 8


async def failing_request(mgr: Manager, engine: FakeEngine, session):
    """Submit a request whose generation fails on the fake engine; wait until it failed."""
    engine.fail_generate_when = "boom"
    bad = mgr.submit(session, SubmitSpec("boom {{output:x}}", [PlaceholderSpec("x", True)]))
    with pytest.raises(StepFailed):
        await mgr.get_variable(session, bad.outputs[0], timeout_s=5)
    engine.fail_generate_when = None
    return bad


def test_manager_metrics_count_requests_latencies_placements_and_read_state_at_scrape():
    async def body(mgr: Manager, engine: FakeEngine):
        before = mgr.metrics.render().decode()
        s = mgr.create_session()
        task = mgr.create_variable(s, "task", "a snake game")
        req = mgr.submit(s, SubmitSpec("Write code of {{input:task}}.\nCode: {{output:code}}",
                                       [PlaceholderSpec("task", False, task.var_id),
                                        PlaceholderSpec("code", True, sampling={"max_tokens": 32})]))
        await mgr.get_variable(s, req.outputs[0], timeout_s=5)
        await failing_request(mgr, engine, s)
        service = CompletionService(mgr.dispatcher, metrics=mgr.metrics)
        plan = await service.plan_completion(CompletionSpec("fake-model", ["hello there"], ChoiceSpec(n=2,
                                                                                                   max_tokens=8)))
        await service.complete(plan)
        events = [e async for e in service.stream(await service.plan_completion(
            CompletionSpec("fake-model", ["streamed"], ChoiceSpec(max_tokens=8))))]
        assert events
        await asyncio.sleep(0)  # the DAG tasks' finally blocks
        await mgr.registry.refresh()
        return before, mgr.metrics.render().decode()

    before, after = run_manager(body)
    a, b = samples(after), samples(before)
    pol = ("policy", "least-loaded")
    assert a[("parrot_requests_total", (("api", "parrot"), pol, ("status", "finished")))] == 1
    assert a[("parrot_requests_total", (("api", "parrot"), pol, ("status", "failed")))] == 1
    assert a[("parrot_requests_total", (("api", "completions"), pol, ("status", "finished")))] == 2
    assert a[("parrot_time_to_first_token_seconds_count", (("api", "parrot"),))] == 1  # the failed one had none
    assert a[("parrot_e2e_request_latency_seconds_count", (("api", "completions"),))] == 2
    assert a[("parrot_time_per_output_token_seconds_count", (("api", "completions"),))] == 3  # n=2 + 1 stream
    assert a[("parrot_time_to_first_token_seconds_count", (("api", "completions"),))] == 2
    assert a[("parrot_placements_total", (pol, ("reason", "only_candidate")))] == 4
    assert a[("parrot_engine_up", (("engine", "fake0"), ("model", "fake-model")))] == 1
    assert a[("parrot_sessions", ())] == 1
    assert a[("parrot_queue_length", (pol,))] == 0
    assert ("parrot_requests_total", (("api", "parrot"), pol, ("status", "finished"))) not in b
    assert families(after)["parrot_engine_kv_blocks_used"] == "gauge"


def _view(name: str, *placed: PlacedRequest) -> EngineView:
    return EngineView(name, "m", 4096, None, 10_000, placed)


def test_placement_reasons():
    lat = Demand(1000, WorkKind.LATENCY)
    group = RequestLabel(PerfCriteria.LATENCY, task_group="g0")
    e0 = _view("e0", PlacedRequest("a", "s1", 500, lat, "g0"), PlacedRequest("b", "s2", 100, lat))
    e1 = _view("e1")
    cluster = ClusterView({"e0": e0, "e1": e1}, prefix_tokens=lambda e, hashes: 64 if e == "e1" and "h" in hashes
                          else 0)

    def q(session, *, label=None, hashes=(), engines=("e0", "e1")):
        return QueuedRequest(1, DispatchRequest("r", session, prompt_tokens=10, prefix_hashes=hashes),
                             SchedInfo(label), 0.0, engines)

    assert placement_reason(q("s1", engines=("e0",)), "e0", cluster) == "only_candidate"
    assert placement_reason(q("s1", label=group), "e0", cluster) == "task_group"
    assert placement_reason(q("s3", hashes=("h",)), "e1", cluster) == "prefix"
    assert placement_reason(q("s2"), "e0", cluster) == "app"
    assert placement_reason(q("s3"), "e1", cluster) == "least_loaded"
    assert placement_reason(q("s3"), "e0", cluster) == "other"


def test_metrics_route_needs_the_api_key_when_keys_are_configured():
    app = create_app(ServerSettings(engine_heartbeat_s=0, api_key="sk-metrics"), [FakeEngine()])
    with TestClient(app) as c:
        assert c.get("/metrics").status_code == 401
        r = c.get("/metrics", headers={"Authorization": "Bearer sk-metrics"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert "parrot_engine_up" in families(r.text)


def test_log_records_carry_request_and_session_ids(caplog):
    """Records logged inside a request's task (here the executor's failure log) carry its ids; outside, none."""
    caplog.handler.addFilter(ContextFilter())
    caplog.set_level(logging.INFO, logger="parrot.manager.executor")

    async def body(mgr: Manager, engine: FakeEngine):
        s = mgr.create_session()
        bad = await failing_request(mgr, engine, s)
        return s.session_id, bad.request_id

    sid, rid = run_manager(body)
    failed = [r for r in caplog.records if r.name == "parrot.manager.executor" and "failed" in r.getMessage()]
    assert failed and failed[0].session_id == sid and failed[0].request_id == rid
    line = json.loads(JsonFormatter().format(failed[0]))
    assert line["session_id"] == sid and line["request_id"] == rid and line["level"] == "INFO"

    async def outside():  # a task of its own: setting the ids there does not leak into this one
        set_log_context(request_id="x", session_id="y")

    async def main():
        await asyncio.create_task(outside())
        record = logging.LogRecord("t", logging.INFO, "f", 1, "m", (), None)
        ContextFilter().filter(record)
        return record

    record = asyncio.run(main())
    assert record.request_id == "-" and record.session_id == "-"


def test_log_format_is_validated():
    with pytest.raises(ValueError, match="log_format"):
        configure_logging("INFO", "xml")  # type: ignore[arg-type]
