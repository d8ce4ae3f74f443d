"""Failover: engines declared dead (missed heartbeats, failed calls), requests rescheduled on another engine
(restarting from their head, outputs already materialized kept), typed errors when no engine is left, dead ->
alive again. First on fake engines, then with real `parrot engine` processes (tiny random model) and SIGKILL."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from parrot.common.errors import EngineUnavailable, StepFailed
from parrot.manager import EngineRegistry, EngineState, Manager, ManagerConfig
from parrot.manager.graph import RequestStatus
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from engine_procs import SECRET, TINY_ENGINE, wait_until
from fakes import TAIL, FakeEngine, UnreachableEngine


class FlakyEngine(UnreachableEngine):
    """Goes unreachable during its ``die_on_generate``-th generate call (or when a test sets ``down``)."""

    def __init__(self, name: str, *, die_on_generate: int | None = None) -> None:
        super().__init__(name)
        self.die_on_generate = die_on_generate
        self.generates = 0

    async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
        # every generation passes here: the executor's streamed outputs, and FakeEngine.generate
        self._check()
        self.generates += 1
        if self.generates == self.die_on_generate:
            self.down = True
        async for chunk in super().generate_stream(sampling, context_id, parent_context_id, hint=hint):
            yield chunk


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def run(engines, body, *, registry_clock=None, **config):
    async def main():
        registry = EngineRegistry(engines, clock=registry_clock) if registry_clock else EngineRegistry(engines)
        mgr = Manager(registry, config=ManagerConfig(engine_heartbeat_s=0, **config))
        await mgr.start()
        try:
            return await asyncio.wait_for(body(mgr), 20)
        finally:
            await mgr.stop()

    return asyncio.run(main())


TWO_OUTPUTS = SubmitSpec("A: {{input:a}}\nB: {{output:b}}\nC: {{output:c}}",
                         [PlaceholderSpec("a", False, None), PlaceholderSpec("b", True), PlaceholderSpec("c", True)])


def submit_two_outputs(mgr, s, a_var):
    spec = SubmitSpec(TWO_OUTPUTS.prompt, [PlaceholderSpec("a", False, a_var), *TWO_OUTPUTS.placeholders[1:]])
    return mgr.submit(s, spec)


def test_missed_heartbeats_kill_an_engine_and_one_heartbeat_revives_it():
    clock = FakeClock()
    e0 = FakeEngine("e0")
    registry = EngineRegistry([e0], clock=clock)
    seen: list[EngineState] = []
    registry.add_listener(lambda entry: seen.append(entry.state))

    async def main():
        await registry.refresh()
        assert registry.entry("e0").state is EngineState.ALIVE
        clock.t += 5
        assert registry.check_timeouts(10) == []
        clock.t += 6  # 11 s without a heartbeat
        assert registry.check_timeouts(10) == ["e0"]
        with pytest.raises(EngineUnavailable):
            registry.candidates()
        registry.record_heartbeat("e0", await e0.status())  # a pushed heartbeat arrives again
        assert registry.entry("e0").healthy and registry.num_deaths == 1

    asyncio.run(main())
    assert seen == [EngineState.ALIVE, EngineState.DEAD, EngineState.ALIVE]


def test_unreachable_engine_mid_request_restarts_it_elsewhere_keeping_materialized_outputs():
    e0, e1 = FlakyEngine("e0", die_on_generate=2), FakeEngine("e1")

    async def body(mgr):
        s = mgr.create_session()
        a = mgr.create_variable(s, "a", "hi")
        req = submit_two_outputs(mgr, s, a.var_id)
        c = await mgr.get_variable(s, req.outputs[1], timeout_s=5)
        b = await mgr.get_variable(s, req.outputs[0])
        return req, b, c, mgr.stats()["failover"], mgr.registry.entry("e0").state

    req, b, c, failover, e0_state = run([e0, e1], body)
    assert b.value == FakeEngine.reply_for("A: hi\nB:")  # generated on e0 before it died
    assert c.value == FakeEngine.reply_for("A: hi\nB:" + b.value + "\nC:") + TAIL  # same text as without failure
    assert req.engine == "e1" and req.status is RequestStatus.FINISHED
    assert len(e1.calls_of("generate")) == 1  # only c: b was filled back, not generated again
    assert e0_state is EngineState.DEAD and failover == {"rescheduled": 1, "engine_deaths": 1}
    assert e1.contexts == {}  # freed on the survivor


def test_engine_declared_dead_by_heartbeat_timeout_cancels_the_hanging_call_and_reschedules():
    clock = FakeClock()
    e0, e1 = FakeEngine("e0"), FakeEngine("e1")
    e0.gate = asyncio.Event()  # e0 hangs in generate (a stuck process): no error ever comes back

    async def body(mgr):
        s = mgr.create_session()
        a = mgr.create_variable(s, "a", "x")
        req = submit_two_outputs(mgr, s, a.var_id)
        while e0.generating == 0:
            await asyncio.sleep(0.01)
        clock.t += 30
        await mgr.registry.probe(mgr.registry.entry("e1"))  # e1 answers its heartbeat, e0 is silent
        assert mgr.registry.check_timeouts(10) == ["e0"]
        c = await mgr.get_variable(s, req.outputs[1], timeout_s=5)
        while req.status is not RequestStatus.FINISHED:
            await asyncio.sleep(0.01)
        assert e0.calls_of("free") == []  # no call into a dead engine (it could hang as well)
        assert e0.generating == 0 and len(e0.contexts) == 1  # the stuck call was cancelled, its context left
        await mgr.registry.probe(mgr.registry.entry("e0"))  # the same process answers again: alive
        while e0.contexts:
            await asyncio.sleep(0.01)
        return req, c

    req, c = run([e0, e1], body, registry_clock=clock)
    assert c.value and req.engine == "e1" and req.status is RequestStatus.FINISHED
    assert len(e0.calls_of("free")) == 1  # the context left behind was freed once it came back


def test_no_engine_left_fails_every_dependent_get_with_a_typed_error():
    e0 = FlakyEngine("e0")
    e0.down = True  # unreachable from the first call on

    async def body(mgr):
        s = mgr.create_session()
        a = mgr.create_variable(s, "a", "x")
        first = submit_two_outputs(mgr, s, a.var_id)
        second = mgr.submit(s, SubmitSpec("{{input:b}} -> {{output:d}}", [
            PlaceholderSpec("b", False, first.outputs[0]), PlaceholderSpec("d", True)]))
        errors = []
        for var in (*first.outputs, *second.outputs):
            with pytest.raises(StepFailed) as e:
                await mgr.get_variable(s, var, timeout_s=5)
            errors.append(e.value.cause_code)
        return errors

    assert run([e0], body) == ["engine_unavailable"] * 3


def test_reschedule_gives_up_after_max_attempts():
    engines = [FlakyEngine(f"e{i}", die_on_generate=1) for i in range(3)]

    async def body(mgr):
        s = mgr.create_session()
        a = mgr.create_variable(s, "a", "x")
        req = submit_two_outputs(mgr, s, a.var_id)
        with pytest.raises(StepFailed) as e:
            await mgr.get_variable(s, req.outputs[0], timeout_s=5)
        return e.value, mgr.stats()["failover"]

    err, failover = run(engines, body, max_attempts=2)
    assert err.cause_code == "engine_unavailable" and failover["rescheduled"] == 1
    assert sum(e.generates for e in engines) == 2  # two runs in all, on two engines


def test_failover_loop_restarts_on_loss_and_gives_up_when_not_restartable():
    from parrot.manager.dispatcher import DispatchRequest
    from parrot.manager.failover import Failover

    async def body(mgr):
        failover = Failover(mgr.dispatcher, max_attempts=3)
        seen, losses = [], []

        async def work(lease, attempt):
            seen.append((lease.engine, attempt))
            if attempt == 1:
                raise EngineUnavailable(f"{lease.engine} refused the connection")
            return f"done on {lease.engine}"

        def on_lost(loss):  # runs once the dispatcher was told: the engine is dead already
            state = mgr.registry.entry(loss.lease.engine).state
            losses.append((loss.lease.engine, loss.attempt, loss.restarting, state))

        result = await failover.run(DispatchRequest("r1"), work, what="r1", on_lost=on_lost)
        restarts = failover.num_restarts
        with pytest.raises(EngineUnavailable):  # not restartable: re-raised after the first loss
            await failover.run(DispatchRequest("r2"), work, what="r2", restartable=lambda: False, on_lost=on_lost)
        return result, restarts, failover.num_restarts, seen, losses

    engines = [FakeEngine("e0"), FakeEngine("e1"), FakeEngine("e2")]
    result, restarts, restarts_after, seen, losses = run(engines, body)
    (first, _), (second, _), (third, _) = seen
    assert [n for _, n in seen] == [1, 2, 1] and first not in (second, third)  # never back on the dead one
    assert result == f"done on {second}" and restarts == restarts_after == 1
    assert losses == [(first, 1, True, EngineState.DEAD), (third, 1, False, EngineState.DEAD)]
    with pytest.raises(ValueError, match="max_attempts"):
        Failover(None, max_attempts=0)  # type: ignore[arg-type]


# ---- real engine processes -------------------------------------------------------------------------------------
def _live(url: str) -> set[str]:
    engines = httpx.get(f"{url}/api/v1/engines", timeout=5).json()["engines"]
    return {e["name"] for e in engines if e["healthy"]}


def test_killed_engine_process_requests_rerun_on_the_survivor(tmp_path, default_model_path):
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.engine.server.procs import EngineProcess, start_engines, stop_all
    from parrot.frontend.client import connect
    from parrot.frontend.function import Output, SemanticFunction
    from parrot.frontend.local import LocalServer

    settings = ServerSettings(policy="fifo-latency", engine_heartbeat_s=0.5, heartbeat_timeout_s=5,
                              engine_secret=SECRET)
    server = LocalServer(create_app(settings, []))
    # before any engine registered: 503 not_ready with Retry-After (after a short wait), never an empty model list
    # that looks final, nor a 404 for a model that may well come
    models = httpx.get(server.url + "/v1/models", timeout=30)
    assert models.status_code == 503 and models.json()["error"]["code"] == "not_ready", models.text
    assert int(models.headers["retry-after"]) >= 1
    early = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
    assert early.status_code == 503 and early.json()["error"]["code"] == "not_ready", early.text
    log = open(tmp_path / "engines.log", "w")
    procs = start_engines(2, server.url, secret=SECRET, engine_args=TINY_ENGINE, prefix="fo", heartbeat_s=0.3,
                          output=log)
    session = None
    try:
        wait_until(lambda: _live(server.url) == {"fo-0", "fo-1"}, 180, "two engines to register")
        assert len(httpx.get(server.url + "/v1/models", timeout=30).json()["data"]) == 1
        session = connect(server.url, make_default=False)
        long = Output(max_tokens=850, ignore_eos=True, temperature=0.0, stop=[])
        short = Output(max_tokens=30, ignore_eos=True, temperature=0.0, stop=[])
        summarize = SemanticFunction("Summarize part {{input:n}}: {{output:s}}", name="map", defaults=long)
        combine = SemanticFunction("Combine {{input:a}} | {{input:b}} | {{input:c}} | {{input:d}} => {{output:s}}",
                                   name="reduce", defaults=short)
        polish = SemanticFunction("Polish: {{input:x}} -> {{output:s}}", name="polish", defaults=short)

        def generating(dag: dict, engine: str, within_s: float | None = None) -> set[str]:
            # "running" also covers a request whose outputs are all materialized and which is only freeing its
            # context: losing the engine then leaves nothing to rerun, so only pending outputs count. With
            # ``within_s``, only steps dispatched that recently (a map decodes 850 tokens, ~0.9 s on the tiny
            # model; four of them must fit the reduce's 4,096-token window), so the kill most likely lands before
            # their last token (the DAG's clock is this process's time.time)
            ready = {v["var_id"] for v in dag["variables"] if v["status"] == "ready"}
            return {r["request_id"] for r in dag["requests"] if r["status"] == "running" and r["engine"] == engine
                    and not set(r["outputs"]) <= ready
                    and (within_s is None or r["timestamps"]["dispatched"] > time.time() - within_s)}

        def generating_on_each_engine(dag: dict):
            doomed = generating(dag, "fo-0", within_s=0.5)
            return doomed if doomed and generating(dag, "fo-1") else None

        # A round of four maps lasts ~1 s, and a poll of the DAG can take longer than the 0.5 s window on two busy
        # cores: a round whose maps all got past the window without being seen can never satisfy the condition,
        # so it runs to the end and a fresh round (new prompts) is submitted, at most five times.
        generating_before = None
        for attempt in range(5):
            maps = [summarize(f"{attempt}.{i}", session=session) for i in range(4)]
            final = polish(combine(*maps, session=session), session=session)
            deadline = time.monotonic() + 60
            while generating_before is None and time.monotonic() < deadline:
                dag = session.dag()
                generating_before = generating_on_each_engine(dag)
                if generating_before is None and not any(r["status"] in ("waiting", "ready", "running")
                                                         and r["name"] == "map" for r in dag["requests"]):
                    break  # this round's maps are over: the window was missed
                time.sleep(0.02)
            if generating_before is not None:
                break
            assert final.get(timeout=120)  # let the missed round finish before the next one
        assert generating_before, "never saw map steps generating on both engines (5 rounds)"
        victim = next(p for p in procs if p.name == "fo-0")
        victim.kill()  # SIGKILL: no goodbye, in-flight HTTP calls break
        # a step may still have finished between that snapshot and the kill; nothing can finish on fo-0 after it,
        # so the steps the kill interrupted are those still pending now
        after = session.dag()
        ready_after = {v["var_id"] for v in after["variables"] if v["status"] == "ready"}
        doomed = {r["request_id"] for r in after["requests"]
                  if r["request_id"] in generating_before and not set(r["outputs"]) <= ready_after}
        values = [m.get(timeout=120) for m in maps] + [final.get(timeout=120)]
        assert all(isinstance(v, str) and v for v in values)
        # a request whose last output is materialized may still be freeing its context: wait for the status
        dag = wait_until(lambda: (d := {r["request_id"]: r for r in session.dag()["requests"]}) and
                    all(r["status"] == "finished" for r in d.values()) and d, 30, "every request to finish")
        assert {dag[r]["engine"] for r in doomed} == {"fo-1"}  # the killed engine's requests ran on the other
        stats = httpx.get(f"{server.url}/api/v1/stats", timeout=5).json()["failover"]
        assert stats["rescheduled"] >= len(doomed) >= 1 and stats["engine_deaths"] >= 1

        # no engine left: a new request fails with a typed error at its get (never hangs)
        survivor = next(p for p in procs if p.name == "fo-1")
        survivor.kill()
        orphan = polish("anything", session=session)
        with pytest.raises(StepFailed) as e:
            orphan.get(timeout=60)
        assert e.value.cause_code == "engine_unavailable"

        # an engine that comes back registers again (dead -> alive) and serves
        procs.append(EngineProcess("fo-0", server.url, secret=SECRET, engine_args=TINY_ENGINE, heartbeat_s=0.3,
                                   output=log))
        wait_until(lambda: "fo-0" in _live(server.url), 180, "the restarted engine to register")
        assert polish("again", session=session).get(timeout=60)
    finally:
        if session is not None:
            session.close()
        stop_all(procs)
        server.stop()
        log.close()


def test_parrot_serve_starts_engine_children_that_die_with_it(default_model_path):
    import os
    import re
    import signal
    import subprocess
    import sys

    from parrot.engine.server.procs import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "parrot.cli", "--log-level", "WARNING", "serve", "--engines", "2", "--port",
           str(port), "--policy", "fifo-throughput", *TINY_ENGINE]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children: list[int] = []
    try:
        line = proc.stdout.readline()  # "parrot: serving on ... engine-0=http://... (pid N), ..."
        children = [int(p) for p in re.findall(r"\(pid (\d+)\)", line)]
        assert len(children) == 2, line
        url = f"http://127.0.0.1:{port}"
        ready = proc.stdout.readline()  # printed once the first engine child registered and answered
        assert re.match(r"parrot: ready: engine-[01] serves \S+ at http://\S+/v1$", ready.strip()), ready
        assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"], "ready, yet no model listed"

        def up():
            try:
                return _live(url) == {"engine-0", "engine-1"}
            except httpx.HTTPError:
                return False

        wait_until(up, 180, "both engine children to register")
        policy = httpx.get(f"{url}/api/v1/stats", timeout=5).json()["scheduler"]["policy"]
        assert policy == "fifo-throughput"
    finally:
        proc.kill()  # SIGKILL: no cleanup code runs in the server; the kernel tells the children
        proc.wait(10)

    def gone(pid: int) -> bool:
        """Exited (a zombie nobody reaped yet counts: it no longer runs)."""
        try:
            with open(f"/proc/{pid}/status") as f:
                return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
        except FileNotFoundError:
            return True

    try:
        wait_until(lambda: all(gone(p) for p in children), 30, "engine children to exit")
    finally:
        for pid in children:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
