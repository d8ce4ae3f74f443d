"""Flows on the fake engine (parrot.manager.flows, docs/flows.md): loops, branches of every condition kind, nesting,
maps, client tool calls, speculation (hit, miss, the missed case's KV freed), errors at submission and at run
time, failover mid-loop, restart mid-loop from the journal, and the HTTP routes."""

from __future__ import annotations

import asyncio

import pytest
from fakes import FakeEngine, UnreachableEngine
from fastapi.testclient import TestClient
from test_manager_executor import run

from parrot.api import ServerSettings, create_app
from parrot.common.errors import (
    InvalidRequestError,
    StepFailed,
    UnknownContext,
    UnknownVariable,
    VariableAlreadySet,
)
from parrot.manager import EngineRegistry, Manager, ManagerConfig
from parrot.manager.graph import RequestStatus, VarStatus
from parrot.protocol.interface import PauseResult


def counter_loop(start: str, *, stop_at: int = 3, max_steps: int = 8, on_max: str = "error",
                 tool_runs: str = "server") -> dict:
    """n <- n + 1 each iteration (a text step builds the expression, the calculator evaluates it), a generate per
    iteration reading the new count; until n >= stop_at."""
    tool = {"name": "calculator", "args": {"expression": "expr"}, "output": "n2"}
    if tool_runs == "client":
        tool = {**tool, "name": "my_calc", "runs": "client"}
    return {"name": "count", "inputs": {"start": start}, "steps": [
        {"loop": {"name": "counting", "carry": {"n": "start"}, "max_steps": max_steps, "on_max": on_max, "steps": [
            {"text": {"template": "{{input:n}} + 1", "output": "expr"}},
            {"tool": tool},
            {"generate": {"prompt": "Count {{input:n2}}:{{output:said}}", "sampling": {"said": {"max_tokens": 12}}}},
        ], "next": {"n": "n2"}, "until": {"kind": "number", "var": "n2", "op": ">=", "value": stop_at},
            "outputs": ["n2", "said"]}}], "outputs": ["n2", "said"]}


def branch_on(var: str, when: dict) -> dict:
    return {"name": "pick", "inputs": {"x": var}, "steps": [
        {"branch": {"cases": [{"when": when, "steps": [{"text": {"template": "yes", "output": "out"}}]}],
                    "default": [{"text": {"template": "no", "output": "out"}}], "outputs": ["out"]}}],
        "outputs": ["out"]}


async def value(mgr, s, vid) -> str:
    view = await mgr.get_variable(s, vid, timeout_s=10)
    assert view.status is VarStatus.READY, view
    return view.value


def test_loop_runs_server_side_until_its_condition():
    async def body(mgr, eng):
        s = mgr.create_session()
        f = mgr.submit_flow(s, counter_loop(mgr.create_variable(s, "start", "0").var_id))
        assert await value(mgr, s, f.outputs["n2"]) == "3"
        assert (await value(mgr, s, f.outputs["said"])).startswith("<Count 3:")
        await asyncio.sleep(0.05)
        st = mgr.flow_status(s, f.flow_id)
        assert st["status"] == "finished"
        assert [e["event"] for e in st["events"]] == ["iteration"] * 3 + ["loop_done", "finished"]
        origins = sorted(r.origin for r in s.graph.requests.values())
        assert origins == [f"f_1/0.loop[{i}]/2.generate" for i in range(3)]  # one request per iteration
        assert mgr.stats()["flows"]["iterations"] == 3
        assert "flow f_1/0.loop[1]/1.tool" in mgr.dag(s).text
        g = mgr.submit_flow(s, branch_on(mgr.create_variable(s, "x").var_id,
                                         {"kind": "equals", "var": "x", "value": "y"}))
        with pytest.raises(VariableAlreadySet, match="flow step"):  # a flow's values are not the client's to set
            mgr.set_variable(s, g.outputs["out"], "7")
    run(body)


