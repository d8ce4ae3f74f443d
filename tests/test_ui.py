"""The live web view (/ui) in a real browser: `parrot serve` as a real process on the real default model with two
tenants' keys, a small map-reduce app submitted over the Parrot API, and Debian's headless Chromium driven by
playwright (scripts/install-chromium.sh installs it; never `playwright install`).

What must hold: the page draws the app's DAG with each request's state, deduced objective, task group and engine
as the server reports them (compared node by node with GET /dag); it changes live, without a reload, when a
request goes from waiting to finished; the engines panel shows the engine alive; the recent-requests table
gets the finished request; another tenant's key sees none of it and a wrong key sees nothing at all; the data
routes need the key while the page itself does not; screenshots are real pictures (not blank)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import httpx
import pytest

from parrot.engine.server.procs import free_port, wait_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ALICE, BOB = "sk-ui-alice-0123456789", "sk-ui-bob-0123456789"
CHUNKS = ["Lighthouses guided ships along dangerous coasts for centuries, using fire and later oil lamps.",
          "The Fresnel lens, invented in 1822, focused the light into a beam visible for many miles.",
          "Today most lighthouses are automated and keepers no longer live beside the lamp."]
WAIT_MS = 20_000


# ---- without a browser or the model: the ring of recent requests and who sees what in a snapshot ---------------
def test_recent_requests_ring_is_bounded_and_filtered_by_owner():
    from parrot.manager.recent import Outcome, RecentRequests, RequestKind

    now = [100.0]
    ring = RecentRequests(capacity=3, clock=lambda: now[0])
    for i, owner in enumerate(["alice", "bob", None, "alice"]):
        ring.add(kind=RequestKind.DAG, request_id=f"r{i}", label="f(x)", owner=owner, session_id="s", engine="e0",
                 outcome=Outcome.FINISHED, error_code=None, submitted=1.0, dispatched=1.5, first_token=2.0,
                 finished=3.0)
    assert ring.last_seq == 4
    assert [r.request_id for r in ring.visible_to("alice")] == ["r3", "r2"]  # r0 fell out; r2 is unowned
    assert [r.request_id for r in ring.visible_to("bob")] == ["r2", "r1"]
    assert ring.visible_to("alice")[0].to_json()["wait_s"] == 0.5
    with pytest.raises(RuntimeError), ring.span("cmpl-1/0", "m") as span:
        now[0] = 101.0
        ring.dispatched(span, "e1")
        now[0] = 102.5
        raise RuntimeError("boom")
    rec = ring.visible_to(None, limit=1)[0].to_json()
    assert (rec["kind"], rec["outcome"], rec["error_code"], rec["engine"]) == ("openai", "failed", "internal_error", "e1")
    assert (rec["wait_s"], rec["total_s"]) == (1.0, 2.5)


def test_snapshot_shows_a_tenant_only_its_own_sessions(tmp_path):
    from fastapi.testclient import TestClient

    from fakes import FakeEngine
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"name": "alice", "key": ALICE}, {"name": "bob", "key": BOB}]}))
    app = create_app(ServerSettings(engine_heartbeat_s=0, api_keys_file=str(keys)), [FakeEngine("engine-0")])
    alice, bob = {"Authorization": f"Bearer {ALICE}"}, {"Authorization": f"Bearer {BOB}"}
    with TestClient(app) as c:
        s = c.post("/api/v1/sessions", json={}, headers=alice).json()
        base, tok = f"/api/v1/sessions/{s['session_id']}", {**alice, "X-Parrot-Session-Token": s["token"]}
        v = c.post(f"{base}/variables", json={"value": "x"}, headers=tok).json()["var_id"]
        out = c.post(f"{base}/submit", headers=tok, json={"prompt": "{{input:a}} {{output:b}}", "placeholders": [
            {"name": "a", "is_output": False, "var_id": v}, {"name": "b", "is_output": True}]}).json()["outputs"]["b"]
        assert c.get(f"{base}/variables/{out}", params={"timeout": 10, "criteria": "latency"},
                     headers=tok).json()["status"] == "ready"
        model = c.get("/v1/models", headers=bob).json()["data"][0]["id"]
        assert c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                      headers=bob).status_code == 200
        mine = c.get("/ui/api/snapshot", headers=alice).json()
        theirs = c.get("/ui/api/snapshot", headers=bob).json()
    assert [x["session_id"] for x in mine["sessions"]] == [s["session_id"]]
    (req,) = mine["sessions"][0]["requests"]
    assert (req["status"], req["engine"], req["sched"]["criteria"]) == ("finished", "engine-0", "latency")
    assert [r["kind"] for r in mine["recent"]] == ["openai", "dag"]
    assert mine["recent"][0]["request_id"] is None  # an unowned record: no id under keys
    assert mine["recent"][1]["request_id"] == f"{s['session_id']}/r_1"
    assert theirs["tenant"] == "bob" and theirs["sessions"] == []
    assert [r["kind"] for r in theirs["recent"]] == ["openai"]
    assert [e["name"] for e in theirs["engines"]] == ["engine-0"] and theirs["engines"][0]["state"] == "alive"


# ---- the real thing: parrot serve on the default model, and a browser ------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from parrot.common.errors import ModelNotFound
    from parrot.engine.files.model_files import default_model_path

    try:
        default_model_path()
    except ModelNotFound as e:
        pytest.skip(str(e))
    keys = tmp_path_factory.mktemp("ui") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"name": "alice", "key": ALICE}, {"name": "bob", "key": BOB}]}))
    port = free_port()
    env = dict(os.environ, PARROT_ENGINE_KV_CACHE_TOKENS="8192", PARROT_LOG_LEVEL="WARNING")
    proc = subprocess.Popen([sys.executable, "-m", "parrot.cli", "serve", "--port", str(port), "--api-keys-file",
                             str(keys), "--engine-heartbeat-s", "0.5", "--prefix-min-tokens", "8"], env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 180, "parrot serve", path="/ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} missing: run scripts/install-chromium.sh")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


class App:
    """A map-reduce app of tenant alice over the Parrot API: 3 maps, then a reduce that also waits for a
    variable ("style") the test sets later, so the reduce stays WAITING until then."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ALICE}"})
        s = self.http.post("/api/v1/sessions", json={}).json()
        self.sid = s["session_id"]
        self.base = f"/api/v1/sessions/{self.sid}"
        self.http.headers["X-Parrot-Session-Token"] = s["token"]
        self.summaries = []
        for text in CHUNKS:
            chunk = self.var(text)
            out = self.submit("summarize", 'Write a concise summary of the following:\n"{{input:chunk}}"\n'
                              "CONCISE SUMMARY: {{output:summary}}", chunk=chunk)
            self.summaries.append(out["summary"])
        self.style = self.var(None)
        listing = "\n".join("- {{input:s%d}}" % i for i in range(len(CHUNKS)))
        self.final = self.submit("reduce", "The following is a set of summaries:\n" + listing +
                                 "\nWrite it {{input:style}}.\nSummary: {{output:final}}", style=self.style,
                                 **{f"s{i}": v for i, v in enumerate(self.summaries)})["final"]
        # the criterion the page must show as the deduced objective (paper §5.2): reduce and maps latency
        assert self.http.get(f"{self.base}/variables/{self.final}", params={"criteria": "latency"}).status_code == 200

    def var(self, value: str | None) -> str:
        r = self.http.post(f"{self.base}/variables", json={} if value is None else {"value": value})
        assert r.status_code == 200, r.text
        return r.json()["var_id"]

    def submit(self, name: str, prompt: str, **inputs: str) -> dict:
        outputs = [p.split("}}")[0] for p in prompt.split("{{output:")[1:]]
        placeholders = [{"name": k, "is_output": False, "var_id": v} for k, v in inputs.items()]
        placeholders += [{"name": o, "is_output": True, "sampling": {"max_tokens": 6, "temperature": 0}}
                         for o in outputs]
        r = self.http.post(f"{self.base}/submit", json={"prompt": prompt, "name": name, "placeholders": placeholders})
        assert r.status_code == 200, r.text
        return r.json()["outputs"]

    def wait(self, var_id: str) -> dict:
        r = self.http.get(f"{self.base}/variables/{var_id}", params={"timeout": 60})
        assert r.status_code == 200 and r.json()["status"] == "ready", r.text
        return r.json()

    def dag(self) -> dict:
        return self.http.get(f"{self.base}/dag").json()


