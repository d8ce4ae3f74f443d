"""Sessions: auth, TTL expiry (manual and by the background task) freeing engine contexts, deletion,
engine dispatch, and the no-torch rule for the manager."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from parrot.common.errors import (
    EngineUnavailable,
    InvalidRequestError,
    InvalidSessionToken,
    StepFailed,
    UnknownModel,
    UnknownSession,
)
from parrot.manager import DispatchRequest, EngineRegistry, LeastLoadedPolicy, Manager, ManagerConfig
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from fakes import FakeEngine


def _blocked_request(mgr, session):
    return mgr.submit(session, SubmitSpec("hello {{output:y}}", [PlaceholderSpec("y", True)]))


def test_session_auth_and_limits():
    async def main():
        mgr = Manager(EngineRegistry([FakeEngine()]), config=ManagerConfig(engine_heartbeat_s=0, max_sessions=2))
        s = mgr.create_session(ttl_s=30)
        assert s.session_id.startswith("s_") and len(s.session_id) > 20 and len(s.token) >= 40
        assert mgr.session(s.session_id, s.token) is s
        with pytest.raises(InvalidSessionToken) as e:
            mgr.session(s.session_id, "wrong")
        assert e.value.status_code == 401 and e.value.code == "invalid_session_token"
        with pytest.raises(InvalidSessionToken):
            mgr.session(s.session_id, None)
        with pytest.raises(UnknownSession) as e:
            mgr.session("s_nope", s.token)
        assert e.value.status_code == 404
        with pytest.raises(InvalidRequestError):
            mgr.create_session(ttl_s=-1)
        mgr.create_session()
        with pytest.raises(InvalidRequestError, match="too many"):
            mgr.create_session()

    asyncio.run(main())


def test_ttl_expiry_waits_for_waiting_gets_then_closes_session_frees_contexts_and_fails_gets():
    now = [1000.0]

    async def main():
        eng = FakeEngine()
        eng.gate = asyncio.Event()  # the request stays running (its context alive) until expiry
        mgr = Manager(EngineRegistry([eng]), config=ManagerConfig(engine_heartbeat_s=0), clock=lambda: now[0])
        await mgr.start()
        try:
            s = mgr.create_session(ttl_s=10)
            req = _blocked_request(mgr, s)
            waiting = asyncio.create_task(mgr.get_variable(s, req.outputs[0], timeout_s=30))
            await asyncio.sleep(0.05)
            assert set(eng.contexts) == {req.context_id}
            now[0] += 5
            assert await mgr.expire_sessions() == 0
            now[0] += 11
            assert await mgr.expire_sessions() == 0  # a GET is waiting for the value: the session is in use
            waiting.cancel()  # that client went away: its wait ends, the producer keeps running
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert set(eng.contexts) == {req.context_id} and s.waiting_gets == 0
            now[0] += 11  # ttl_s after that wait ended
            assert await mgr.expire_sessions() == 1
            assert eng.contexts == {} and eng.freed == [req.context_id]
            with pytest.raises(StepFailed) as e:
                await mgr.get_variable(s, req.outputs[0], timeout_s=5)
            assert e.value.cause_code == "unknown_session"
            text = mgr.metrics.render().decode()
            assert 'parrot_cancelled_requests_total{api="parrot",reason="session_expired"} 1.0' in text
            with pytest.raises(UnknownSession):
                mgr.session(s.session_id, s.token)
            assert s.tasks == set()
        finally:
            await mgr.stop()

    asyncio.run(main())


class _RecordingPolicy(LeastLoadedPolicy):
    """Least-loaded placement that records the queue entries it is shown."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def place(self, queue, cluster):
        self.seen.extend(queue)
        return super().place(queue, cluster)


def test_manager_hands_its_clock_to_every_component():
    """Sessions, DAG timestamps, queue order and the deduced app order all read the manager's clock (the
    simulator relies on it: with the default time.time they would be ~1.7e9, not the fake values)."""
    now = [100.0]

    async def main():
        policy = _RecordingPolicy()
        mgr = Manager(EngineRegistry([FakeEngine()]), policy=policy, config=ManagerConfig(engine_heartbeat_s=0),
                      clock=lambda: now[0])
        await mgr.start()
        try:
            s = mgr.create_session()
            assert s.created_at == s.last_access == 100.0
            now[0] = 200.0
            x = mgr.create_variable(s, "x")
            req = mgr.submit(s, SubmitSpec("say {{input:x}} {{output:y}}", [PlaceholderSpec("x", False, x.var_id),
                                                                                PlaceholderSpec("y", True)]))
            await mgr.get_variable(s, req.outputs[0], criteria="latency")
            assert mgr.deduction.info(s.session_id, req.request_id).app_order == 200.0
            now[0] = 300.0
            mgr.set_variable(s, x.var_id, "hi")
            await mgr.get_variable(s, req.outputs[0], timeout_s=5)
            times = mgr.dag(s).requests[0]["timestamps"]
            assert times == {"submitted": 200.0, "dispatched": 300.0, "first_token": 300.0, "finished": 300.0}
            assert [q.enqueued_at for q in policy.seen] == [300.0]
        finally:
            await mgr.stop()

    asyncio.run(main())


