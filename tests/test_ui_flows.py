"""The live web view (/ui) shows flows (docs/flows.md): on the fake engine, through the HTTP app, a flow with a loop
and a branch is run four times (the branch's profile makes the third run speculate and hit, the fourth speculate
and miss); the tenant's snapshot must carry each flow (status, iterations per loop, the branch's decision, the
speculation outcome, the newest events only) and every node a flow made described by its origin (its loop
iteration or branch case: the band the page draws it in, and its badge); the page's scripts must read those
fields."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from fakes import FakeEngine
from parrot.api import ServerSettings, create_app
from parrot.api.ui import snapshot


def agent(start: str, *, stop_at: int) -> dict:
    """A loop counting n up to ``stop_at`` (text + server calculator + a generate per iteration), then a branch on
    the count: n2 == 3 -> a generate (reading only the flow's input, so a speculated start really runs), else a
    text."""
    return {"name": "agent", "inputs": {"start": start}, "steps": [
        {"loop": {"name": "counting", "carry": {"n": "start"}, "max_steps": 8, "steps": [
            {"text": {"template": "{{input:n}} + 1", "output": "expr"}},
            {"tool": {"name": "calculator", "args": {"expression": "expr"}, "output": "n2"}},
            {"generate": {"prompt": "Count {{input:n2}}:{{output:said}}", "sampling": {"said": {"max_tokens": 8}}}},
        ], "next": {"n": "n2"}, "until": {"kind": "number", "var": "n2", "op": ">=", "value": stop_at},
            "outputs": ["n2", "said"]}},
        {"branch": {"name": "route", "cases": [
            {"when": {"kind": "equals", "var": "n2", "value": "3"}, "steps": [
                {"generate": {"name": "finish", "prompt": "Done from {{input:start}}:{{output:reply}}",
                              "sampling": {"reply": {"max_tokens": 8}}}}]}],
            "default": [{"text": {"template": "not done", "output": "reply"}}], "outputs": ["reply"]}},
    ], "outputs": ["n2", "reply"]}


@pytest.fixture()
def client():
    app = create_app(ServerSettings(engine_heartbeat_s=0, flow_speculation_min_runs=2), [FakeEngine()])
    with TestClient(app) as c:
        yield c


def _run(c, base: str, h: dict, *, stop_at: int) -> dict:
    start = c.post(f"{base}/variables", json={"name": "start", "value": "0"}, headers=h).json()["var_id"]
    r = c.post(f"{base}/flows", json=agent(start, stop_at=stop_at), headers=h)
    assert r.status_code == 200, r.text
    flow = r.json()
    for vid in flow["outputs"].values():
        got = c.get(f"{base}/variables/{vid}", params={"timeout": 10}, headers=h).json()
        assert got["status"] == "ready", got
    deadline = time.monotonic() + 10
    while True:  # the run's own end ("finished") follows its exports
        st = c.get(f"{base}/flows/{flow['flow_id']}", headers=h).json()
        if st["status"] != "running" or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


def test_snapshot_shows_flows_loops_branches_and_speculation(client, monkeypatch):
    c = client
    s = c.post("/api/v1/sessions", json={}).json()
    base, h = f"/api/v1/sessions/{s['session_id']}", {"X-Parrot-Session-Token": s["token"]}
    runs = [_run(c, base, h, stop_at=3) for _ in range(3)] + [_run(c, base, h, stop_at=5)]
    assert [r["status"] for r in runs] == ["finished"] * 4
    snap = c.get("/ui/api/snapshot").json()
    (sess,) = snap["sessions"]
    flows = sess["flows"]
    assert [f["flow_id"] for f in flows] == ["f_4", "f_3", "f_2", "f_1"]  # newest first
    assert all(f["name"] == "agent" and f["status"] == "finished" and f["error"] is None for f in flows)
    assert all("_names" not in f and "_branches" not in f for f in flows)

    f4, f3, _, f1 = flows
    # loops: iterations per loop (made and evaluated), how each ended
    (loop,) = f1["loops"]
    assert loop == {"path": "f_1/0.loop", "name": "counting", "iterations": 3, "evaluated": 3, "state": "done",
                    "last_until": "until: true"}
    assert f1["iterations"] == 3
    assert f4["loops"][0]["iterations"] == 5 and f4["loops"][0]["state"] == "done"
    # branches: the decision, the speculation (none while the profile was short, then a hit, then a miss)
    (b1,) = f1["branches"]
    assert (b1["path"], b1["name"], b1["case"], b1["case_label"], b1["speculated"], b1["speculation"]) == \
        ("f_1/1.branch", "route", 0, "case0", None, None)
    (b3,) = f3["branches"]
    assert (b3["case_label"], b3["speculated"], b3["speculation"]) == ("case0", 0, "hit")
    assert f3["speculation"] == {"speculated": 1, "hit": 1, "miss": 0, "wasted_tokens": 0}
    (b4,) = f4["branches"]
    assert (b4["case"], b4["case_label"], b4["speculated"], b4["speculation"]) == (1, "default", 0, "miss")
    assert f4["speculation"]["speculated"] == 1 and f4["speculation"]["miss"] == 1
    assert f4["speculation"]["wasted_tokens"] == b4["wasted_tokens"]
    # events: the run's own, newest last, as GET /flows/{id} gives them
    assert f4["events"] == runs[3]["events"] and f4["events_total"] == len(runs[3]["events"])
    assert [e["event"] for e in f1["events"]] == ["iteration"] * 3 + ["loop_done", "branch", "finished"]
    assert f1["requests"] == 4 and f4["requests"] == 6  # a generate per iteration + the case's (speculated) one

    # nodes: each flow-made request / variable says which iteration or case it belongs to
    reqs = {r["origin"]: r for r in sess["requests"]}
    it1 = reqs["f_1/0.loop[1]/2.generate"]["flow"]
    assert (it1["flow_id"], it1["flow_name"], it1["scope"], it1["badge"], it1["step"]) == \
        ("f_1", "agent", "f_1/0.loop[1]", "loop[1]", "2.generate")
    assert it1["scopes"] == [{"path": "f_1/0.loop[1]", "kind": "loop", "index": 1, "name": "counting",
                              "label": "loop[1]", "title": "loop counting iteration 1"}]
    taken = reqs["f_1/1.branch/case0/0.generate"]["flow"]
    assert (taken["scope"], taken["badge"]) == ("f_1/1.branch/case0", "case0")
    assert taken["scopes"][0]["case_state"] == "taken" and taken["scopes"][0]["name"] == "route"
    missed = reqs["f_4/1.branch/case0/0.generate"]["flow"]
    assert missed["scopes"][0]["case_state"] == "cancelled"
    assert all(r["flow"] is None for r in sess["requests"] if r["origin"] is None)
    vars_ = {v["origin"]: v for v in sess["variables"] if v["origin"]}
    assert vars_["f_1/0.loop[2]/0.text"]["flow"]["badge"] == "loop[2]"
    out = vars_["f_1/0.loop[2]/2.generate:said"]["flow"]
    assert (out["var"], out["scope"]) == ("said", "f_1/0.loop[2]")
    export = vars_["f_1/0.loop:n2"]["flow"]  # the loop's exported value: the flow's top level
    assert (export["scope"], export["badge"], export["step"], export["var"]) == ("f_1", "", "0.loop", "n2")
    default = vars_["f_4/1.branch/case1/0.text"]["flow"]
    assert (default["badge"], default["scopes"][0]["case_state"]) == ("default", "taken")
    assert [v["flow"] for v in sess["variables"] if v["origin"] is None] == [None] * 4  # the 4 "start" inputs

    # bounded: only the newest events of a flow, only the newest flows of a session
    monkeypatch.setattr(snapshot, "MAX_FLOW_EVENTS", 3)
    monkeypatch.setattr(snapshot, "MAX_FLOWS", 2)
    small = c.get("/ui/api/snapshot").json()["sessions"][0]["flows"]
    assert [f["flow_id"] for f in small] == ["f_4", "f_3"]
    assert small[0]["events"] == runs[3]["events"][-3:] and small[0]["events_total"] == len(runs[3]["events"])
    still = {r["origin"]: r["flow"] for r in c.get("/ui/api/snapshot").json()["sessions"][0]["requests"]}
    assert still["f_1/0.loop[0]/2.generate"]["badge"] == "loop[0]"  # an unlisted flow's nodes are still placed
    assert still["f_1/0.loop[0]/2.generate"]["flow_name"] is None


def test_page_scripts_read_the_flow_fields(client):
    app_js = client.get("/ui/static/app.js")
    dag_js = client.get("/ui/static/dag.js")
    css = client.get("/ui/static/app.css")
    assert app_js.status_code == dag_js.status_code == css.status_code == 200
    for field in ("s.flows", "loops", "iterations", "evaluated", "branches", "case_label", "speculation",
                  "wasted_tokens", "events_total", "data-flow", "data-status", "data-loop", "data-branch",
                  "data-speculation"):
        assert field in app_js.text, field
    for field in ("flow.scope", "flow.badge", "flow.scopes", "case_state", "data-flow", "data-scope", "data-badge",
                  "data-origin", "flow-scope"):
        assert field in dag_js.text, field
    assert ".flows" in css.text and ".flow " in css.text


# ---- in a real browser (Debian's headless Chromium, as tests/test_ui.py), the fake engine behind a real server --
def test_page_draws_flows_and_bands_their_nodes_by_origin():
    import os
    import threading

    import httpx
    import uvicorn

    from parrot.engine.server.procs import free_port
    from test_ui import CHROMIUM, CHROMIUM_ARGS

    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} missing: run scripts/install-chromium.sh")
    from playwright.sync_api import sync_playwright

    app = create_app(ServerSettings(engine_heartbeat_s=0, flow_speculation_min_runs=2), [FakeEngine()])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.config.port}"
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        with httpx.Client(base_url=url, timeout=30) as c:
            s = c.post("/api/v1/sessions", json={}).json()
            sid, h = s["session_id"], {"X-Parrot-Session-Token": s["token"]}
            base = f"/api/v1/sessions/{sid}"
            for stop_at in (3, 3, 3, 5):
                _run(c, base, h, stop_at=stop_at)
            dag = c.get(f"{base}/dag", headers=h).json()
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(f"{url}/ui")
                sec = f'section[data-session="{sid}"]'
                page.locator(f'{sec} .flow[data-flow="f_4"][data-status="finished"]').wait_for(timeout=20_000)
                flows = page.eval_on_selector_all(f"{sec} .flow", "els => els.map(e => [e.dataset.flow, "
                                                  "e.dataset.status, e.dataset.iterations, e.dataset.speculation])")
                assert flows == [["f_4", "finished", "5", "0/1"], ["f_3", "finished", "3", "1/0"],
                                 ["f_2", "finished", "3", "0/0"], ["f_1", "finished", "3", "0/0"]]
                loop = page.locator(f'{sec} .flow[data-flow="f_1"] .chip[data-loop="f_1/0.loop"]')
                assert loop.get_attribute("data-iterations") == "3" and loop.get_attribute("data-state") == "done"
                branch = page.locator(f'{sec} .flow[data-flow="f_4"] .chip[data-branch="f_4/1.branch"]')
                assert branch.get_attribute("data-case") == "default"
                assert branch.get_attribute("data-speculation") == "miss"
                # every request a flow made is badged with its origin's scope, as GET /dag's origin says
                badges = page.eval_on_selector_all(f'{sec} g[data-node="request"]', "els => Object.fromEntries("
                                                   "els.map(e => [e.dataset.id, [e.dataset.origin, e.dataset.badge]]))")
                assert badges["r_2"] == ["f_1/0.loop[1]/2.generate", "loop[1]"]
                assert badges["r_4"] == ["f_1/1.branch/case0/0.generate", "case0"]
                assert {rid: o for rid, (o, _) in badges.items()} == {r["request_id"]: r["origin"]
                                                                      for r in dag["requests"]}
                # one box per loop iteration / case, a missed speculation's case marked cancelled
                scope = page.locator(f'{sec} g[data-node="flow-scope"][data-scope="f_4/0.loop[4]"]')
                assert scope.get_attribute("data-kind") == "loop"
                missed = page.locator(f'{sec} g[data-node="flow-scope"][data-scope="f_4/1.branch/case0"]')
                assert missed.get_attribute("data-case-state") == "cancelled"
                # the bands do not overlap: each iteration's box is below the previous one
                tops = [page.locator(f'{sec} g[data-node="flow-scope"][data-scope="f_1/0.loop[{i}]"] rect')
                        .bounding_box() for i in range(3)]
                assert all(a["y"] + a["height"] <= b["y"] for a, b in zip(tops, tops[1:])), tops
                assert errors == []
            finally:
                browser.close()
    finally:
        server.should_exit = True
        thread.join(10)
