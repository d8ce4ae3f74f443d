"""Failover of OpenAI-compatible completions: a prompt whose engine dies restarts on another engine (non-streamed,
or streamed before any token was sent); a stream that already sent tokens ends with a clear error event.
First on fake engines (fast, exact), then one run with real `parrot engine` processes killed by SIGKILL."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from parrot.common.errors import EngineUnavailable
from parrot.manager import EngineRegistry, EngineState, Manager, ManagerConfig
from parrot.manager.completion_types import ChoiceDelta, ChoiceSpec, CompletionSpec
from parrot.manager.completions import CompletionService
from engine_procs import SECRET, TINY_ENGINE, wait_until
from fakes import TAIL, FakeEngine, UnreachableEngine


class DyingEngine(UnreachableEngine):
    """Becomes unreachable after streaming ``die_after_tokens`` tokens of a generation (0: at the start of its
    first generation)."""

    def __init__(self, name: str, *, die_after_tokens: int | None = None) -> None:
        super().__init__(name, max_model_len=1024)
        self.die_after_tokens = die_after_tokens

    async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
        n = 0
        async for chunk in super().generate_stream(sampling, context_id, parent_context_id, hint=hint):
            if self.die_after_tokens is not None and n >= self.die_after_tokens:
                self.down = True
                self._check()
            n += len(chunk.token_ids)
            yield chunk


def run(engines, body, *, registry_clock=None):
    """``body(manager, service)`` with a least-loaded manager (e0 is picked first: fewest requests, then name)."""
    async def main():
        registry = EngineRegistry(engines, clock=registry_clock) if registry_clock else EngineRegistry(engines)
        mgr = Manager(registry, config=ManagerConfig(engine_heartbeat_s=0))
        await mgr.start()
        try:
            return await asyncio.wait_for(body(mgr, CompletionService(mgr.dispatcher)), 20)
        finally:
            await mgr.stop()

    return asyncio.run(main())


PROMPT = "Tell me about parrots."
ANSWER = (FakeEngine.reply_for(PROMPT) + TAIL)[:30]  # what any healthy engine generates in 30 tokens


def request(n: int = 1) -> CompletionSpec:
    return CompletionSpec("fake-model", [PROMPT], ChoiceSpec(n=n, max_tokens=30,
                                                            sampling={"temperature": 0.0, "ignore_eos": True}))


def test_non_streamed_completion_restarts_on_another_engine_when_its_engine_dies():
    e0, e1 = DyingEngine("e0", die_after_tokens=5), FakeEngine("e1", max_model_len=1024)

    async def body(mgr, service):
        body = await service.complete(await service.plan_completion(request(n=2)))
        return body, mgr.registry.entry("e0").state, service.num_restarted, len(service.orphans)

    body, e0_state, restarted, orphans = run([e0, e1], body)
    assert [c.text for c in body.choices] == [ANSWER, ANSWER]  # both choices rerun whole on e1
    assert body.usage.completion_tokens == 60
    assert e0_state is EngineState.DEAD and restarted == 1
    assert e1.contexts == {}  # freed on the survivor
    assert orphans == 3  # base + 2 forks left on the dead engine: freed if that process comes back


def test_stream_restarts_while_nothing_was_sent_and_fails_clearly_after():
    async def collect(service, plan):
        text, error = "", None
        try:
            async for event in service.stream(plan):
                if isinstance(event, ChoiceDelta):
                    text += event.text
        except EngineUnavailable as e:
            error = e
        return text, error

    e0, e1 = DyingEngine("e0", die_after_tokens=0), FakeEngine("e1", max_model_len=1024)

    async def before_first_token(mgr, service):
        return await collect(service, await service.plan_completion(request())), service.num_restarted

    (text, error), restarted = run([e0, e1], before_first_token)
    assert (text, error, restarted) == (ANSWER, None, 1)  # transparent: the client never saw e0

    e0, e1 = DyingEngine("e0", die_after_tokens=4), FakeEngine("e1", max_model_len=1024)

    async def after_tokens(mgr, service):
        return await collect(service, await service.plan_completion(request())), service.num_restarted

    (text, error), restarted = run([e0, e1], after_tokens)
    assert text == ANSWER[:4] and restarted == 0 and e1.calls == []  # not resumed elsewhere: it would repeat
    assert isinstance(error, EngineUnavailable) and "after 4 token(s) were sent" in error.message
    assert "send the request again" in error.message


def test_a_hanging_engine_declared_dead_by_heartbeat_loses_the_prompt_to_another_engine():
    class Clock:
        t = 1000.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    e0, e1 = FakeEngine("e0", max_model_len=1024), FakeEngine("e1", max_model_len=1024)
    e0.gate = asyncio.Event()  # e0 hangs in generate: no error ever comes back

    async def body(mgr, service):
        task = asyncio.ensure_future(service.complete(await service.plan_completion(request())))
        while e0.generating == 0:
            await asyncio.sleep(0.01)
        clock.t += 30
        await mgr.registry.probe(mgr.registry.entry("e1"))  # e1 answers its heartbeat, e0 is silent
        assert mgr.registry.check_timeouts(10) == ["e0"]
        return await task, service.num_restarted

    body, restarted = run([e0, e1], body, registry_clock=clock)
    assert body.choices[0].text == ANSWER and restarted == 1
    assert e0.generating == 0 and e0.calls_of("free") == []  # the hanging call was cancelled; no call into e0


def test_no_engine_left_is_a_typed_503():
    e0 = DyingEngine("e0", die_after_tokens=2)

    async def body(mgr, service):
        with pytest.raises(EngineUnavailable) as e:
            await service.complete(await service.plan_completion(request()))
        return e.value

    assert run([e0], body).status_code == 503


def test_stream_error_event_over_http():
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.frontend.local import LocalServer

    e0, e1 = DyingEngine("e0", die_after_tokens=3), FakeEngine("e1", max_model_len=1024)
    server = LocalServer(create_app(ServerSettings(engine_heartbeat_s=0), [e0, e1]))
    try:
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30, json={
                "model": "fake-model", "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "after 3 token(s) were sent" in error["message"]
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == ANSWER[:3]
        # the next (non-streamed) request goes to the survivor
        r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
            "model": "fake-model", "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ANSWER
    finally:
        server.stop()


# ---- real engine processes -------------------------------------------------------------------------------------

def test_killed_engine_process_completion_reruns_on_the_survivor(tmp_path, default_model_path):
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.engine.server.procs import start_engines, stop_all
    from parrot.frontend.local import LocalServer

    app = create_app(ServerSettings(engine_heartbeat_s=0.5, heartbeat_timeout_s=5, engine_secret=SECRET), [])
    server = LocalServer(app)
    log = open(tmp_path / "engines.log", "w")
    procs = start_engines(2, server.url, secret=SECRET, engine_args=TINY_ENGINE, prefix="oa", heartbeat_s=0.3,
                          output=log)
    try:
        def live() -> set[str]:
            engines = httpx.get(f"{server.url}/api/v1/engines", timeout=5).json()["engines"]
            return {e["name"] for e in engines if e["healthy"]}

        wait_until(lambda: live() == {"oa-0", "oa-1"}, 180, "two engines to register")
        model = httpx.get(f"{server.url}/v1/models", timeout=5).json()["data"][0]["id"]
        result: dict = {}

        def complete() -> None:
            r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": model, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
                "ignore_eos": True})
            result["status"], result["body"] = r.status_code, r.json()

        client = threading.Thread(target=complete)
        client.start()

        def serving() -> str | None:
            engines = httpx.get(f"{server.url}/api/v1/stats", timeout=5).json()["scheduler"]["engines"]
            return next((name for name, e in engines.items() if e["requests"]), None)

        victim = wait_until(serving, 60, "the completion to be placed")
        next(p for p in procs if p.name == victim).kill()  # SIGKILL mid-generation
        client.join(120)
        assert not client.is_alive()
        assert result["status"] == 200, result["body"]
        assert result["body"]["usage"]["completion_tokens"] == 300
        assert victim not in live() and app.state.completions.num_restarted == 1  # it ran again, elsewhere
    finally:
        stop_all(procs)
        server.stop()
        log.close()