@pytest.mark.parametrize("on_max, expect", [("error", None), ("last", "2")])
def test_loop_reaching_max_steps_ends_as_declared(on_max, expect):
    async def body(mgr, eng):
        s = mgr.create_session()
        f = mgr.submit_flow(s, counter_loop(mgr.create_variable(s, "start", "0").var_id, stop_at=5, max_steps=2,
                                            on_max=on_max))
        if expect is None:
            with pytest.raises(StepFailed) as e:
                await mgr.get_variable(s, f.outputs["n2"], timeout_s=10)
            assert e.value.cause_code == "loop_max_steps"
        else:
            assert await value(mgr, s, f.outputs["n2"]) == expect
    run(body)


CONDITIONS = [
    ("Yes ", {"kind": "equals", "var": "x", "value": "yes"}, "yes"),
    ("Yes", {"kind": "equals", "var": "x", "value": "yes", "case_sensitive": True}, "no"),
    ("the Final Answer: 4", {"kind": "contains", "var": "x", "value": "final answer"}, "yes"),
    ("nothing", {"kind": "contains", "var": "x", "value": "final answer"}, "no"),
    ("Final Answer: 4", {"kind": "regex", "var": "x", "pattern": r"^Final Answer: \d+$"}, "yes"),
    ("Final Answer: four", {"kind": "regex", "var": "x", "pattern": r"^Final Answer: \d+$"}, "no"),
    ('{"status": "ok", "n": [1, 2]}', {"kind": "json", "var": "x", "path": "status", "op": "==", "value": "ok"}, "yes"),
    ('{"status": "ok", "n": [1, 2]}', {"kind": "json", "var": "x", "path": "n[1]", "op": ">", "value": 1}, "yes"),
    ("not json", {"kind": "json", "var": "x", "path": "status", "op": "==", "value": "ok"}, "no"),
    ("score: 7.5 of 10", {"kind": "number", "var": "x", "op": ">=", "value": 7}, "yes"),
    ("score: 6 of 10", {"kind": "number", "var": "x", "op": ">=", "value": 7}, "no"),
    ("no digits", {"kind": "number", "var": "x", "op": "<", "value": 7}, "no"),
    ("yes", {"kind": "not", "cond": {"kind": "equals", "var": "x", "value": "yes"}}, "no"),
    ("a b", {"kind": "all", "conds": [{"kind": "contains", "var": "x", "value": "a"},
                                      {"kind": "contains", "var": "x", "value": "b"}]}, "yes"),
    ("a", {"kind": "all", "conds": [{"kind": "contains", "var": "x", "value": "a"},
                                    {"kind": "contains", "var": "x", "value": "b"}]}, "no"),
    ("b", {"kind": "any", "conds": [{"kind": "contains", "var": "x", "value": "a"},
                                    {"kind": "contains", "var": "x", "value": "b"}]}, "yes"),
]


@pytest.mark.parametrize("text, when, expect", CONDITIONS)
def test_branch_on_every_condition_kind(text, when, expect):
    async def body(mgr, eng):
        s = mgr.create_session()
        x = mgr.create_variable(s, "x")  # pending at submission: the branch waits for it
        f = mgr.submit_flow(s, branch_on(x.var_id, when))
        mgr.set_variable(s, x.var_id, text)
        assert await value(mgr, s, f.outputs["out"]) == expect
    run(body)


def test_branch_without_a_matching_case_or_default_fails_its_outputs():
    async def body(mgr, eng):
        s = mgr.create_session()
        spec = branch_on(mgr.create_variable(s, "x", "maybe").var_id, {"kind": "equals", "var": "x", "value": "yes"})
        del spec["steps"][0]["branch"]["default"]
        f = mgr.submit_flow(s, spec)
        with pytest.raises(StepFailed) as e:
            await mgr.get_variable(s, f.outputs["out"], timeout_s=10)
        assert e.value.cause_code == "branch_no_match"
    run(body)


