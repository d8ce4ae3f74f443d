"""The OpenAI Responses API (/v1/responses) over HTTP with the fake engine: plain and streamed turns, the
official event sequence, previous_response_id conversations (per API key, TTL with an injected clock, LRU
bound), GET / DELETE and the 400s for what this server does not do (function tools: test_responses_tools.py)."""

from __future__ import annotations

import asyncio
import json

import jinja2
import pytest
from fastapi.testclient import TestClient

from parrot.api import ServerSettings, create_app
from parrot.manager import EngineRegistry, Manager, ManagerConfig
from parrot.manager.completions import CompletionService
from parrot.manager.responses_store import PreviousResponseNotFound, ResponsesService, ResponseSpec, ResponseStore
from fakes import CHAT_TEMPLATE, TAIL, FakeEngine

MODEL = "fake-model"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def engine():
    return FakeEngine(max_model_len=1024)


@pytest.fixture()
def clock():
    return Clock()


@pytest.fixture()
def client(engine, clock):
    settings = ServerSettings(engine_heartbeat_s=0, responses_ttl_s=600, max_stored_responses=3)
    with TestClient(create_app(settings, [engine], clock=clock), raise_server_exceptions=False) as c:
        yield c


def rendered(messages) -> str:
    return jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def create(client, **body) -> dict:
    r = client.post("/v1/responses", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(client, **body) -> list[tuple[str, dict]]:
    """(event name, data) per SSE event of a streamed response."""
    with client.stream("POST", "/v1/responses", json={"model": MODEL, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def output_text(body: dict) -> str:
    return "".join(part["text"] for item in body["output"] for part in item["content"])


def test_plain_response_renders_instructions_and_input_with_the_chat_template(client, engine):
    body = create(client, input="Hello", instructions="Be brief.")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert engine.tokenized[-1] == rendered(messages)
    assert output_text(body) == FakeEngine.reply_for(rendered(messages)) + TAIL
    assert body["object"] == "response" and body["status"] == "completed" and body["id"].startswith("resp_")
    item = body["output"][0]
    assert (item["type"], item["role"], item["status"]) == ("message", "assistant", "completed")
    assert item["content"][0]["type"] == "output_text" and item["content"][0]["annotations"] == []
    usage = body["usage"]
    assert usage["input_tokens"] == 1 + len(rendered(messages))
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert body["instructions"] == "Be brief." and body["store"] is True


def test_message_items_with_text_parts(client, engine):
    create(client, input=[{"role": "developer", "content": "rules"},
                          {"type": "message", "role": "user",
                           "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                          {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                           "content": [{"type": "output_text", "text": "c", "annotations": []}]},
                          {"role": "user", "content": "d"}])
    assert engine.tokenized[-1] == rendered([{"role": "developer", "content": "rules"},
                                             {"role": "user", "content": "a\nb"},
                                             {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}])


def test_max_output_tokens_makes_it_incomplete(client):
    body = create(client, input="Hello", max_output_tokens=5)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 5 and body["output"][0]["status"] == "incomplete"


def test_stream_sends_the_official_event_sequence(client):
    got = events(client, input="Hello", instructions="Be brief.")
    names = [name for name, _ in got]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert all(data["type"] == name for name, data in got)
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    final = got[-1][1]["response"]
    text = "".join(data["delta"] for name, data in got if name == "response.output_text.delta")
    assert text == output_text(final) == got[-4][1]["text"]
    plain = create(client, input="Hello", instructions="Be brief.")
    assert output_text(plain) == text and final["usage"]["output_tokens"] == plain["usage"]["output_tokens"]
    item_id = got[2][1]["item"]["id"]
    assert {data.get("item_id") for name, data in got if "content_part" in name or "text" in name} == {item_id}
    assert final["output"][0]["id"] == item_id and got[0][1]["response"]["status"] == "in_progress"


def test_stream_incomplete_and_failure(client, engine):
    got = events(client, input="Hello", max_output_tokens=3)
    assert got[-1][0] == "response.incomplete" and got[-1][1]["response"]["status"] == "incomplete"
    engine.fail_generate_when = "boom"
    got = events(client, input="boom")
    assert got[-1][0] == "response.failed"
    assert got[-1][1]["response"]["error"]["code"] == "engine_error"
    assert engine.contexts == {}


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(client, engine):
    system = {"role": "system", "content": "Answer in one line."}
    first = create(client, input="What is a parrot?", instructions=system["content"])
    second = create(client, input="And a crow?", previous_response_id=first["id"], instructions=system["content"])
    history = [{"role": "user", "content": "What is a parrot?"},
               {"role": "assistant", "content": output_text(first)}, {"role": "user", "content": "And a crow?"}]
    assert engine.tokenized[-1] == rendered([system, *history])
    assert second["previous_response_id"] == first["id"]
    # the first turn's tokens (prompt + output, in whole cache blocks) come from the engine's prefix cache
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= 64
    got = events(client, input="And a finch?", previous_response_id=second["id"])
    # instructions are per request (not carried over, as OpenAI does)
    assert engine.tokenized[-1] == rendered([*history, {"role": "assistant", "content": output_text(second)},
                                             {"role": "user", "content": "And a finch?"}])
    assert got[-1][1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 0  # the prefix changed


def test_get_delete_and_store_false(client):
    first = create(client, input="Hi")
    got = client.get(f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json() == first
    assert client.delete(f"/v1/responses/{first['id']}").json() == {"id": first["id"], "object": "response",
                                                                    "deleted": True}
    for r in (client.get(f"/v1/responses/{first['id']}"), client.delete(f"/v1/responses/{first['id']}")):
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    unstored = create(client, input="Hi", store=False)
    assert unstored["store"] is False
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": unstored["id"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
    assert r.json()["error"]["param"] == "previous_response_id"


def test_expiry_with_the_injected_clock_and_the_count_bound(client, clock):
    first = create(client, input="one")
    clock.t += 599
    create(client, input="two", previous_response_id=first["id"])  # still there
    clock.t += 2  # 601 s after its creation: gone
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": first["id"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
    ids = [create(client, input=f"n{i}")["id"] for i in range(4)]  # max_stored_responses=3: the oldest goes
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert all(client.get(f"/v1/responses/{i}").status_code == 200 for i in ids[1:])


def test_an_id_is_visible_to_its_api_key_only():
    engine = FakeEngine()

    async def main():
        mgr = Manager(EngineRegistry([engine]), config=ManagerConfig(engine_heartbeat_s=0))
        await mgr.start()
        try:
            service = ResponsesService(CompletionService(mgr.dispatcher), ResponseStore())
            spec = ResponseSpec(MODEL, [{"role": "user", "content": "hi"}], sampling={"temperature": 0.0})
            first = await service.complete(await service.plan(spec, "key-a"))
            follow = ResponseSpec(MODEL, [{"role": "user", "content": "more"}], previous_response_id=first.plan.id)
            assert (await service.plan(follow, "key-a")).history[-1]["content"] == first.text
            with pytest.raises(PreviousResponseNotFound):
                await service.plan(follow, "key-b")
            assert service.store.get("key-b", first.plan.id) is None
        finally:
            await mgr.stop()

    asyncio.run(main())


def test_the_api_key_owns_the_stored_responses():
    settings = ServerSettings(engine_heartbeat_s=0, api_key="k1")
    with TestClient(create_app(settings, [FakeEngine()]), raise_server_exceptions=False) as c:
        auth = {"Authorization": "Bearer k1"}
        r = c.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=auth)
        assert r.status_code == 200
        assert c.get(f"/v1/responses/{r.json()['id']}", headers=auth).status_code == 200
        other = c.get(f"/v1/responses/{r.json()['id']}", headers={"Authorization": "Bearer k2"})
        assert other.status_code == 401


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"truncation": "auto"}, "truncation"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
])
def test_unsupported_parts_are_400_naming_the_field(client, extra, param):
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_accepted_no_op_fields(client):
    body = create(client, input="hi", tools=[], tool_choice="auto", reasoning={"effort": None},
                  text={"format": {"type": "text"}}, truncation="disabled", metadata={"k": "v"}, user="u",
                  parallel_tool_calls=True)
    assert body["metadata"] == {"k": "v"}