def test_background_cleanup_task_expires_idle_sessions():
    async def main():
        eng = FakeEngine()
        eng.gate = asyncio.Event()
        mgr = Manager(EngineRegistry([eng]),
                      config=ManagerConfig(engine_heartbeat_s=0, session_cleanup_interval_s=0.05))
        await mgr.start()
        try:
            s = mgr.create_session(ttl_s=0.2)
            keep = mgr.create_session(ttl_s=60)
            _blocked_request(mgr, s)
            await asyncio.sleep(0.05)
            assert len(eng.contexts) == 1
            for _ in range(100):  # bounded wait for the cleanup task
                if not eng.contexts:
                    break
                await asyncio.sleep(0.02)
            assert eng.contexts == {} and len(eng.freed) == 1
            assert [x.session_id for x in mgr.sessions.all()] == [keep.session_id]
        finally:
            await mgr.stop()

    asyncio.run(main())


def test_delete_session_and_stop_free_contexts():
    async def main():
        eng = FakeEngine()
        eng.gate = asyncio.Event()
        mgr = Manager(EngineRegistry([eng]), config=ManagerConfig(engine_heartbeat_s=0))
        await mgr.start()
        a, b = mgr.create_session(), mgr.create_session()
        _blocked_request(mgr, a)
        _blocked_request(mgr, b)
        await asyncio.sleep(0.05)
        assert len(eng.contexts) == 2
        await mgr.delete_session(a)
        assert len(eng.contexts) == 1
        await mgr.stop()  # closes the remaining session
        assert eng.contexts == {} and len(eng.freed) == 2

    asyncio.run(main())


def test_least_loaded_dispatch_and_model_filter():
    async def main():
        e0, e1, other = FakeEngine("e0"), FakeEngine("e1"), FakeEngine("e2", model="other-model")
        mgr = Manager(EngineRegistry([e0, e1, other]), policy=LeastLoadedPolicy(),
                      config=ManagerConfig(engine_heartbeat_s=0))
        await mgr.start()
        try:
            d = mgr.dispatcher
            l1 = await d.acquire(DispatchRequest("a", models=("fake-model",), prompt_tokens=10))
            l2 = await d.acquire(DispatchRequest("b", models=("fake-model",), prompt_tokens=10))
            assert {l1.engine, l2.engine} == {"e0", "e1"}
            l1.release()
            l1.release()  # idempotent
            l3 = await d.acquire(DispatchRequest("c", models=("fake-model",)))
            assert l3.engine == l1.engine
            assert (await d.acquire(DispatchRequest("d", models=("other-model",)))).engine == "e2"
            with pytest.raises(UnknownModel):
                await d.acquire(DispatchRequest("e", models=("missing",)))
            for entry in mgr.registry.entries():
                entry.healthy = False
            with pytest.raises(EngineUnavailable):
                await d.acquire(DispatchRequest("f"))
            await mgr.registry.refresh()  # heartbeats heal them
            assert (await d.acquire(DispatchRequest("g"))).engine in {"e0", "e1", "e2"}
        finally:
            await mgr.stop()

    asyncio.run(main())


def test_manager_does_not_import_torch():
    code = ("import sys, parrot.manager, parrot.manager.executor, parrot.manager.session; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=Path(__file__).resolve().parents[1])


def test_server_settings_are_the_manager_config_plus_http_fields(monkeypatch):
    """One definition per setting: ServerSettings carries every ManagerConfig field (same name, default and
    constraint), fed by PARROT_<FIELD>; only the HTTP limit on a long poll is added."""
    from parrot.api.settings import ServerSettings

    assert list(ServerSettings.model_fields)[:len(ManagerConfig.model_fields)] == list(ManagerConfig.model_fields)
    assert ServerSettings().manager_config() == ManagerConfig()
    monkeypatch.setenv("PARROT_SESSION_CLEANUP_INTERVAL_S", "0.5")
    monkeypatch.setenv("PARROT_ENGINE_HEARTBEAT_S", "0")
    config = ServerSettings(policy="parrot").manager_config()
    assert (config.session_cleanup_interval_s, config.engine_heartbeat_s, config.policy) == (0.5, 0.0, "parrot")
    for bad in ({"session_cleanup_interval_s": 0}, {"engine_heartbeat_s": -1}, {"policy": "nope"},
                {"latency_cap_tokens": 9, "throughput_cap_tokens": 8}, {"heartbeat_interval_s": 1}):
        for cls in (ManagerConfig, ServerSettings):
            with pytest.raises(ValueError, match=next(iter(bad)) if len(bad) == 1 else "latency_cap_tokens"):
                cls(**bad)
    assert ManagerConfig(max_long_poll_s=3600).max_long_poll_s == 3600  # the simulator's long polls
    with pytest.raises(ValueError, match="max_long_poll_s"):
        ServerSettings(max_long_poll_s=61)