def test_nested_branch_inside_a_loop_and_a_map():
    """Each iteration's branch picks a word by the count; the words are carried in a growing history; a map then
    runs a generate per line of it."""
    async def body(mgr, eng):
        s = mgr.create_session()
        start, hist = mgr.create_variable(s, "start", "0"), mgr.create_variable(s, "h", "")
        f = mgr.submit_flow(s, {"inputs": {"start": start.var_id, "h0": hist.var_id}, "steps": [
            {"loop": {"carry": {"n": "start", "h": "h0"}, "max_steps": 6, "steps": [
                {"text": {"template": "{{input:n}} + 1", "output": "expr"}},
                {"tool": {"name": "calculator", "args": {"expression": "expr"}, "output": "n2"}},
                {"branch": {"cases": [{"when": {"kind": "number", "var": "n2", "op": ">=", "value": 2},
                                       "steps": [{"text": {"template": "big {{input:n2}}", "output": "w"}}]}],
                            "default": [{"text": {"template": "small {{input:n2}}", "output": "w"}}],
                            "outputs": ["w"]}},
                {"text": {"template": "{{input:h}}{{input:w}}\n", "output": "h2"}}],
                "next": {"n": "n2", "h": "h2"}, "until": {"kind": "number", "var": "n2", "op": ">=", "value": 3},
                "outputs": ["h2"]}},
            {"map": {"over": "h2", "as": "line", "output": "said", "into": "all", "join": "|", "steps": [
                {"generate": {"prompt": "Say {{input:line}}:{{output:said}}",
                              "sampling": {"said": {"max_tokens": 14}}}}]}}],
            "outputs": ["h2", "all"]})
        assert await value(mgr, s, f.outputs["h2"]) == "small 1\nbig 2\nbig 3\n"
        said = (await value(mgr, s, f.outputs["all"])).split("|")
        assert [x[:len("<Say big 2")] for x in said] == ["<Say small", "<Say big 2", "<Say big 3"]
    run(body)


@pytest.mark.parametrize("mutate, param, message", [
    (lambda b: b["steps"][0]["loop"].pop("max_steps"), "max_steps", "every loop needs a bound"),
    (lambda b: b["steps"][0]["loop"].update(max_steps=10_000), "max_steps", "1..64"),
    (lambda b: b["steps"][0]["loop"].update(until={"kind": "number", "var": "nope", "op": ">", "value": 1}),
     "until", "'nope'"),
    (lambda b: b["steps"][0]["loop"].update(until={"kind": "fuzzy", "var": "n2"}), "until", "fuzzy"),
    (lambda b: b["steps"][0]["loop"]["steps"][1]["tool"].update(name="rm_rf"), "name", "rm_rf"),
    (lambda b: b["steps"][0]["loop"]["steps"].append({"text": {"template": "x", "output": "n2"}}), "steps",
     "single-assignment"),
    (lambda b: b["steps"][0]["loop"]["steps"].append({"text": {}, "tool": {}}), "steps", "exactly one"),
    (lambda b: b.update(outputs=["ghost"]), "outputs", "ghost"),
])
def test_bad_programs_are_rejected_at_submission(mutate, param, message):
    async def body(mgr, eng):
        s = mgr.create_session()
        spec = counter_loop(mgr.create_variable(s, "start", "0").var_id)
        mutate(spec)
        n_nodes = len(s.graph.variables) + len(s.graph.requests)
        with pytest.raises(InvalidRequestError) as e:
            mgr.submit_flow(s, spec)
        assert param in (e.value.param or "") and message in e.value.message, (e.value.param, e.value.message)
        assert len(s.graph.variables) + len(s.graph.requests) == n_nodes  # nothing was made
    run(body)


def test_branch_conditions_are_checked_against_constrained_outputs():
    async def body(mgr, eng):
        s = mgr.create_session()
        q = mgr.create_variable(s, "q", "hello").var_id
        choice = {"label": {"max_tokens": 4, "constraint": {"kind": "choice", "spec": '["billing", "tech"]'}}}
        spec = {"inputs": {"q": q}, "steps": [
            {"generate": {"prompt": "Route {{input:q}}: {{output:label}}", "sampling": choice}},
            {"branch": {"cases": [{"when": {"kind": "equals", "var": "label", "value": "sales"},
                                   "steps": [{"text": {"template": "x", "output": "r"}}]}],
                        "default": [{"text": {"template": "y", "output": "r"}}], "outputs": ["r"]}}],
            "outputs": ["r"]}
        with pytest.raises(InvalidRequestError, match="can never match"):
            mgr.submit_flow(s, spec)
        with pytest.raises(UnknownVariable):
            mgr.submit_flow(s, branch_on("v_999", {"kind": "equals", "var": "x", "value": "y"}))
    run(body)


