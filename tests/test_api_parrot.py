"""Parrot API over HTTP (TestClient, fake engine): flows, error mapping (status + code), auth, body limit."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from parrot.api import ServerSettings, create_app
from parrot.common.errors import StepFailed, error_from_body
from fakes import FakeEngine

API = "/api/v1"


@pytest.fixture()
def engine():
    return FakeEngine()


@pytest.fixture()
def client(engine):
    app = create_app(ServerSettings(engine_heartbeat_s=0, max_body_bytes=2048), [engine])
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


class Session:
    """A tiny HTTP helper for one session (keeps tests readable)."""

    def __init__(self, client: TestClient):
        r = client.post(f"{API}/sessions", json={"ttl_s": 60})
        assert r.status_code == 200, r.text
        body = r.json()
        self.c, self.sid, self.token = client, body["session_id"], body["token"]
        self.h = {"X-Parrot-Session-Token": self.token}
        self.base = f"{API}/sessions/{self.sid}"

    def var(self, name=None, value=None):
        r = self.c.post(f"{self.base}/variables", json={"name": name, "value": value}, headers=self.h)
        assert r.status_code == 200, r.text
        return r.json()["var_id"]

    def submit(self, prompt, placeholders, **extra):
        return self.c.post(f"{self.base}/submit", json={"prompt": prompt, "placeholders": placeholders, **extra},
                           headers=self.h)

    def get(self, vid, **params):
        return self.c.get(f"{self.base}/variables/{vid}", params=params, headers=self.h)


def _err(r, status, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["code"] == code, body
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def test_snake_game_flow_runs_dependent_call_server_side(client):
    s = Session(client)
    task = s.var("task", "a snake game")
    r1 = s.submit("Write python code of {{input:task}}.\nCode: {{output:code}}\n",
                  [{"name": "task", "is_output": False, "var_id": task},
                   {"name": "code", "is_output": True, "sampling": {"max_tokens": 64},
                    "transforms": [{"op": "strip"}]}],
                  name="write_code")
    assert r1.status_code == 200, r1.text
    code = r1.json()["outputs"]["code"]
    r2 = s.submit("Test code for {{input:task}}. Code: {{input:code}}.\nTest: {{output:test}}",
                  [{"name": "task", "is_output": False, "var_id": task},
                   {"name": "code", "is_output": False, "var_id": code},
                   {"name": "test", "is_output": True, "sampling": {"max_tokens": 64}}], name="write_test")
    test = r2.json()["outputs"]["test"]
    got_test = s.get(test, criteria="latency", timeout=10).json()
    fetched_code_at = time.time()
    got_code = s.get(code, criteria="latency").json()
    assert got_code["status"] == "ready"
    # the space before an output is left for the model to generate; before an input it leads the value
    assert got_code["value"] == FakeEngine.reply_for("Write python code of a snake game.\nCode:")
    assert got_test["value"].startswith(FakeEngine.reply_for(
        f"Test code for a snake game. Code: {got_code['value']}.\nTest:"))
    dag = client.get(f"{s.base}/dag", headers=s.h).json()
    r_test = next(r for r in dag["requests"] if r["request_id"] == r2.json()["request_id"])
    assert r_test["timestamps"]["dispatched"] < fetched_code_at  # never waited for the client
    assert "%3 = r_2 write_test(test) <- %1, %2  [finished, engine fake0, get:latency]" in dag["text"]
    assert [v["perf"] for v in dag["variables"]] == [None, "latency", "latency"]


def test_long_poll_pending_and_set_variable(client):
    s = Session(client)
    x = s.var("x")
    t0 = time.monotonic()
    r = s.get(x, timeout=0.3, criteria="throughput")
    assert r.status_code == 200 and r.json() == {"var_id": x, "name": "x", "status": "pending", "value": None}
    assert time.monotonic() - t0 >= 0.3
    r = client.put(f"{s.base}/variables/{x}", json={"value": "v"}, headers=s.h)
    assert r.json()["status"] == "ready"
    _err(client.put(f"{s.base}/variables/{x}", json={"value": "w"}, headers=s.h), 409, "variable_already_set")
    assert s.get(x).json()["value"] == "v"


def test_failed_step_is_424_with_root_cause_at_every_dependent(client, engine):
    engine.fail_generate_when = "BOOM"
    s = Session(client)
    x = s.var("x", "BOOM")
    y = s.submit("{{input:x}} {{output:y}}", [{"name": "x", "is_output": False, "var_id": x},
                                             {"name": "y", "is_output": True}]).json()["outputs"]["y"]
    z = s.submit("{{input:y}} {{output:z}}", [{"name": "y", "is_output": False, "var_id": y},
                                             {"name": "z", "is_output": True}]).json()["outputs"]["z"]
    for vid in (y, z):
        err = _err(s.get(vid, timeout=10), 424, "step_failed")
        assert err["cause"] == "engine_error" and err["type"] == "step_failed"
    rebuilt = error_from_body(424, s.get(z).json())
    assert isinstance(rebuilt, StepFailed) and rebuilt.cause_code == "engine_error"


def test_error_classes_map_to_status_and_code(client):
    s = Session(client)
    v = s.var("v")
    out = {"name": "o", "is_output": True}
    _err(client.get(f"{API}/sessions/s_unknown/dag", headers=s.h), 404, "unknown_session")
    _err(client.get(f"{s.base}/dag", headers={"X-Parrot-Session-Token": "nope"}), 401, "invalid_session_token")
    _err(client.get(f"{s.base}/dag"), 401, "invalid_session_token")
    _err(s.get("v_404"), 404, "unknown_variable")
    _err(s.submit("{{input:i}} {{output:o}}", [{"name": "i", "is_output": False, "var_id": "v_404"}, out]),
         404, "unknown_variable")
    # a cycle: v -> r_1 -> w, then a request consuming w that produces into v
    w = s.submit("{{input:i}} {{output:o}}",
                 [{"name": "i", "is_output": False, "var_id": v}, out]).json()["outputs"]["o"]
    _err(s.submit("{{input:i}} {{output:o}}", [{"name": "i", "is_output": False, "var_id": w},
                                               {"name": "o", "is_output": True, "var_id": v}]), 400, "cycle")
    _err(s.submit("{{output:o", [out]), 400, "bad_template")
    _err(s.submit("{{output:o}}", [out, {"name": "extra", "is_output": True}]), 400, "bad_template")
    _err(s.submit("{{output:o}}", [{**out, "sampling": {"temperature": -1}}]), 400, "bad_sampling_params")
    _err(s.submit("{{output:o}}", [{**out, "transforms": [{"op": "eval"}]}]), 400, "bad_transform")
    _err(s.submit("{{output:o}}", [out], models=["no-such-model"]), 404, "model_not_found")
    err = _err(s.submit("{{output:o}}", [{"name": "o"}]), 400, "invalid_request")  # pydantic validation
    assert "is_output" in err["param"]
    _err(client.post(f"{s.base}/submit", content=b"{not json", headers={**s.h, "content-type": "application/json"}),
         400, "invalid_request")
    err = _err(s.submit("{{output:o}}", [out], surprise=1), 400, "invalid_request")
    assert err["param"] == "surprise"
    _err(s.get(v, criteria="fastest"), 400, "invalid_request")
    _err(s.get(v, timeout=-1), 400, "invalid_request")
    _err(client.get("/no/such/route"), 404, "not_found")
    _err(client.post(f"{API}/sessions", json={"ttl_s": 0}), 400, "invalid_request")


def test_internal_errors_are_500_and_logged(client, engine, caplog):
    async def broken_tokenize(text):
        raise RuntimeError("tokenizer exploded")

    engine.tokenize = broken_tokenize
    with caplog.at_level("ERROR"):
        err = _err(client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"}), 500, "internal_error")
    assert "RuntimeError" in err["message"]
    assert any("crashed" in rec.getMessage() for rec in caplog.records)


def test_delete_session_frees_contexts(client, engine):
    s = Session(client)
    s.submit("{{output:o}}", [{"name": "o", "is_output": True, "sampling": {"max_tokens": 4}}])
    r = client.delete(s.base, headers=s.h)
    assert r.json() == {"deleted": True}
    assert engine.contexts == {}
    _err(client.get(f"{s.base}/dag", headers=s.h), 404, "unknown_session")


def test_body_limit_413_by_header_and_by_actual_size(client):
    s = Session(client)
    big = "x" * 4000
    _err(s.submit(big + "{{output:o}}", [{"name": "o", "is_output": True}]), 413, "payload_too_large")

    def chunks():  # no Content-Length: the limit counts the bytes that arrive
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'", "placeholders": []}'

    r = client.post(f"{s.base}/submit", content=chunks(), headers={**s.h, "content-type": "application/json"})
    _err(r, 413, "payload_too_large")
    ok = s.submit("small {{output:o}}", [{"name": "o", "is_output": True}])
    assert ok.status_code == 200


def test_api_key_required_everywhere_but_health(engine):
    app = create_app(ServerSettings(engine_heartbeat_s=0, api_key="sk-secret"), [engine])
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        _err(c.get("/v1/models"), 401, "invalid_api_key")
        _err(c.post(f"{API}/sessions", headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
        r = c.post(f"{API}/sessions", headers={"Authorization": "Bearer sk-secret"})
        assert r.status_code == 200
        models = c.get("/v1/models", headers={"Authorization": "Bearer sk-secret"}).json()
        assert models["data"][0]["id"] == "fake-model"


def test_unhealthy_engine_is_503_until_a_heartbeat(client):
    registry = client.app.state.manager.registry
    for entry in registry.entries():
        entry.healthy = False
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 2}
    _err(client.post("/v1/completions", json=body), 503, "engine_unavailable")
    assert client.get("/health").json()["engines"][0]["healthy"] is False
    client.portal.call(registry.refresh)  # one heartbeat, on the app's event loop
    assert client.post("/v1/completions", json=body).status_code == 200


def test_chat_template_is_sandboxed_and_required():
    from parrot.api.openai_shapes import message_dicts
    from parrot.api.schemas import ChatMessage
    from parrot.manager.chat_template import ChatRenderer, ChatTemplateError

    r = ChatRenderer()
    msgs = message_dicts([ChatMessage(role="user", content="hi")])
    assert r.render("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}", msgs) == "[user]hi"
    with pytest.raises(ChatTemplateError) as e:
        r.render("{{ ''.__class__.__mro__[1].__subclasses__() }}", msgs)
    assert e.value.status_code == 400
    with pytest.raises(ChatTemplateError, match="rejected"):
        r.render("{{ raise_exception('roles must alternate') }}", msgs)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        r.render(None, msgs)
