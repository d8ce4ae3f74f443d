"""vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) over HTTP with the fake engine."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from parrot.api import ServerSettings, create_app
from fakes import BOS, FakeEngine

MODEL = "fake-model"


@pytest.fixture()
def client():
    with TestClient(create_app(ServerSettings(engine_heartbeat_s=0), [FakeEngine(max_model_len=300)]),
                    raise_server_exceptions=False) as c:
        yield c


def test_tokenize_prompt_counts_as_completions_do(client):
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "héllo"})
    ids = [BOS, *FakeEngine.encode("héllo")]
    assert r.json() == {"count": len(ids), "max_model_len": 300, "tokens": ids}
    done = client.post("/v1/completions", json={"model": MODEL, "prompt": "héllo", "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == len(ids)
    raw = client.post("/tokenize", json={"prompt": "héllo", "add_special_tokens": False}).json()
    assert raw["tokens"] == ids[1:]  # no BOS; model left out: the one served model
    assert client.post("/tokenize", json={"prompt": ""}).json()["count"] == 1


def test_tokenize_messages_counts_as_chat_does(client):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = client.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert r["count"] == chat["usage"]["prompt_tokens"]
    bare = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] == r["count"] - len("<|assistant|>")
    # vLLM's chat controls count as chat counts them: the last message left open (no "\n" after it)
    follow = [*messages, {"role": "assistant", "content": "Par"}]
    opened = {"messages": follow, "add_generation_prompt": False, "continue_final_message": True}
    cont = client.post("/tokenize", json=opened).json()
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, **opened}).json()
    assert cont["count"] == chat["usage"]["prompt_tokens"] == bare["count"] + len("<|assistant|>Par")
    both = client.post("/tokenize", json={**opened, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    reserved = client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"messages": []}})
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs.messages"


def test_detokenize_round_trip_and_errors(client):
    ids = client.post("/tokenize", json={"prompt": "a b c", "add_special_tokens": False}).json()["tokens"]
    assert client.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": "a b c"}
    for path, body, status, code, param in [
        ("/detokenize", {"tokens": [5, 9999]}, 400, "invalid_request", "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "invalid_request", "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [5]}, 404, "model_not_found", "model"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model_not_found", "model"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request",
         "prompt"),
        ("/tokenize", {}, 400, "invalid_request", "prompt"),
        ("/tokenize", {"prompt": "x", "extra": 1}, 400, "invalid_request", "extra"),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == status, (body, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)


def test_tokenizer_info(client):
    info = client.get("/tokenizer_info").json()
    assert info["model_max_length"] == 300 and info["add_bos_token"] is True
    assert info["chat_template"] and set(info) >= {"eos_token", "bos_token", "pad_token"}


def test_several_models_need_a_name_and_auth_applies():
    engines = [FakeEngine("e0", model="m0"), FakeEngine("e1", model="m1")]
    settings = ServerSettings(engine_heartbeat_s=0, api_key="k")
    with TestClient(create_app(settings, engines), raise_server_exceptions=False) as c:
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
        auth = {"Authorization": "Bearer k"}
        r = c.post("/tokenize", json={"prompt": "x"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert c.post("/tokenize", json={"model": "m1", "prompt": "x"}, headers=auth).json()["count"] == 2