def test_client_tool_calls_are_handed_out_once_and_answered():
    async def body(mgr, eng):
        s = mgr.create_session()
        f = mgr.submit_flow(s, counter_loop(mgr.create_variable(s, "start", "5").var_id, stop_at=7,
                                            tool_runs="client"))
        answered = 0
        while answered < 2:
            calls = await mgr.flows.take_calls(s, {"my_calc"}, 5)
            assert len(calls) == 1 and calls[0]["tool"] == "my_calc" and calls[0]["flow_id"] == f.flow_id
            assert await mgr.flows.take_calls(s, None, 0) == []  # handed out once
            n = int(calls[0]["args"]["expression"].split("+")[0])
            mgr.set_variable(s, calls[0]["call_id"], str(n + 1))
            answered += 1
        assert await value(mgr, s, f.outputs["n2"]) == "7"
        # a worker's error: on_error "fail" fails the step and what depends on it
        spec = counter_loop(mgr.create_variable(s, "start", "0").var_id, tool_runs="client")
        g = mgr.submit_flow(s, spec)
        call = (await mgr.flows.take_calls(s, None, 5))[0]
        mgr.flows.call_error(s, call["call_id"], "calculator crashed")
        with pytest.raises(StepFailed) as e:
            await mgr.get_variable(s, g.outputs["said"], timeout_s=10)
        assert e.value.cause_code == "tool_failed" and "calculator crashed" in e.value.message
    run(body)


def test_unanswered_client_tool_times_out():
    async def body(mgr, eng):
        s = mgr.create_session()
        f = mgr.submit_flow(s, counter_loop(mgr.create_variable(s, "start", "0").var_id, tool_runs="client"))
        with pytest.raises(StepFailed) as e:
            await mgr.get_variable(s, f.outputs["n2"], timeout_s=10)
        assert e.value.cause_code == "tool_timeout"
    run(body, flow_tool_timeout_s=0.2)


def _router(label_var: str) -> dict:
    return {"name": "router", "inputs": {"label": label_var}, "steps": [
        {"branch": {"name": "route", "cases": [
            {"when": {"kind": "equals", "var": "label", "value": "billing"}, "steps": [
                {"generate": {"prompt": "Billing help:{{output:reply}}", "sampling": {"reply": {"max_tokens": 16}}}}]},
            {"when": {"kind": "equals", "var": "label", "value": "tech"}, "steps": [
                {"generate": {"prompt": "Tech help:{{output:reply}}", "sampling": {"reply": {"max_tokens": 16}}}}]}],
            "outputs": ["reply"]}}], "outputs": ["reply"]}


def test_speculation_hit_then_miss_cancels_the_speculated_case_and_frees_its_kv():
    async def body(mgr, eng):
        s = mgr.create_session()
        for _ in range(2):  # the profile: "billing" taken in 2 of 2 runs
            f = mgr.submit_flow(s, _router(mgr.create_variable(s, "label", "billing").var_id))
            assert (await value(mgr, s, f.outputs["reply"])).startswith("<Billing help:")
        # hit: the label is pending at submission, the billing case starts at once and is adopted
        label = mgr.create_variable(s, "label")
        f = mgr.submit_flow(s, _router(label.var_id))
        await asyncio.sleep(0.05)
        spec_req = s.graph.requests[s.graph.by_origin["f_3/0.branch/case0/0.generate"]]
        assert spec_req.status is RequestStatus.FINISHED  # ran before the label existed
        mgr.set_variable(s, label.var_id, "billing")
        assert (await value(mgr, s, f.outputs["reply"])).startswith("<Billing help:")
        # miss: the speculated billing generate is held mid-generation (its context on the engine), then cancelled
        eng.gate = asyncio.Event()
        label = mgr.create_variable(s, "label")
        f = mgr.submit_flow(s, _router(label.var_id))
        await asyncio.sleep(0.05)
        spec_req = s.graph.requests[s.graph.by_origin["f_4/0.branch/case0/0.generate"]]
        assert spec_req.status is RequestStatus.RUNNING and eng.contexts
        mgr.set_variable(s, label.var_id, "tech")
        await asyncio.sleep(0.05)
        assert spec_req.status is RequestStatus.FAILED and spec_req.error.cause_code == "speculation_cancelled"
        assert spec_req.context_id not in eng.contexts and spec_req.context_id not in s.contexts  # freed at once
        assert list(eng.contexts) == list(s.contexts)  # what is left: the taken case's, held at the gate
        eng.gate.set()
        assert (await value(mgr, s, f.outputs["reply"])).startswith("<Tech help:")
        st = mgr.stats()["flows"]
        assert st["speculations"] == {"hit": 1, "miss": 1} and st["wasted_tokens"] == 0  # held before its 1st token
        events = [e["event"] for e in mgr.flow_status(s, f.flow_id)["events"]]
        assert events[:3] == ["speculated", "branch", "speculation_miss"]
        # a miss after the speculated case finished: its 16 tokens were wasted (billing is still 3 of 4 runs)
        label = mgr.create_variable(s, "label")
        f = mgr.submit_flow(s, _router(label.var_id))
        await asyncio.sleep(0.05)
        mgr.set_variable(s, label.var_id, "tech")
        assert (await value(mgr, s, f.outputs["reply"])).startswith("<Tech help:")
        assert mgr.stats()["flows"]["wasted_tokens"] == 16
    run(body, flow_speculation_min_runs=2)