def _open(browser, url: str, key: str | None):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/ui")
    if key is not None:
        page.fill("#key", key)
        page.click("#keyform button[type=submit]")
    return page


def _node(page, sid: str, rid: str):
    return page.locator(f'section[data-session="{sid}"] g[data-node="request"][data-id="{rid}"]')


def _page_requests(page, sid: str) -> dict:
    return page.eval_on_selector_all(
        f'section[data-session="{sid}"] g[data-node="request"]',
        "els => Object.fromEntries(els.map(e => [e.dataset.id, {state: e.dataset.state, "
        "objective: e.dataset.objective, engine: e.dataset.engine, group: e.dataset.group, "
        "prefix: e.dataset.prefix}]))")


def _api_requests(dag: dict) -> dict:
    return {r["request_id"]: {"state": r["status"], "objective": (r["sched"] or {}).get("criteria") or "none",
                              "engine": r["engine"] or "", "group": (r["sched"] or {}).get("task_group") or "",
                              "prefix": r["prefix_context"] or ""}
            for r in dag["requests"]}


def _assert_picture(png: bytes) -> None:
    """A real screenshot: the right size and far from one flat colour."""
    from PIL import Image, ImageStat

    img = Image.open(io.BytesIO(png)).convert("L")
    assert img.size[0] >= 1000
    assert ImageStat.Stat(img).stddev[0] > 20, "the screenshot is (nearly) blank"
    assert len(img.getcolors(1 << 16) or ()) > 16


