"""Tenants (issue 19, items 2-3): several API keys from a keys file (plain or SHA-256), each a tenant that owns its
sessions (another key gets 404 for them, the session token stays a second factor), revocation by editing the file
(no restart), a request rate per key (429 with Retry-After) and a session count per key (400 naming the limit);
keys never reach the logs. A real manager app (fake engine) under TestClient."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
from fastapi.testclient import TestClient

from parrot.api.app import create_app
from parrot.api.settings import ServerSettings
from parrot.api.tenants import RateLimiter, Tenant, TenantKeys, key_digest
from fakes import FakeEngine

ALICE, BOB, CAROL = "sk-alice-0123456789", "sk-bob-0123456789", "sk-carol-0123456789"


def write_keys(path, entries) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"keys": entries}, f)
    os.replace(tmp, path)
    st = os.stat(path)  # a distinct mtime even within the file system's timestamp granularity
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


@pytest.fixture()
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    write_keys(path, [{"name": "alice", "key": ALICE, "max_sessions": 2},
                      {"name": "bob", "key_sha256": key_digest(BOB)}])
    return path


def client(**settings) -> TestClient:
    app = create_app(ServerSettings(engine_heartbeat_s=0, api_keys_reload_s=0, **settings), [FakeEngine("engine-0")])
    return TestClient(app, raise_server_exceptions=False)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def new_session(c, key) -> tuple[str, dict]:
    r = c.post("/api/v1/sessions", json={}, headers=auth(key))
    assert r.status_code == 200, r.text
    body = r.json()
    return f"/api/v1/sessions/{body['session_id']}", {**auth(key), "X-Parrot-Session-Token": body["token"]}


def test_a_session_belongs_to_the_key_that_created_it(keys_file):
    with client(api_keys_file=str(keys_file)) as c:
        base, alice = new_session(c, ALICE)
        v = c.post(f"{base}/variables", json={"value": "x"}, headers=alice).json()["var_id"]
        sub = c.post(f"{base}/submit", headers=alice, json={"prompt": "{{input:a}} {{output:b}}", "placeholders": [
            {"name": "a", "is_output": False, "var_id": v}, {"name": "b", "is_output": True}]})
        assert sub.status_code == 200, sub.text
        # bob holds alice's session token, and still does not find her session, variables or DAG
        bob = {**alice, **auth(BOB)}
        for method, path in (("GET", f"{base}/dag"), ("GET", f"{base}/variables/{v}"), ("DELETE", base),
                             ("POST", f"{base}/variables")):
            r = c.request(method, path, headers=bob, json={} if method == "POST" else None)
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_session", (path, r.text)
        # the token stays a second factor for alice herself
        r = c.get(f"{base}/dag", headers={**auth(ALICE), "X-Parrot-Session-Token": "wrong"})
        assert r.status_code == 401
        assert c.get(f"{base}/dag", headers=alice).status_code == 200


def test_unknown_keys_and_revocation_without_a_restart(keys_file):
    with client(api_keys_file=str(keys_file), api_key=CAROL) as c:
        assert c.post("/api/v1/sessions", json={}).status_code == 401
        assert c.post("/api/v1/sessions", json={}, headers=auth("sk-nobody")).status_code == 401
        assert c.post("/api/v1/sessions", json={}, headers={"Authorization": ALICE}).status_code == 401  # no Bearer
        base, carol = new_session(c, CAROL)  # --api-key is the tenant "default", beside the file's
        new_session(c, BOB)
        write_keys(keys_file, [{"name": "alice", "key": ALICE}])  # bob revoked
        r = c.post("/api/v1/sessions", json={}, headers=auth(BOB))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        new_session(c, ALICE)
        write_keys(keys_file, [{"name": "alice"}])  # a broken file keeps the keys loaded before
        new_session(c, ALICE)
        assert c.get(f"{base}/dag", headers=carol).status_code == 200
        # the OpenAI API is guarded by the same keys
        assert c.get("/v1/models").status_code == 401 and c.get("/v1/models", headers=auth(ALICE)).status_code == 200


def test_a_bad_keys_file_fails_at_start(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"keys": [{"name": "x", "key": "a", "key_sha256": "b"}]}')
    with pytest.raises(ValueError, match="exactly one of"):
        client(api_keys_file=str(bad))


def test_session_count_and_request_rate_limits_per_key(keys_file):
    write_keys(keys_file, [{"name": "alice", "key": ALICE, "max_sessions": 2},
                           {"name": "bob", "key": BOB, "requests_per_minute": 3}])
    with client(api_keys_file=str(keys_file)) as c:
        new_session(c, ALICE)
        new_session(c, ALICE)
        r = c.post("/api/v1/sessions", json={}, headers=auth(ALICE))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_sessions"
        new_session(c, BOB)  # bob's own count is separate
        codes = [c.get("/v1/models", headers=auth(BOB)).status_code for _ in range(3)]
        assert codes == [200, 200, 429]  # the session above took the first of bob's 3
        r = c.get("/v1/models", headers=auth(BOB))
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(r.headers["retry-after"]) <= 20
        assert c.get("/v1/models", headers=auth(ALICE)).status_code == 200  # alice has no rate limit


def test_the_token_bucket_refills_at_its_rate():
    now = [0.0]
    limiter = RateLimiter(clock=lambda: now[0])
    t = Tenant("t", requests_per_minute=60)  # one per second, bursts of 60
    assert all(limiter.retry_after(t) is None for _ in range(60))
    wait = limiter.retry_after(t)
    assert wait is not None and abs(wait - 1.0) < 1e-9
    now[0] += 1.0
    assert limiter.retry_after(t) is None and limiter.retry_after(t) is not None


def test_keys_never_reach_the_logs(keys_file, caplog):
    caplog.set_level(logging.DEBUG)
    with client(api_keys_file=str(keys_file)) as c:
        new_session(c, ALICE)
        c.post("/api/v1/sessions", json={}, headers=auth("sk-wrong-key-zzz"))
        write_keys(keys_file, [{"name": "alice"}])
        time.sleep(0.01)
        c.post("/api/v1/sessions", json={}, headers=auth(ALICE))
    text = caplog.text
    assert "keys file" in text  # the reload was logged...
    assert ALICE not in text and BOB not in text and "sk-wrong-key-zzz" not in text  # ...without any key


def test_an_open_server_has_one_anonymous_tenant():
    keys = TenantKeys()
    assert keys.open and keys.lookup("anything") is None
    with client() as c:
        base, h = new_session(c, "ignored")
        assert c.get(f"{base}/dag", headers={"X-Parrot-Session-Token": h["X-Parrot-Session-Token"]}).status_code == 200
