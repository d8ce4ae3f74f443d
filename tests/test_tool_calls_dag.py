"""Tool calls in the Parrot DAG (LAMPS, issue 17): a variable declared as a tool's output makes the generate that
feeds it carry a ToolHint and pause its context instead of freeing it; the tool's duration is learned when the
client sets the value; the follow-up prompt continues the paused context token for token (generated ids reused),
so the engine serves it from cache (fake engine, then the builtin engine with the tiny random model); the
frontend's ``@P.native_function(tool=...)`` and the HTTP ``tool`` object with its typed 400s."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient

from parrot.api import ServerSettings, create_app
from parrot.common.errors import InvalidRequestError, UnknownContext, UnknownVariable
from parrot.protocol.interface import PauseResult, ToolHint
from parrot.frontend.native import NativeFunction
from parrot.manager import EngineRegistry, Manager, ManagerConfig
from parrot.manager.graph import ToolDecl
from parrot.manager.submit import SubmitSpec
from fakes import FakeEngine
from test_manager_prefix import inp, out

S1 = "You are a research assistant. Question: {{input:q}}\nSearch query:{{output:query}}"
S2 = ("You are a research assistant. Question: {{input:q}}\nSearch query:{{input:query}}\nFound: {{input:found}}"
      "\nAnswer:{{output:answer}}")


class PausingEngine(FakeEngine):
    """A FakeEngine that records the hints of its generates and pauses contexts (keeping their tokens cached);
    a paused context can still be freed (``freed_paused``)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.hints: list = []
        self.pauses: list[tuple[str, ToolHint, list[int]]] = []
        self.paused: set[str] = set()
        self.freed_paused: list[str] = []

    async def free_context(self, context_id: str) -> None:
        if context_id in self.paused:
            self.paused.discard(context_id)
            self.freed_paused.append(context_id)
            return
        await super().free_context(context_id)

    async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
        self.hints.append((context_id, hint))
        async for chunk in super().generate_stream(sampling, context_id, parent_context_id, hint=hint):
            yield chunk

    async def pause_context(self, context_id: str, tool: ToolHint) -> PauseResult | None:
        self.calls.append(("pause", context_id, None, tool))
        if context_id not in self.contexts:
            raise UnknownContext(f"unknown context {context_id!r}")
        tokens = self.contexts.pop(context_id)
        self._remember(tokens)
        self.paused.add(context_id)
        self.pauses.append((context_id, tool, list(tokens)))
        return PauseResult(context_id, "preserve", len(tokens), len(tokens) // 16)


class MultiEngines(tuple):
    """Several engines for :func:`run`."""

    def __new__(cls, *engines):
        return super().__new__(cls, engines)


def run(body, engine=None, *, now=None, **config):
    engine = engine or PausingEngine()
    engines = list(engine) if isinstance(engine, MultiEngines) else [engine]

    async def main():
        kw = {"clock": lambda: now[0]} if now is not None else {}
        mgr = Manager(EngineRegistry(engines), config=ManagerConfig(engine_heartbeat_s=0, **config), **kw)
        await mgr.start()
        try:
            return await asyncio.wait_for(body(mgr, engine), 30)
        finally:
            await mgr.stop()

    return asyncio.run(main())


def record_pauses(client) -> list[PauseResult | None]:
    """Wrap ``client.pause_context`` so every pause's result is appended to the returned list."""
    paused: list[PauseResult | None] = []
    pause = client.pause_context

    async def recording_pause(context_id, tool):
        result = await pause(context_id, tool)
        paused.append(result)
        return result

    client.pause_context = recording_pause
    return paused


def test_generate_feeding_a_tool_carries_its_hint_pauses_and_the_tool_duration_is_learned():
    now = [100.0]

    async def body(mgr, eng):
        s = mgr.create_session()
        q = mgr.create_variable(s, "q", "who built the first lighthouse?")
        r1 = mgr.submit(s, SubmitSpec(S1, [inp("q", q.var_id), out("query", max_tokens=30, stop=["\n"])]))
        query = r1.outputs[0]
        found = mgr.create_variable(s, "found", tool=ToolDecl("search", (query,), 0.5))
        assert (await mgr.get_variable(s, query, timeout_s=5)).value
        for _ in range(20):  # the pause runs in the request's cleanup, right after the value
            if eng.pauses:
                break
            await asyncio.sleep(0.01)
        now[0] += 1.25  # the tool ran 1.25 s
        mgr.set_variable(s, found.var_id, "Sostratus of Cnidus built the Pharos.")
        r2 = mgr.submit(s, SubmitSpec(S2, [inp("q", q.var_id), inp("query", query), inp("found", found.var_id),
                                           out("answer", max_tokens=30)]))
        await mgr.get_variable(s, r2.outputs[0], timeout_s=5)
        await asyncio.sleep(0.05)
        return s, r1, r2, found, mgr.stats(), mgr.dag(s)

    eng = PausingEngine()
    s, r1, r2, found, stats, dag = run(body, eng, now=now)
    # S1's generate carried the tool (client hint: no observation yet) and a predicted length; S2's did not
    (ctx1, hint1), (ctx2, hint2) = eng.hints
    assert ctx1 == r1.context_id and hint1.tool == ToolHint("search", 0.5)
    assert hint1.predicted_output_tokens is not None and 1 <= hint1.predicted_output_tokens <= 30
    assert hint2.tool is None and hint2.predicted_output_tokens is not None
    # S1's context was paused (not freed) and the manager let go of it; S2's was freed
    assert [p[0] for p in eng.pauses] == [r1.context_id] and eng.pauses[0][1] == ToolHint("search", 0.5)
    assert r1.context_id not in eng.freed and r2.context_id in eng.freed
    assert not s.contexts
    assert eng.freed_paused == [r1.context_id]  # S2's prompt took its KV: the pause is over
    # S2's prompt continues S1's context token for token: every whole block of it was served from cache
    paused_tokens = eng.pauses[0][2]
    assert r2.num_cached_tokens >= len(paused_tokens) // 16 * 16 > 0
    fill2 = next(c for c in eng.calls_of("fill") if c[1] == r2.context_id)[3]
    assert fill2[:len(paused_tokens)] == paused_tokens
    # the generated query was filled as its generated ids, not tokenized again
    assert s.graph.variables[r1.outputs[0]].value not in eng.tokenized
    # the observed duration replaces the client's hint; stats and the DAG show it
    assert stats["tools"]["tool_durations"]["search"] == {"count": 1, "mean_s": 1.25, "std_s": 0.0}
    assert stats["tools"]["pauses_requested"] == {"preserve": 1}
    assert stats["tools"]["output_length"]["observations"] == 2
    assert f"= tool search <- %{s.graph.variables[r1.outputs[0]].number}" in dag.text
    assert next(v for v in dag.variables if v["var_id"] == found.var_id)["tool"] == {
        "name": "search", "inputs": [r1.outputs[0]], "expected_duration_s": 0.5}


def test_learned_duration_is_the_next_hint_and_requests_without_tools_are_freed():
    now = [0.0]

    async def body(mgr, eng):
        s = mgr.create_session()
        for i, took in enumerate((2.0, 4.0)):
            q = mgr.create_variable(s, "q", f"question {i}")
            r = mgr.submit(s, SubmitSpec(S1, [inp("q", q.var_id), out("query", max_tokens=20)]))
            t = mgr.create_variable(s, "found", tool=ToolDecl("search", (r.outputs[0],), 9.0))
            await mgr.get_variable(s, r.outputs[0], timeout_s=5)
            now[0] += took
            mgr.set_variable(s, t.var_id, "result")
        plain = mgr.create_variable(s, "q", "no tool here")
        r3 = mgr.submit(s, SubmitSpec(S1, [inp("q", plain.var_id), out("query", max_tokens=20)]))
        await mgr.get_variable(s, r3.outputs[0], timeout_s=5)
        await asyncio.sleep(0.05)
        return r3, mgr.predictors.tool_durations.get("search")

    eng = PausingEngine()
    r3, stats = run(body, eng, now=now)
    hints = [h for _, h in eng.hints]
    assert hints[0].tool == ToolHint("search", 9.0)  # the client's guess before any observation
    assert hints[1].tool == ToolHint("search", 2.0)  # then the mean of what was observed
    assert hints[2].tool is None and r3.context_id in eng.freed
    assert len(eng.pauses) == 2 and stats.count == 2 and stats.mean_s == 3.0


def test_follow_up_is_placed_on_the_engine_holding_the_paused_context():
    """Two engines: the follow-up goes where its paused prefix is, although the other engine is less loaded; the
    affinity ends when the follow-up has filled its prompt."""
    e0, e1 = PausingEngine("e0"), PausingEngine("e1")

    async def body(mgr, _):
        s = mgr.create_session()
        q = mgr.create_variable(s, "q", "who built the first lighthouse?")
        r1 = mgr.submit(s, SubmitSpec(S1, [inp("q", q.var_id), out("query", max_tokens=20)]))
        found = mgr.create_variable(s, "found", tool=ToolDecl("search", (r1.outputs[0],), 2.0))
        await mgr.get_variable(s, r1.outputs[0], timeout_s=5)
        for _ in range(20):
            if e0.pauses or e1.pauses:
                break
            await asyncio.sleep(0.01)
        held_on = r1.engine
        busy = e0 if held_on == "e0" else e1
        busy.gate = asyncio.Event()  # a request in flight there: least-loaded alone would pick the other engine
        other = mgr.create_variable(s, "o", "unrelated")
        rx = mgr.submit(s, SubmitSpec("Something else entirely: {{input:o}} ->{{output:x}}",
                                      [inp("o", other.var_id), out("x", max_tokens=5)]))
        for _ in range(50):
            if busy.generating:
                break
            await asyncio.sleep(0.01)
        hashes = tuple(mgr.executor._known_boundaries(s, r1))
        affinity = {e: mgr.executor.tools.prefix_tokens(e, hashes) for e in ("e0", "e1")}
        mgr.set_variable(s, found.var_id, "Sostratus.")
        r2 = mgr.submit(s, SubmitSpec(S2, [inp("q", q.var_id), inp("query", r1.outputs[0]),
                                           inp("found", found.var_id), out("answer", max_tokens=10)]))
        for _ in range(100):
            if r2.engine is not None and busy.freed_paused:
                break
            await asyncio.sleep(0.01)
        after = mgr.executor.tools.prefix_tokens(held_on, hashes)
        busy.gate.set()
        await mgr.get_variable(s, r2.outputs[0], timeout_s=5)
        return held_on, rx.engine, r2, affinity, after

    held_on, busy_engine, r2, affinity, after = run(body, MultiEngines(e0, e1))
    assert busy_engine == held_on and r2.engine == held_on
    assert affinity[held_on] > 0 and affinity["e1" if held_on == "e0" else "e0"] == 0
    assert after == 0 and r2.num_cached_tokens > 0


def test_engine_without_tool_handling_frees_the_context():
    async def body(mgr, eng):
        s = mgr.create_session()
        q = mgr.create_variable(s, "q", "x")
        r = mgr.submit(s, SubmitSpec(S1, [inp("q", q.var_id), out("query", max_tokens=10)]))
        mgr.create_variable(s, "found", tool=ToolDecl("search", (r.outputs[0],)))
        await mgr.get_variable(s, r.outputs[0], timeout_s=5)
        await asyncio.sleep(0.05)
        return r, mgr.stats()

    eng = FakeEngine()  # EngineClient.pause_context's default: free
    r, stats = run(body, eng)
    assert r.context_id in eng.freed
    assert stats["tools"]["pauses_requested"] == {"free": 1}


def test_tool_declarations_are_validated():
    async def body(mgr, eng):
        s = mgr.create_session()
        v = mgr.create_variable(s, "x", "1")
        errors = []
        for kw in (dict(tool=ToolDecl("bad name", (v.var_id,))), dict(tool=ToolDecl("t", ("v_99",))),
                   dict(tool=ToolDecl("t", (v.var_id,), -1.0)), dict(tool=ToolDecl("t", (v.var_id,)), value="set")):
            with pytest.raises((InvalidRequestError, UnknownVariable)) as e:
                mgr.create_variable(s, "y", **kw)
            errors.append(e.value.param)
        return errors, len(s.graph.variables)

    errors, n = run(body)
    assert errors == ["tool.name", "tool.inputs", "tool.expected_duration_s", "value"]
    assert n == 1  # nothing was created


def test_http_tool_object_and_typed_400s():
    with TestClient(create_app(ServerSettings(engine_heartbeat_s=0), [PausingEngine()])) as c:
        sid = c.post("/api/v1/sessions").json()
        h = {"X-Parrot-Session-Token": sid["token"]}
        base = f"/api/v1/sessions/{sid['session_id']}"
        x = c.post(f"{base}/variables", json={"name": "x", "value": "1"}, headers=h).json()["var_id"]
        r = c.post(f"{base}/variables", json={"name": "y", "tool": {"name": "search", "inputs": [x],
                                                                   "expected_duration_s": 0.3}}, headers=h)
        assert r.status_code == 200 and r.json()["status"] == "pending"
        dag = c.get(f"{base}/dag", headers=h).json()
        assert dag["variables"][1]["tool"] == {"name": "search", "inputs": [x], "expected_duration_s": 0.3}
        for tool, param in (({"name": "no spaces"}, "tool.name"), ({"name": "t", "inputs": ["v_9"]}, "tool.inputs"),
                            ({"name": "t", "expected_duration_s": 0}, "tool.expected_duration_s"),
                            ({"name": "t", "extra": 1}, "tool.extra")):
            r = c.post(f"{base}/variables", json={"tool": tool}, headers=h)
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.json()
        stats = c.get("/api/v1/stats").json()["tools"]
        assert set(stats) == {"output_length", "tool_durations", "pauses_requested", "engine_pauses"}


def test_native_function_tool_arguments_are_checked():
    def f(x: str) -> str:
        return x

    assert NativeFunction(f, tool="search", expected_duration_s=2).expected_duration_s == 2.0
    for kw in (dict(tool="has space"), dict(tool="t", expected_duration_s=0), dict(expected_duration_s=1.0),
               dict(tool="t", expected_duration_s=float("inf"))):
        with pytest.raises(ValueError):
            NativeFunction(f, **kw)


def test_tiny_engine_follow_up_reuses_the_paused_context_kv():
    """The builtin engine (tiny random model): S1's context is paused by the engine and S2's fill is served from
    its KV, every whole block of it, because S1's generated ids are reused rather than its text retokenized."""
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.settings import EngineSettings

    client = build_local_engine_client(EngineSettings(random_model="tiny", dtype="float32", kv_cache_tokens=2048,
                                                      block_size=4))
    paused = record_pauses(client)

    async def body(mgr, eng):
        s = mgr.create_session()
        q = mgr.create_variable(s, "q", "who built the first lighthouse and when was it lit?")
        r1 = mgr.submit(s, SubmitSpec(S1, [inp("q", q.var_id), out("query", max_tokens=40, ignore_eos=True)]))
        found = mgr.create_variable(s, "found", tool=ToolDecl("search", (r1.outputs[0],), 0.2))
        await mgr.get_variable(s, r1.outputs[0], timeout_s=20)
        for _ in range(100):
            if paused:
                break
            await asyncio.sleep(0.01)
        mgr.set_variable(s, found.var_id, "Sostratus of Cnidus built the Pharos of Alexandria.")
        r2 = mgr.submit(s, SubmitSpec(S2, [inp("q", q.var_id), inp("query", r1.outputs[0]),
                                           inp("found", found.var_id), out("answer", max_tokens=4)]))
        await mgr.get_variable(s, r2.outputs[0], timeout_s=20)
        gen = s.graph.variables[r1.outputs[0]].generated
        return r2, gen, await eng.tokenize(gen.text), (await eng.status()).extra.get("tool_pauses")

    try:
        r2, gen, retokenized, engine_pauses = run(body, client)
    finally:
        asyncio.run(client.close())
    assert len(gen.token_ids) == 40 and len(paused) == 1 and paused[0] is not None
    n1 = paused[0].num_tokens  # S1's context: its prompt + the 40 generated tokens
    # whole blocks of S1's context whose KV was computed (the last generated token has none yet)
    assert r2.num_cached_tokens >= (n1 - 1) // 4 * 4 >= 60
    assert sum(engine_pauses["by_handling"].values()) == 1 and engine_pauses["resumed"] == 1
    # what retokenizing the text would have matched: only up to the first differing token
    common = next((i for i, (a, b) in enumerate(zip(retokenized, gen.token_ids)) if a != b),
                  min(len(retokenized), len(gen.token_ids)))
    if common < len(gen.token_ids):
        assert r2.num_cached_tokens > (n1 - len(gen.token_ids) + common) // 4 * 4


def test_serve_engine_policy_flag_reaches_the_engine_settings_and_engine_processes(monkeypatch):
    from parrot.cli import _engine_flags, _settings_from, build_parser
    from parrot.engine.settings import EngineSettings

    skip = {"name", "port", "host"}
    ns = build_parser().parse_args(["serve", "--engine-policy", "infercept", "--random-model", "tiny"])
    assert _settings_from(EngineSettings, ns, skip=skip).engine_policy == "infercept"  # the in-server engine
    flags = _engine_flags(ns, skip)  # what `parrot serve --engines N` hands each `parrot engine` child
    assert flags[flags.index("--engine-policy") + 1] == "infercept"
    ns = build_parser().parse_args(["serve"])
    assert _settings_from(EngineSettings, ns, skip=skip).engine_policy == "lamps"
    monkeypatch.setenv("PARROT_ENGINE_ENGINE_POLICY", "discard")  # inherited by engine processes
    assert _settings_from(EngineSettings, ns, skip=skip).engine_policy == "discard"
    with pytest.raises(SystemExit):  # named in the error: "parrot: invalid --engine-policy: ... unknown engine policy"
        _settings_from(EngineSettings, build_parser().parse_args(["serve", "--engine-policy", "lifo"]), skip=skip)


def test_frontend_native_tool_function_end_to_end():
    """``@P.native_function(tool=...)`` on the in-process service (tiny random model): the tool's output is
    declared at the call, the feeding generate pauses, the duration is learned, the follow-up hits the cache."""
    import httpx

    import parrot as P

    @P.semantic_function(max_tokens=12)
    def think(question: P.SemanticVariable):
        """You are a careful assistant with a lookup tool.
        Question: {{input:question}}
        Lookup:{{output:query}}"""

    @P.native_function(tool="lookup", expected_duration_s=0.05)
    def lookup(query: str) -> str:
        time.sleep(0.3)  # still running when its producer's request ends (a tool done by then needs no pause)
        return f"{len(query)} characters"

    @P.semantic_function(max_tokens=4)
    def reply(question: P.SemanticVariable, query: P.SemanticVariable, found: P.SemanticVariable):
        """You are a careful assistant with a lookup tool.
        Question: {{input:question}}
        Lookup:{{input:query}}
        Found: {{input:found}}
        Answer:{{output:answer}}"""

    with P.local(random_model="tiny", dtype="float32", kv_cache_tokens=2048) as s:
        q = P.SemanticVariable()  # set last: the whole loop is declared before the first step runs (the tiny
        query = think(q)           # model may otherwise finish it before the tool call is declared: no pause then)
        found = lookup(query)
        found_id, query_id = found.id, query.id  # created on the server at the call, before its value exists
        final = reply(q, query, found)
        q.set("how tall is the lighthouse of Alexandria?")
        final.get(timeout=60)
        dag = s.dag()
        stats = httpx.get(f"{s.url}/api/v1/stats").json()["tools"]
    tool_var = next(v for v in dag["variables"] if v["tool"])
    assert tool_var["var_id"] == found_id
    assert tool_var["tool"] == {"name": "lookup", "inputs": [query_id], "expected_duration_s": 0.05}
    assert sum(stats["pauses_requested"].values()) == 1
    assert stats["tool_durations"]["lookup"]["count"] == 1 and stats["tool_durations"]["lookup"]["mean_s"] >= 0.3
    follow = next(r for r in dag["requests"] if found_id in r["inputs"])
    assert follow["num_cached_tokens"] >= 16