def test_speculation_off_starts_nothing_early():
    async def body(mgr, eng):
        s = mgr.create_session()
        for _ in range(3):
            await value(mgr, s, mgr.submit_flow(s, _router(mgr.create_variable(s, "label", "tech").var_id))
                        .outputs["reply"])
        label = mgr.create_variable(s, "label")
        mgr.submit_flow(s, _router(label.var_id))
        await asyncio.sleep(0.05)
        assert not any(o.startswith("f_4/0.branch/case") for o in s.graph.by_origin)
        assert mgr.stats()["flows"]["speculations"] == {"hit": 0, "miss": 0}
    run(body, flow_speculation=False, flow_speculation_min_runs=2)


class DiesAfter(UnreachableEngine):
    """Goes down at its ``limit``-th generate."""

    def __init__(self, name: str, limit: int) -> None:
        super().__init__(name)
        self.limit, self.generates = limit, 0

    async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
        self.generates += 1
        if self.generates >= self.limit:
            self.down = True
        async for chunk in super().generate_stream(sampling, context_id, parent_context_id, hint=hint):
            yield chunk


def test_failover_mid_loop_continues_on_the_other_engine():
    async def main():
        e1, e2 = DiesAfter("e1", 2), FakeEngine("e2")
        mgr = Manager(EngineRegistry([e1, e2]), config=ManagerConfig(engine_heartbeat_s=0, policy="round-robin"))
        await mgr.start()
        try:
            s = mgr.create_session()
            f = mgr.submit_flow(s, counter_loop(mgr.create_variable(s, "start", "0").var_id, stop_at=4))
            assert await value(mgr, s, f.outputs["n2"]) == "4"
            engines = [r.engine for r in sorted(s.graph.requests.values(), key=lambda r: r.number)]
            assert len(engines) == 4 and engines[-1] == "e2" and e1.down
            assert mgr.executor.num_rescheduled >= 1
        finally:
            await mgr.stop()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_restart_mid_loop_continues_at_its_iteration(tmp_path):
    """The loop waits for a client tool in iteration 1; the manager stops; a new one on the same state dir replays
    the flow, meets iteration 0's nodes (not run again) and hands out iteration 1's call again."""
    async def first():
        eng = FakeEngine()
        mgr = Manager(EngineRegistry([eng]), config=ManagerConfig(engine_heartbeat_s=0, state_dir=str(tmp_path)))
        await mgr.start()
        s = mgr.create_session()
        f = mgr.submit_flow(s, counter_loop(mgr.create_variable(s, "start", "0").var_id, tool_runs="client"))
        call = (await mgr.flows.take_calls(s, None, 5))[0]
        mgr.set_variable(s, call["call_id"], "1")
        await value(mgr, s, s.graph.by_origin["f_1/0.loop[0]/2.generate:said"])
        second = (await mgr.flows.take_calls(s, None, 5))[0]
        assert second["args"] == {"expression": "1 + 1"}
        await asyncio.sleep(0.05)
        await mgr.stop()
        return s.session_id, s.token, f, len(eng.calls_of("generate"))

    async def second(sid, token, f):
        eng = FakeEngine()
        mgr = Manager(EngineRegistry([eng]), config=ManagerConfig(engine_heartbeat_s=0, state_dir=str(tmp_path)))
        await mgr.start()
        try:
            s = mgr.session(sid, token)
            call = (await mgr.flows.take_calls(s, None, 5))[0]
            assert call["args"] == {"expression": "1 + 1"}
            assert s.graph.variables[call["call_id"]].origin == "f_1/0.loop[1]/1.tool"
            mgr.set_variable(s, call["call_id"], "2")
            call = (await mgr.flows.take_calls(s, None, 5))[0]
            mgr.set_variable(s, call["call_id"], "3")
            assert await value(mgr, s, f.outputs["n2"]) == "3"
            origins = [r.origin for r in s.graph.requests.values()]
            assert sorted(origins) == [f"f_1/0.loop[{i}]/2.generate" for i in range(3)]  # none made twice
            prompts = [FakeEngine.decode(c[3]) for c in eng.calls_of("fill") if len(c) > 3]
            assert not any("Count 1:" in p for p in prompts)  # iteration 0 did not run again
            assert any("Count 2:" in p for p in prompts) and any("Count 3:" in p for p in prompts)
            await asyncio.sleep(0.05)
            assert mgr.flow_status(s, f.flow_id)["status"] == "finished"
        finally:
            await mgr.stop()

    sid, token, f, _ = asyncio.run(asyncio.wait_for(first(), 30))
    asyncio.run(asyncio.wait_for(second(sid, token, f), 30))


