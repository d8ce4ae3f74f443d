"""Latency targets from the frontend as keywords (issue 20 item 4): ``var.get(perf=P.LATENCY, ttft_ms=...,
tpot_ms=..., deadline_s=...)``, ``aget`` and ``stream`` reach the manager's deduction exactly as a raw HTTP
``GET ...?criteria=latency&ttft_ms=&tpot_ms=&deadline_s=`` does.

The fake engine (tests/fakes.py) behind the real server app on a real socket; the manager's clock is fixed, so
the absolute deadlines (GET time + deadline_s) of the two paths are comparable exactly.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

import parrot as P
from parrot.common.errors import InvalidRequestError, StepFailed

pytest.importorskip("fastapi")

from test_frontend_perf import _define  # noqa: E402  (a semantic function from a template)
from fakes import FakeEngine  # noqa: E402

NOW = 1_000_000.0  # the manager's clock (fixed)


@pytest.fixture(scope="module")
def server():
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.frontend.local import LocalServer

    app = create_app(ServerSettings(policy="parrot"), [FakeEngine("fake0", max_model_len=4096)], clock=lambda: NOW)
    srv = LocalServer(app)
    yield srv, app
    srv.stop()


draft = _define("Topic: {{input:topic}}\nDraft: {{output:draft}}", "topic", max_tokens=8, ignore_eos=True)
polish = _define("Polish this: {{input:draft}}\nFinal: {{output:final}}", "draft", max_tokens=8, ignore_eos=True)


def _pending_app(url: str):
    """A session with topic (unset: nothing runs) -> draft -> final; returns (session, final)."""
    s = P.connect(url, make_default=False)
    topic = P.SemanticVariable(name="topic", session=s)
    return s, polish(draft(topic, session=s), session=s)


def _deduced(app, s) -> dict:
    """The manager's own labels for the session (objective, task group, targets per request number)."""
    manager = app.state.manager
    session = manager.sessions.authenticate(s.session_id, s._token, "anonymous")
    labels = manager.deduction.labels(s.session_id)
    return {session.graph.requests[rid].number: (label.criteria, label.task_group, label.targets)
            for rid, label in labels.items()}


def _raw_get(s, var_id: str, params: dict) -> httpx.Response:
    return httpx.get(f"{s.url}/api/v1/sessions/{s.session_id}/variables/{var_id}", params=params,
                     headers={"X-Parrot-Session-Token": s._token}, timeout=10)


# odd values on purpose: ms -> s -> ms conversions in the client would change them in the last bit
TARGETS = {"ttft_ms": 1.1, "tpot_ms": 33.3, "deadline_s": 7.7}


def test_keyword_targets_reach_the_deduction_exactly_as_a_raw_http_get(server):
    srv, app = server
    s_front, final_front = _pending_app(srv.url)
    s_raw, final_raw = _pending_app(srv.url)
    try:
        with pytest.raises(TimeoutError):  # pending: the first poll carried the targets
            final_front.get(perf=P.LATENCY, timeout=0.2, **TARGETS)
        r = _raw_get(s_raw, final_raw.id, {"criteria": "latency", **TARGETS})
        assert r.status_code == 200 and r.json()["status"] == "pending"
        front, raw = _deduced(app, s_front), _deduced(app, s_raw)
        assert front == raw and set(front) == {1, 2}
        criteria, _, targets = front[2]  # the producer of the fetched variable: all three targets
        assert criteria is P.LATENCY and targets.ttft_s == 1.1 / 1000 and targets.tpot_s == 33.3 / 1000
        assert targets.deadline == NOW + 7.7
        assert front[1][2].ttft_s is None and front[1][2].deadline == NOW + 7.7  # its predecessor: the deadline
    finally:
        s_front.close()
        s_raw.close()


def test_aget_and_stream_send_the_same_targets(server):
    srv, app = server
    s_raw, final_raw = _pending_app(srv.url)
    s_async, final_async = _pending_app(srv.url)
    s_stream, final_stream = _pending_app(srv.url)
    try:
        _raw_get(s_raw, final_raw.id, {"criteria": "latency", "ttft_ms": 250, "deadline_s": 30})

        async def aget():
            return await final_async.aget(perf=P.LATENCY, timeout=0.2, ttft_ms=250, deadline_s=30)

        with pytest.raises(TimeoutError):
            asyncio.run(aget())
        failures: list[StepFailed] = []

        def read():
            try:
                list(final_stream.stream(ttft_ms=250, deadline_s=30))
            except StepFailed as e:
                failures.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        for _ in range(250):  # the stream's GET records the targets before any event
            if _deduced(app, s_stream):
                break
            time.sleep(0.02)
        assert _deduced(app, s_async) == _deduced(app, s_raw) == _deduced(app, s_stream)
        assert _deduced(app, s_raw)[2][2].tpot_s is None
        httpx.delete(f"{s_stream.url}/api/v1/sessions/{s_stream.session_id}",
                     headers={"X-Parrot-Session-Token": s_stream._token})
        reader.join(10)
        assert failures[0].cause_code == "unknown_session"  # the pending stream ended with the session
    finally:
        for s in (s_raw, s_async, s_stream):
            s.close()


def test_targets_are_validated_before_anything_is_sent(server):
    srv, _ = server
    s, final = _pending_app(srv.url)
    try:
        for kw, param in (({"ttft_ms": -5}, "ttft_ms"), ({"tpot_ms": 0}, "tpot_ms"),
                          ({"deadline_s": float("inf")}, "deadline_s"), ({"ttft_ms": float("nan")}, "ttft_ms"),
                          ({"ttft_ms": True}, "ttft_ms"), ({"tpot_ms": "5"}, "tpot_ms")):
            with pytest.raises(InvalidRequestError) as ei:
                final.get(timeout=0.1, **kw)
            assert ei.value.param == param
            with pytest.raises(InvalidRequestError):
                final.stream(**kw)  # validated at the call, not at the first next()
        with pytest.raises(InvalidRequestError, match="need perf=LATENCY"):
            final.get(perf=P.THROUGHPUT, ttft_ms=100, timeout=0.1)
        with pytest.raises(InvalidRequestError, match="not both"):
            final.get(perf=P.Latency(ttft_s=0.1), tpot_ms=10, timeout=0.1)

        async def bad_aget():
            await final.aget(deadline_s=-1, timeout=0.1)

        with pytest.raises(InvalidRequestError) as ei:
            asyncio.run(bad_aget())
        assert ei.value.param == "deadline_s"
        assert s.dag()["requests"][1]["sched"] is None  # none of the rejected calls reached the server
    finally:
        s.close()
