"""Per-key limits (issue 19, item 3): requests in flight, prompt and output tokens, the server's defaults and a
key's own values; each over-limit answer names the limit (parrot.api.limits)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from parrot.api.app import create_app
from parrot.api.limits import RequestLimits
from parrot.api.settings import ServerSettings
from parrot.api.tenants import Tenant
from parrot.common.errors import LimitExceeded
from fakes import FakeEngine
from test_tenants import ALICE, BOB, auth, new_session, write_keys


def client(**settings) -> TestClient:
    app = create_app(ServerSettings(engine_heartbeat_s=0, api_keys_reload_s=0, **settings), [FakeEngine("engine-0")])
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture()
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    write_keys(path, [{"name": "alice", "key": ALICE, "max_pending": 2, "max_output_tokens": 6,
                       "max_prompt_tokens": 40},
                      {"name": "bob", "key": BOB}])
    return path


def waiting_submit(c, base, headers, var_id: str):
    """A request whose input is never set: it stays waiting, in flight for its tenant."""
    return c.post(f"{base}/submit", headers=headers, json={"prompt": "{{input:a}} {{output:b}}", "placeholders": [
        {"name": "a", "is_output": False, "var_id": var_id}, {"name": "b", "is_output": True}]})


def test_requests_in_flight_per_key_answer_429_with_retry_after_until_some_finish(keys_file):
    with client(api_keys_file=str(keys_file)) as c:
        base, alice = new_session(c, ALICE)
        v = c.post(f"{base}/variables", json={}, headers=alice).json()["var_id"]
        assert waiting_submit(c, base, alice, v).status_code == 200
        assert waiting_submit(c, base, alice, v).status_code == 200
        r = waiting_submit(c, base, alice, v)
        assert r.status_code == 429 and r.json()["error"]["code"] == "pending_limit", r.text
        assert r.json()["error"]["param"] == "max_pending" and int(r.headers["retry-after"]) >= 1
        # the OpenAI API counts against the same budget
        r = c.post("/v1/completions", headers=auth(ALICE), json={"model": "fake-model", "prompt": "hi"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "pending_limit"
        # another key has its own budget (the server default)
        base_b, bob = new_session(c, BOB)
        vb = c.post(f"{base_b}/variables", json={}, headers=bob).json()["var_id"]
        assert waiting_submit(c, base_b, bob, vb).status_code == 200
        # the two waiting requests run once their input is set; then alice may submit again
        assert c.put(f"{base}/variables/{v}", json={"value": "x"}, headers=alice).status_code == 200
        dag = c.get(f"{base}/dag", headers=alice).json()
        assert all(n["status"] == "finished" for n in dag["requests"]), dag
        assert c.post("/v1/completions", headers=auth(ALICE),
                      json={"model": "fake-model", "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert waiting_submit(c, base, alice, v).status_code == 200


def test_output_token_limits_reject_larger_asks_and_cap_the_default(keys_file):
    with client(api_keys_file=str(keys_file)) as c:
        h = auth(ALICE)
        r = c.post("/v1/completions", headers=h, json={"model": "fake-model", "prompt": "hi", "max_tokens": 7})
        assert r.status_code == 400 and r.json()["error"]["code"] == "limit_exceeded", r.text
        assert r.json()["error"]["param"] == "max_tokens" and "max_output_tokens" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", headers=h, json={
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
        r = c.post("/v1/responses", headers=h, json={"model": "fake-model", "input": "hi", "max_output_tokens": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
        # no max_tokens asked: the limit is the default
        r = c.post("/v1/completions", headers=h, json={"model": "fake-model", "prompt": "hi", "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
        base, alice = new_session(c, ALICE)
        r = c.post(f"{base}/submit", headers=alice, json={"prompt": "say {{output:b}}", "placeholders": [
            {"name": "b", "is_output": True, "sampling": {"max_tokens": 50}}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "placeholders[b].sampling.max_tokens"
        r = c.post(f"{base}/submit", headers=alice, json={"prompt": "say {{output:b}}", "placeholders": [
            {"name": "b", "is_output": True, "sampling": {"ignore_eos": True}}]})
        assert r.status_code == 200
        out = c.get(f"{base}/variables/{r.json()['outputs']['b']}", headers=alice, params={"timeout": 10}).json()
        assert out["status"] == "ready" and len(FakeEngine.encode(out["value"])) <= 6
        # bob has no limit of his own and the server none by default
        r = c.post("/v1/completions", headers=auth(BOB), json={"model": "fake-model", "prompt": "hi", "max_tokens": 9})
        assert r.status_code == 200


def test_prompt_token_limits_on_both_apis(keys_file):
    with client(api_keys_file=str(keys_file)) as c:
        long = "word " * 20  # 100 tokens with the fake byte tokenizer (+ BOS)
        r = c.post("/v1/completions", headers=auth(ALICE), json={"model": "fake-model", "prompt": long,
                                                                 "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "limit_exceeded"
        assert r.json()["error"]["param"] == "prompt" and "101 tokens" in r.json()["error"]["message"]  # with BOS
        r = c.post("/v1/chat/completions", headers=auth(ALICE), json={
            "model": "fake-model", "messages": [{"role": "user", "content": long}], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        # a Parrot request learns its prompt length when it runs: the step fails, every get sees why
        base, alice = new_session(c, ALICE)
        r = c.post(f"{base}/submit", headers=alice, json={"prompt": long + "{{output:b}}", "placeholders": [
            {"name": "b", "is_output": True, "sampling": {"max_tokens": 2}}]})
        assert r.status_code == 200
        g = c.get(f"{base}/variables/{r.json()['outputs']['b']}", headers=alice, params={"timeout": 10})
        assert g.status_code == 424 and g.json()["error"]["cause"] == "limit_exceeded", g.text
        # within the limit it runs
        r = c.post("/v1/completions", headers=auth(ALICE), json={"model": "fake-model", "prompt": "short",
                                                                 "max_tokens": 2})
        assert r.status_code == 200


def test_the_server_defaults_apply_to_keys_without_their_own():
    with client(max_pending_per_key=1, max_output_tokens=3) as c:  # an open server: the anonymous tenant
        r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 400 and "(3)" in r.json()["error"]["message"]
        base, h = new_session(c, "")
        v = c.post(f"{base}/variables", json={}, headers=h).json()["var_id"]
        assert waiting_submit(c, base, h, v).status_code == 200
        assert waiting_submit(c, base, h, v).status_code == 429


def test_a_keys_own_limits_win_over_the_servers():
    limits = RequestLimits.of(Tenant("t", max_pending=5, max_output_tokens=None), max_pending=100,
                              max_prompt_tokens=50, max_output_tokens=10)
    assert (limits.max_pending, limits.max_prompt_tokens, limits.max_output_tokens) == (5, 50, 10)
    assert limits.output_tokens(None, "max_tokens") == 10 and limits.output_tokens(10, "max_tokens") == 10
    with pytest.raises(LimitExceeded, match="exceeds the max_output_tokens limit"):
        limits.output_tokens(11, "max_tokens")
    with pytest.raises(ValueError, match="max_pending must be an integer"):
        from parrot.api.tenants import parse_keys
        parse_keys({"keys": [{"name": "x", "key": "k", "max_pending": 0}]})


def test_session_state_bytes_are_bounded_per_session_and_in_all():
    with client(max_session_bytes=4096, max_state_bytes=10_000) as c:
        base, h = new_session(c, "")
        r = c.post(f"{base}/variables", json={"value": "x" * 5000}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_session_bytes", r.text
        v = c.post(f"{base}/variables", json={}, headers=h).json()["var_id"]
        assert c.put(f"{base}/variables/{v}", json={"value": "é" * 1500}, headers=h).status_code == 200  # 3000 B
        r = c.post(f"{base}/submit", headers=h, json={"prompt": "y" * 1500 + "{{output:b}}", "placeholders": [
            {"name": "b", "is_output": True, "sampling": {"max_tokens": 2}}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_session_bytes"
        # the server-wide bound: two more sessions of 3,000 bytes fit, a third does not
        others = []
        for _ in range(2):
            b2, h2 = new_session(c, "")
            assert c.post(f"{b2}/variables", json={"value": "z" * 3000}, headers=h2).status_code == 200
            others.append((b2, h2))
        b3, h3 = new_session(c, "")
        r = c.post(f"{b3}/variables", json={"value": "z" * 3000}, headers=h3)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_state_bytes", r.text
        # a deleted session gives its bytes back
        assert c.delete(others[0][0], headers=others[0][1]).status_code == 200
        assert c.post(f"{b3}/variables", json={"value": "z" * 3000}, headers=h3).status_code == 200


def test_the_session_store_indexes_sessions_by_owner_through_create_pop_and_expiry():
    """What the per-key limits read (SessionStore.owned) stays equal to a scan of every session."""
    from parrot.manager.session import SessionStore

    now = [0.0]
    store = SessionStore(default_ttl_s=10, clock=lambda: now[0])
    a1, a2 = store.create(owner="a"), store.create(owner="a", owner_limit=2)
    b1 = store.create(ttl_s=5, owner="b")
    with pytest.raises(Exception, match="max_sessions limit"):
        store.create(owner="a", owner_limit=2)
    assert {s.session_id for s in store.owned("a")} == {a1.session_id, a2.session_id}
    store.pop(a1.session_id)
    assert [s.session_id for s in store.owned("a")] == [a2.session_id]
    now[0] = 7.0  # b's session expires, a's does not
    assert [s.session_id for s in store.pop_expired()] == [b1.session_id]
    assert store.owned("b") == [] and store.owned("nobody") == []
    for owner in ("a", "b"):
        assert store.owned(owner) == [s for s in store.all() if s.owner == owner]


def test_a_flows_generates_are_held_to_max_output_tokens():
    """A flow cannot bypass the tenant's max_output_tokens: an explicit max_tokens above it is a 400 naming the
    generate's output, and outputs without one (nested in a loop's branch) get the limit as their default."""
    with client(max_output_tokens=3) as c:
        base, h = new_session(c, "")
        q = c.post(f"{base}/variables", json={"value": "hi"}, headers=h).json()["var_id"]
        gen = {"generate": {"prompt": "Say {{input:q}}:{{output:a}}", "sampling": {"a": {"max_tokens": 9}}}}
        r = c.post(f"{base}/flows", json={"inputs": {"q": q}, "steps": [gen], "outputs": ["a"]}, headers=h)
        assert r.status_code == 400 and "max_output_tokens" in r.json()["error"]["message"], r.text
        nested = {"inputs": {"q": q}, "steps": [{"loop": {"max_steps": 1, "on_max": "last", "steps": [
            {"branch": {"cases": [{"when": {"kind": "equals", "var": "q", "value": "hi"}, "steps": [
                {"generate": {"prompt": "Say {{input:q}}:{{output:a}}"}}]}], "outputs": ["a"]}}],
            "until": {"kind": "contains", "var": "a", "value": "x"}, "outputs": ["a"]}}], "outputs": ["a"]}
        r = c.post(f"{base}/flows", json=nested, headers=h)
        assert r.status_code == 200, r.text
        a = c.get(f"{base}/variables/{r.json()['outputs']['a']}", params={"timeout": 10}, headers=h).json()
        assert a["status"] == "ready" and len(a["value"]) == 3  # the fake engine's 1 token = 1 byte