def test_deleting_the_session_mid_flow_fails_every_get():
    async def body(mgr, eng):
        s = mgr.create_session()
        f = mgr.submit_flow(s, counter_loop(mgr.create_variable(s, "start", "0").var_id, tool_runs="client"))
        waiter = asyncio.create_task(mgr.get_variable(s, f.outputs["n2"], timeout_s=10))
        await asyncio.sleep(0.05)
        await mgr.delete_session(s)
        with pytest.raises(StepFailed):
            await waiter
    run(body)


def test_http_routes():
    app = create_app(ServerSettings(engine_heartbeat_s=0), [FakeEngine()])
    with TestClient(app, raise_server_exceptions=False) as c:
        body = c.post("/api/v1/sessions", json={"ttl_s": 60}).json()
        base, h = f"/api/v1/sessions/{body['session_id']}", {"X-Parrot-Session-Token": body["token"]}
        start = c.post(f"{base}/variables", json={"name": "start", "value": "0"}, headers=h).json()["var_id"]
        bad = counter_loop(start)
        del bad["steps"][0]["loop"]["max_steps"]
        r = c.post(f"{base}/flows", json=bad, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == "steps[0].loop.max_steps", r.text
        r = c.post(f"{base}/flows", json=counter_loop(start, tool_runs="client"), headers=h)
        assert r.status_code == 200, r.text
        flow = r.json()
        for n in (1, 2, 3):
            calls = c.get(f"{base}/tool_calls", params={"timeout": 5, "tools": "my_calc"}, headers=h).json()["calls"]
            assert len(calls) == 1
            r = c.put(f"{base}/variables/{calls[0]['call_id']}", json={"value": str(n)}, headers=h)
            assert r.status_code == 200, r.text
        r = c.get(f"{base}/variables/{flow['outputs']['n2']}", params={"timeout": 10}, headers=h)
        assert r.json()["value"] == "3"
        st = c.get(f"{base}/flows/{flow['flow_id']}", headers=h).json()
        assert st["status"] in ("running", "finished") and st["events"][0]["event"] == "iteration"
        assert c.get(f"{base}/flows/f_9", headers=h).status_code == 404
        r = c.post(f"{base}/tool_calls/v_1/error", json={"message": "x"}, headers=h)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_tool_call"
        metrics = c.get("/metrics").text
        assert "parrot_flow_iterations_total 3.0" in metrics


def test_a_schema_1_journal_is_migrated_in_place(tmp_path):
    import sqlite3

    from parrot.manager.journal import DB_NAME, SCHEMA_VERSION, SqliteJournal

    db = sqlite3.connect(tmp_path / DB_NAME)
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE sessions (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, token_sha256 BLOB NOT NULL,
            ttl_s REAL NOT NULL, created_at REAL NOT NULL);
        CREATE TABLE variables (session_id TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE,
            var_id TEXT NOT NULL, number INTEGER NOT NULL, name TEXT, status TEXT NOT NULL, value TEXT, raw TEXT,
            error TEXT, perf TEXT, perf_at REAL, PRIMARY KEY (session_id, var_id));
        CREATE TABLE requests (session_id TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE,
            request_id TEXT NOT NULL, number INTEGER NOT NULL, spec TEXT NOT NULL, status TEXT NOT NULL, error TEXT,
            PRIMARY KEY (session_id, request_id));
        INSERT INTO meta VALUES ('schema_version', '1');
        INSERT INTO sessions VALUES ('s1', 'anonymous', x'00', 60, 1);
        INSERT INTO variables (session_id, var_id, number, name, status, value) VALUES ('s1', 'v_1', 1, 'a', 'ready', 'x');
    """)
    db.close()
    journal = SqliteJournal(tmp_path)
    try:
        (rec,) = journal.load()
        assert rec.variables[0].value == "x" and rec.variables[0].origin is None and rec.flows == ()
        assert journal._db.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION) == "2"
    finally:
        journal.close()


def react_loop(question: str, doc: str, steps: int = 4) -> dict:
    """A ReAct-shaped loop: think (continuing the history) -> search -> append thought and observation."""
    return {"name": "react", "inputs": {"question": question, "doc": doc}, "steps": [
        {"text": {"template": "Question: {{input:question}}\n", "output": "h0"}},
        {"loop": {"carry": {"h": "h0"}, "max_steps": steps, "on_max": "last", "steps": [
            {"generate": {"prompt": "{{input:h}}Thought:{{output:t}}", "sampling": {"t": {"max_tokens": 12}}}},
            {"tool": {"name": "search_text", "args": {"query": "t", "text": "doc"}, "output": "obs",
                      "on_error": "value"}},
            {"text": {"template": "{{input:h}}Thought:{{input:t}}\nObservation: {{input:obs}}\n", "output": "h2"}}],
            "next": {"h": "h2"}, "until": {"kind": "contains", "var": "t", "value": "NEVER"},
            "outputs": ["h2"]}}], "outputs": ["h2"]}


DOC = ("Keepers climbed the tower at night to wind the clockwork. The lens floated on a bath of mercury. "
       "Lightships marked shoals where no tower could stand. Coal fires wasted most of their light upward.")


class PausingEngine(FakeEngine):
    """A FakeEngine that keeps a context paused for a tool call (LAMPS' preserve) instead of freeing it."""

    async def pause_context(self, context_id, tool):
        if context_id not in self.contexts:
            raise UnknownContext(context_id)
        n = len(self.contexts[context_id])
        return PauseResult(context_id, "preserve", n, n // 16)


def test_loop_iterations_extend_their_predecessor_and_stay_on_its_engine():
    """Each iteration's prompt is its predecessor's prompt pieces + its output + the new pieces (text steps are
    inlined), so it is placed where the predecessor's paused context is, even when the other engine holds a
    popular shared prefix, and its prompt holds every earlier thought as that thought's variable."""
    async def main():
        e1, e2 = PausingEngine("e1"), PausingEngine("e2")
        mgr = Manager(EngineRegistry([e1, e2]), config=ManagerConfig(engine_heartbeat_s=0))
        await mgr.start()
        try:
            s = mgr.create_session()
            flows = [mgr.submit_flow(s, react_loop(mgr.create_variable(s, "q", q).var_id,
                                                   mgr.create_variable(s, "doc", DOC).var_id))
                     for q in ("Why did keepers climb at night?", "What did lenses float on?")]
            for f in flows:
                history = await value(mgr, s, f.outputs["h2"])
                assert history.count("Observation:") == 4
            for f in flows:
                reqs = sorted((r for r in s.graph.requests.values() if r.origin.startswith(f.flow_id + "/")),
                              key=lambda r: r.number)
                assert len(reqs) == 4 and len({r.engine for r in reqs}) == 1, [r.engine for r in reqs]
                # iteration k's prompt holds every earlier thought as an input bound to that thought's variable
                thoughts = [r.outputs[0] for r in reqs]
                assert set(thoughts[:3]) <= set(reqs[3].inputs)
            assert {r.engine for r in s.graph.requests.values()} == {"e1", "e2"}  # the two loops spread out
        finally:
            await mgr.stop()
    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_loop_that_outgrows_the_session_fails_with_the_limit_not_a_hang():
    async def body(mgr, eng):
        s = mgr.create_session()
        f = mgr.submit_flow(s, counter_loop(mgr.create_variable(s, "start", "0").var_id, stop_at=40, max_steps=40))
        with pytest.raises(StepFailed) as e:
            await mgr.get_variable(s, f.outputs["n2"], timeout_s=10)
        assert e.value.cause_code == "invalid_request" and "limit of 40" in e.value.message
    run(body, max_nodes_per_session=40)


def test_a_history_that_doubles_each_iteration_is_not_inlined_past_the_bound():
    async def body(mgr, eng):
        s = mgr.create_session()
        f = mgr.submit_flow(s, {"inputs": {"h0": mgr.create_variable(s, "h", "a").var_id}, "steps": [
            {"loop": {"carry": {"h": "h0", "g": "h0"}, "max_steps": 12, "on_max": "last", "steps": [
                {"text": {"template": "{{input:h}}{{input:g}}", "output": "h2"}},
                {"generate": {"prompt": "{{input:h2}}:{{output:t}}", "sampling": {"t": {"max_tokens": 4}}}}],
                "next": {"h": "h2", "g": "h2"}, "until": {"kind": "equals", "var": "t", "value": "never"},
                "outputs": ["t"]}}], "outputs": ["t"]})
        await value(mgr, s, f.outputs["t"])
        pieces = [len(r.segments) for r in sorted(s.graph.requests.values(), key=lambda r: r.number)]
        # [h0, h0, ":", t], [h0 x4, ":", t], ...: 2^(k+1) + 2 pieces, until past the bound they stay whole
        assert pieces[:3] == [4, 6, 10] and pieces[-1] == 3 and max(pieces) <= 2048 + 2, pieces
    run(body, FakeEngine(max_model_len=1 << 16), max_session_bytes=2**26)


class HintRecorder(FakeEngine):
    """Records the OpHint of every generate."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.hints = []

    async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
        self.hints.append(hint)
        async for chunk in super().generate_stream(sampling, context_id, parent_context_id, hint=hint):
            yield chunk


def test_a_loops_generates_tell_the_engine_what_follows():
    """Each iteration's generate carries the tool its branch-free body calls on its output (known before the tool's
    variable exists) and the iterations expected after it, each with the tool results' tokens (LAMPS' `later`)."""
    async def body(mgr, eng):
        s = mgr.create_session()
        f = mgr.submit_flow(s, react_loop(mgr.create_variable(s, "q", "Why at night?").var_id,
                                          mgr.create_variable(s, "doc", DOC).var_id, steps=4))
        await value(mgr, s, f.outputs["h2"])
        hints = eng.hints
        assert [h.tool.name for h in hints] == ["search_text"] * 4
        assert [len(h.later) for h in hints] == [3, 2, 1, 0]  # max_steps before the loop's first run
        # the mean size of the loop's tool results ready when the generate was made: none for the first two
        assert [h.predicted_return_tokens is None for h in hints] == [True, True, False, False]
        assert all(h.predicted_return_tokens > 5 for h in hints[2:])
        assert all(x.tool.name == "search_text" for h in hints for x in h.later)
        # each carries the flow's age when it was sent (a request-level rank ages the loop by it), growing
        ages = [h.elapsed_s for h in hints]
        assert all(a is not None and a >= 0 for a in ages) and ages == sorted(ages) and ages[-1] > ages[0]
    run(body, HintRecorder())
