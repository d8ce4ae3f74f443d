"""Latency targets from the frontend (``get(perf=P.Latency(ttft_s=..., tpot_s=..., deadline_s=...))``) through the
real HTTP server to the manager: deduction labels, and the scheduler's firm TPOT cap pushed to the engine.

The engine is the test fake (tests/fakes.py) behind the real server app on a real socket; no model, no torch.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import parrot as P
from parrot.common.errors import InvalidRequestError

pytest.importorskip("fastapi")

from fakes import FakeEngine  # noqa: E402


class CapRecordingEngine(FakeEngine):
    """Records the token caps the dispatcher pushes (EngineClient.set_token_cap)."""

    def __init__(self) -> None:
        super().__init__("fake0", max_model_len=4096)
        self.caps: list[int | None] = []

    async def set_token_cap(self, max_running_tokens: int | None) -> bool:
        self.caps.append(max_running_tokens)
        return True


@pytest.fixture(scope="module")
def server():
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.frontend.local import LocalServer

    engine = CapRecordingEngine()
    # the parrot policy's capacity profile: TPOT = 15 ms + 5 us per running token (CapacityConfig defaults)
    srv = LocalServer(create_app(ServerSettings(policy="parrot", latency_cap_tokens=2048), [engine]))
    yield srv, engine
    srv.stop()


@pytest.fixture
def session(server):
    srv, engine = server
    s = P.connect(srv.url, make_default=False)
    yield s, engine
    s.close()


def _define(doc: str, params: str, **kw):
    ns: dict = {}
    exec(f"def f({params}):\n    {doc!r}\n", ns)
    return P.semantic_function(**kw)(ns["f"])


draft = _define("Topic: {{input:topic}}\nDraft: {{output:draft}}", "topic", max_tokens=12, ignore_eos=True)
polish = _define("Polish this: {{input:draft}}\nFinal: {{output:final}}", "draft", max_tokens=12, ignore_eos=True)


def _sched(s, output_var) -> tuple[dict, dict]:
    """(label of the producer of ``output_var``, label of its predecessor) from the session's DAG."""
    dag = s.dag()
    producer = next(v["producer"] for v in dag["variables"] if v["var_id"] == output_var.id)
    by_id = {r["request_id"]: r for r in dag["requests"]}
    other = next(r for r in dag["requests"] if r["request_id"] != producer)
    return by_id[producer]["sched"], other["sched"]


def test_latency_targets_reach_the_scheduler_and_cap_the_engine(session):
    s, engine = session
    topic = P.SemanticVariable(name="topic", session=s)  # not set yet: nothing can run
    final = polish(draft(topic, session=s), session=s)
    before = time.time()
    with pytest.raises(TimeoutError):  # pending; the first poll recorded the criterion and its targets
        final.get(perf=P.Latency(ttft_s=0.5, tpot_s=0.02, deadline_s=60), timeout=0.3)
    mine, upstream = _sched(s, final)
    assert mine["criteria"] == "latency" and mine["targets"]["ttft_s"] == 0.5 and mine["targets"]["tpot_s"] == 0.02
    deadline = mine["targets"]["deadline"]
    assert before + 59 < deadline < time.time() + 61  # absolute on the server: 60 s after the GET
    # the predecessor (the draft) is latency-sensitive too and inherits only the deadline (paper §5.2 extension)
    assert upstream["criteria"] == "latency" and upstream["targets"] == {"deadline": deadline}

    # TPOT 20 ms with the 15 ms + 5 us/token profile is a firm cap of 1000 running tokens on the engine that
    # runs the final step (the draft runs under the plain 2048-token latency cap)
    engine.token_delay_s = 0.02  # long enough for the dispatcher's cap push to land while the step runs
    try:
        topic.set("parrots")
        assert final.get(perf=P.Latency(ttft_s=0.5, tpot_s=0.02, deadline_s=60), timeout=30).startswith("<")
    finally:
        engine.token_delay_s = 0.0
    assert 2048 in engine.caps and 1000 in engine.caps
    assert engine.caps.index(2048) < engine.caps.index(1000)


def test_aget_sends_targets_and_bad_criteria_are_typed_errors(session):
    s, _ = session

    async def main():
        return await polish(draft("tea", session=s), session=s).aget(perf=P.Latency(deadline_s=30), timeout=30)

    assert asyncio.run(main()).startswith("<")
    labels = [r["sched"] for r in s.dag()["requests"]]
    assert all(label["criteria"] == "latency" and set(label["targets"]) == {"deadline"} for label in labels)
    with pytest.raises(InvalidRequestError, match="tpot_s"):
        P.Latency(tpot_s=0)
    with pytest.raises(InvalidRequestError, match="deadline_s"):
        P.Latency(deadline_s=float("inf"))
    with pytest.raises(InvalidRequestError, match="unknown perf criterion"):
        draft("x", session=s).get(perf="fastest", timeout=1)
    assert P.Latency(ttft_s=0.25, tpot_s=0.05).query() == {"ttft_ms": 250.0, "tpot_ms": 50.0}
