"""Engines are not tenants (issue 19, item 1): registration and heartbeats need the server's engine secret, never
an API key; a registered name is kept by the engine process that holds it; a registration that fails its health
check changes nothing; bad URLs are a 400. A real engine HTTP server (uvicorn, fake engine inside) answers the
health checks; the manager app runs under TestClient."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from parrot.api.app import create_app
from parrot.api.settings import ServerSettings
from parrot.engine.server.app import create_engine_app
from fakes import FakeEngine
from servers import serve

SECRET = "registration-test-secret-42"
REG = "/api/v1/engines/register"
H = {"X-Parrot-Engine-Secret": SECRET}
DEAD_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture(scope="module")
def engine_url():
    with serve(create_engine_app(FakeEngine("ext"))) as url:
        yield url


def manager(**settings):
    app = create_app(ServerSettings(engine_heartbeat_s=0, **settings), [FakeEngine("engine-0")])
    return TestClient(app, raise_server_exceptions=False)


def names(c, headers=None) -> dict[str, bool]:
    r = c.get("/api/v1/engines", headers=headers or {})
    assert r.status_code == 200, r.text
    return {e["name"]: e["healthy"] for e in r.json()["engines"]}


def error(r, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.json()
    return r.json()["error"]["message"]


def test_without_a_secret_registration_is_closed(engine_url):
    with manager() as c:
        msg = error(c.post(REG, json={"name": "engine-0", "url": DEAD_URL, "instance": "x" * 16}), 403,
                    "engine_registration_closed")
        assert "--engine-secret" in msg
        # the finding of the issue: this used to replace the builtin engine, and every request then answered 503
        assert names(c) == {"engine-0": True}
        assert c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_wrong_or_missing_secret_is_refused(engine_url):
    with manager(engine_secret=SECRET) as c:
        body = {"name": "ext-1", "url": engine_url, "instance": "a" * 16}
        error(c.post(REG, json=body), 401, "invalid_engine_secret")
        error(c.post(REG, json=body, headers={"X-Parrot-Engine-Secret": SECRET + "x"}), 401, "invalid_engine_secret")
        error(c.post("/api/v1/engines/engine-0/heartbeat", json={"status": {}, "instance": "a" * 16}), 401,
              "invalid_engine_secret")
        assert names(c) == {"engine-0": True}


def test_names_belong_to_the_process_holding_them(engine_url):
    with manager(engine_secret=SECRET) as c:
        # the builtin engine's name is never taken over, secret or not
        error(c.post(REG, json={"name": "engine-0", "url": engine_url, "instance": "n" * 16}, headers=H), 409,
              "engine_name_taken")
        a = {"name": "ext-1", "url": engine_url, "instance": "a" * 16}
        assert c.post(REG, json=a, headers=H).json() == {"name": "ext-1", "healthy": True}
        status = c.get("/api/v1/engines").json()["engines"][1]["status"]
        assert c.post("/api/v1/engines/ext-1/heartbeat", json={"status": status, "instance": "a" * 16},
                      headers=H).status_code == 200
        # another process under the same name, while the holder is alive: refused, for registration and heartbeats
        b = {**a, "instance": "b" * 16}
        error(c.post(REG, json=b, headers=H), 409, "engine_name_taken")
        error(c.post("/api/v1/engines/ext-1/heartbeat", json={"status": status, "instance": "b" * 16}, headers=H),
              409, "engine_name_taken")
        # the holder may register again (the manager forgot it); a health check that fails changes nothing
        assert c.post(REG, json=a, headers=H).status_code == 200
        msg = error(c.post(REG, json={**a, "url": DEAD_URL}, headers=H), 400, "invalid_request")
        assert "health check" in msg
        assert names(c) == {"engine-0": True, "ext-1": True}
        # once the holder is dead, a new process may take the name
        c.app.state.manager.registry.mark_dead("ext-1", "test: the process crashed")
        assert c.post(REG, json=b, headers=H).json() == {"name": "ext-1", "healthy": True}


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://10.0.0.1:8000", "http://127.0.0.1:0",
                                 "file:///etc/passwd", "http://127.0.0.1:80@evil.example"])
def test_bad_urls_are_a_400_naming_the_field(url):
    with manager(engine_secret=SECRET) as c:
        r = c.post(REG, json={"name": "ext-2", "url": url, "instance": "c" * 16}, headers=H)
        assert r.status_code == 400, r.text
        assert "url" in str(r.json()["error"]["param"])
        assert names(c) == {"engine-0": True}


def test_an_api_key_neither_opens_nor_blocks_engine_routes(engine_url):
    with manager(engine_secret=SECRET, api_key="sk-tenant") as c:
        key = {"Authorization": "Bearer sk-tenant"}
        a = {"name": "ext-1", "url": engine_url, "instance": "a" * 16}
        # a tenant's key is not an engine secret
        error(c.post(REG, json=a, headers=key), 401, "invalid_engine_secret")
        # engines need no API key, only the secret
        assert c.post(REG, json=a, headers=H).status_code == 200
        # listing engines is an operator's read: the API key guards it
        assert c.get("/api/v1/engines").status_code == 401
        assert names(c, key) == {"engine-0": True, "ext-1": True}


def test_ready_answers_whether_any_engine_can_run_work():
    with manager(engine_secret=SECRET, api_key="sk-tenant") as c:
        r = c.get("/ready")  # a probe: no API key needed
        assert r.status_code == 200 and r.json() == {"ready": True, "engines": ["engine-0"]}
        c.app.state.manager.registry.mark_dead("engine-0", "test")
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["ready"] is False


def test_the_secret_never_appears_in_settings_output():
    s = ServerSettings(engine_secret=SECRET)
    assert SECRET not in repr(s) and SECRET not in str(s.model_dump())
    with pytest.raises(ValueError):
        ServerSettings(engine_secret="short")