@pytest.mark.model
def test_page_is_public_but_its_data_needs_a_key(server):
    page = httpx.get(f"{server}/ui")
    assert page.status_code == 200 and "/ui/static/app.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(f"{server}/ui/static/dag.js").status_code == 200
    assert httpx.get(f"{server}/ui/api/snapshot").status_code == 401
    assert httpx.get(f"{server}/ui/api/events").status_code == 401
    assert httpx.get(f"{server}/ui/api/snapshot", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
    with httpx.stream("GET", f"{server}/ui/api/events", headers={"Authorization": f"Bearer {BOB}"},
                      timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    snap = json.loads(first[len("data: "):])
    assert snap["type"] == "snapshot" and snap["tenant"] == "bob" and snap["engines"]


@pytest.mark.model
def test_live_view_of_a_map_reduce_app(server, browser, tmp_path):
    app = App(server)
    for s in app.summaries:
        app.wait(s)
    engine = httpx.get(f"{server}/health").json()["engines"][0]["name"]
    page = _open(browser, server, ALICE)
    try:
        sid = app.sid
        # the maps ran (finished, on the engine, latency objective in one task group); the reduce waits
        for rid in ("r_1", "r_2", "r_3"):
            node = _node(page, sid, rid)
            node.and_(page.locator('[data-state="finished"]')).wait_for(timeout=WAIT_MS)
            assert node.get_attribute("data-engine") == engine
            assert node.get_attribute("data-objective") == "latency"
        groups = {_node(page, sid, rid).get_attribute("data-group") for rid in ("r_1", "r_2", "r_3")}
        assert len(groups) == 1 and groups != {""}, groups
        reduce = _node(page, sid, "r_4")
        assert reduce.get_attribute("data-state") == "waiting" and reduce.get_attribute("data-engine") == ""
        assert reduce.get_attribute("data-objective") == "latency"
        assert _page_requests(page, sid) == _api_requests(app.dag())
        assert page.locator(f'section[data-session="{sid}"] g[data-node="variable"]').count() == 3 + 3 + 1 + 1
        card = page.locator(f'.engine[data-engine="{engine}"]')
        assert card.get_attribute("data-state") == "alive"
        assert page.locator("#conn").get_attribute("data-state") == "live"
        before = page.screenshot(full_page=True)
        _assert_picture(before)

        # live: the reduce goes from waiting to finished with no reload
        updates = int(page.locator("body").get_attribute("data-snapshots"))
        r = app.http.put(f"{app.base}/variables/{app.style}", json={"value": "in one sentence"})
        assert r.status_code == 200, r.text
        app.wait(app.final)
        reduce.and_(page.locator('[data-state="finished"]')).wait_for(timeout=WAIT_MS)
        assert reduce.get_attribute("data-engine") == engine
        assert int(page.locator("body").get_attribute("data-snapshots")) > updates
        assert _page_requests(page, sid) == _api_requests(app.dag())
        row = page.locator(f'#recent tr[data-request="{sid}/r_4"]')
        row.wait_for(timeout=WAIT_MS)
        assert row.get_attribute("data-outcome") == "finished" and row.get_attribute("data-engine") == engine
        after = page.screenshot(full_page=True)
        _assert_picture(after)
        assert after != before
        (tmp_path / "before.png").write_bytes(before)
        (tmp_path / "after.png").write_bytes(after)
    finally:
        page.close()

    # another tenant sees the engines but not alice's session or requests
    page = _open(browser, server, BOB)
    try:
        page.locator(f'.engine[data-engine="{engine}"]').wait_for(timeout=WAIT_MS)
        page.locator("#sessions .empty").wait_for(timeout=WAIT_MS)
        assert page.locator("section.session").count() == 0
        assert page.locator(f'#recent tr[data-request^="{app.sid}"]').count() == 0
    finally:
        page.close()

    # a wrong key sees nothing at all
    page = _open(browser, server, "sk-not-a-key")
    try:
        page.locator('#conn[data-state="unauthorized"]').wait_for(timeout=WAIT_MS)
        assert page.locator(".engine").count() == 0 and page.locator("section.session").count() == 0
        assert page.locator("#recent tbody tr").count() == 0
    finally:
        page.close()
