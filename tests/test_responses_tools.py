"""Function tools on the Responses API (/v1/responses) against a real server on the default model (SmolLM2-135M,
greedy): a forced call is a ``function_call`` output item whose arguments match the tool's schema; its result
goes back as a ``function_call_output`` item via ``previous_response_id`` and via the whole history; the
streamed call's events come in the order (and with the indexes) the openai package's stream reader takes; the
answer with the call pauses its context on the engine and the follow-up is served from it (LAMPS, as chat
completions do); bad tool shapes are 400s naming the field. ``tool_choice: "auto"`` (text, then a ``<tool_call>``
block: a message item, then a call item) runs on a real server over a scripted fake engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from servers import serve
from test_tool_calls_dag import record_pauses

pytestmark = pytest.mark.model

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
TIME = {"type": "function", "name": "get_time", "description": "The current time.",
        "parameters": {"type": "object", "properties": {}}}
INSTRUCTIONS = "You are a helpful assistant for travellers. Use the tools to look things up."
QUESTION = "What is the weather in Paris today?"
FORCED = {"type": "function", "name": "get_weather"}
RESULT = json.dumps({"temp_c": 18, "sky": "clear"})


@pytest.fixture(scope="module")
def real_server(default_model_path):
    """A real server on the default model; yields (base URL, the engine's recorded pauses)."""
    from parrot.api import ServerSettings, create_app
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.settings import EngineSettings

    engine = build_local_engine_client(EngineSettings(model=default_model_path, kv_cache_tokens=8192,
                                                      num_threads=1))
    paused = record_pauses(engine)
    try:
        with serve(create_app(ServerSettings(engine_heartbeat_s=0), [engine])) as url:
            yield url, paused
    finally:
        asyncio.run(engine.close())


@pytest.fixture(scope="module")
def url(real_server) -> str:
    return real_server[0]


@pytest.fixture(scope="module")
def model(url) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def create(url: str, model: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/responses", json={"model": model, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def first_turn(**extra) -> dict:
    return {"instructions": INSTRUCTIONS, "input": QUESTION, "tools": [WEATHER, TIME], "tool_choice": FORCED,
            "max_output_tokens": 40, **extra}


def only_call(body: dict) -> dict:
    calls = [item for item in body["output"] if item["type"] == "function_call"]
    assert len(calls) == 1, body["output"]
    return calls[0]


def check_call(call: dict, name: str = "get_weather") -> dict:
    """The call item's shape; its arguments: a JSON object matching WEATHER's schema."""
    assert set(call) == {"id", "type", "status", "arguments", "call_id", "name"}
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_") and call["name"] == name
    assert call["status"] == "completed"
    args = json.loads(call["arguments"])
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 24
    return args


def stats(url: str) -> dict:
    return httpx.get(f"{url}/api/v1/stats").json()["tools"]


def test_forced_call_is_a_function_call_item_and_its_output_continues_by_previous_response_id(real_server, model):
    url, paused = real_server
    before = stats(url)["pauses_requested"]
    first = create(url, model, **first_turn())
    assert first["status"] == "completed" and first["tool_choice"] == FORCED
    assert [t["name"] for t in first["tools"]] == ["get_weather", "get_time"] and first["parallel_tool_calls"] is True
    assert [item["type"] for item in first["output"]] == ["function_call"]  # a forced call writes no message
    call = only_call(first)
    check_call(call)
    # LAMPS: the answer ending in the call paused its context on the engine for the tool (as chat does)
    after = stats(url)["pauses_requested"]
    assert sum(after.values()) == sum(before.values()) + 1 and paused and paused[-1] is not None
    handling = paused[-1].handling
    assert after[handling] == before.get(handling, 0) + 1

    second = create(url, model, instructions=INSTRUCTIONS, previous_response_id=first["id"], max_output_tokens=12,
                    tools=[WEATHER, TIME], input=[{"type": "function_call_output", "call_id": call["call_id"],
                                                   "output": RESULT}])
    assert second["previous_response_id"] == first["id"] and second["tool_choice"] == "auto"
    assert [item["type"] for item in second["output"]] == ["message"]
    assert second["output"][0]["content"][0]["text"]
    # the follow-up renders the paused prompt plus the call and its result: the engine serves the head from it
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["input_tokens"] // 16 * 16 > 0
    assert sum(stats(url)["pauses_requested"].values()) == sum(after.values())  # a plain answer is freed

    # the same second turn with the whole history in ``input`` (as the Agents SDK sends it) renders the same prompt
    history = [{"role": "user", "content": QUESTION}, call,
               {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT}]
    again = create(url, model, instructions=INSTRUCTIONS, max_output_tokens=12, tools=[WEATHER, TIME], input=history)
    assert again["usage"]["input_tokens"] == second["usage"]["input_tokens"]
    assert again["output"][0]["content"][0]["text"] == second["output"][0]["content"][0]["text"]
    stored = httpx.get(f"{url}/v1/responses/{first['id']}").json()
    assert stored["output"] == first["output"]


def test_required_choice_honours_parallel_tool_calls_false(url, model):
    body = create(url, model, **first_turn(tool_choice="required", tools=[WEATHER], parallel_tool_calls=False))
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    check_call(only_call(body))


def sse(url: str, model: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{url}/v1/responses", json={"model": model, "temperature": 0, "stream": True,
                                                            **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append(data)
    return events


def test_streamed_call_events_in_the_order_the_sdk_reads(url, model):
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    events = sse(url, model, first_turn())
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 2  # the forced call's arguments stream as the engine writes them
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]  # the openai package's types
    added, done, item_done, completed = parsed[2], parsed[-3], parsed[-2], parsed[-1]
    assert added.item.type == "function_call" and added.item.status == "in_progress" and added.item.arguments == ""
    assert {e.output_index for e in parsed[2:-1]} == {0} and {e.item_id for e in parsed[3:-2]} == {added.item.id}
    streamed = "".join(e.delta for e in parsed[3:-3])
    assert json.loads(streamed) == json.loads(done.arguments)
    assert item_done.item.call_id == added.item.call_id and item_done.item.status == "completed"
    final = completed.response.output
    assert len(final) == 1 and final[0].call_id == added.item.call_id and final[0].arguments == done.arguments
    check_call(final[0].model_dump(exclude_none=True))
    # the stored response is the streamed one: a follow-up by previous_response_id continues it
    follow = create(url, model, previous_response_id=completed.response.id, max_output_tokens=4,
                    input=[{"type": "function_call_output", "call_id": final[0].call_id, "output": RESULT}])
    assert follow["status"] in ("completed", "incomplete") and follow["output"][0]["type"] == "message"


def test_streamed_required_call_comes_whole_at_the_end(url, model):
    events = sse(url, model, first_turn(tool_choice="required"))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    check_call(events[-1]["response"]["output"][0])


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function"),  # the chat shape
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": FORCED}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": FORCED, "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "x": 1}]}, "input[0].x"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input[0].output[0].type"),
])
def test_bad_tool_shapes_are_400_naming_the_field(url, model, extra, param):
    r = httpx.post(f"{url}/v1/responses", json={"model": model, "input": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ---- "auto": text, then a <tool_call> block (a scripted engine: SmolLM2 rarely chooses a tool by itself) ---------
AUTO_REPLY = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted():
    """A real server on a fake engine that answers AUTO_REPLY to a prompt offering tools (and pauses contexts)."""
    from test_tool_calls_dag import PausingEngine

    from parrot.api import ServerSettings, create_app

    class Scripted(PausingEngine):
        def _answer(self, context_text, sampling):
            return AUTO_REPLY if "get_weather" in context_text and "temp_c" not in context_text \
                else super()._answer(context_text, sampling)

    engine = Scripted(max_model_len=4096)
    with serve(create_app(ServerSettings(engine_heartbeat_s=0), [engine])) as base:
        yield base, engine


def test_auto_choice_reads_a_tool_call_block_after_the_text_plain_and_streamed(scripted):
    base, engine = scripted
    body = {"instructions": INSTRUCTIONS, "input": QUESTION, "tools": [WEATHER]}
    plain = create(base, "fake-model", **body)
    assert [item["type"] for item in plain["output"]] == ["message", "function_call"]
    assert plain["output"][0]["content"][0]["text"] == "Let me check. "  # as streamed: up to the block
    assert json.loads(plain["output"][1]["arguments"]) == {"city": "Lyon"} and plain["tool_choice"] == "auto"
    assert engine.pauses[-1][1].name == "get_weather"  # not forced, but it ended in a call: paused all the same

    events = sse(base, "fake-model", body)
    kinds = [e["type"] for e in events]
    text = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and len(text) >= 2
    assert kinds[4 + len(text):] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    # the message is item 0 (its text stops before the block: no "<tool_call>" reaches the client), the call item 1
    assert "".join(e["delta"] for e in text) == "Let me check. "
    assert {e["output_index"] for e in events[2:4 + len(text) + 3]} == {0}
    assert {e["output_index"] for e in events[-5:-1]} == {1}
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == events[-2]["item"]["call_id"] == events[-5]["item"]["call_id"]

    # the tool's result by previous_response_id: the stored turn's call is in the prompt, then the result
    second = create(base, "fake-model", instructions=INSTRUCTIONS, previous_response_id=final["id"], tools=[WEATHER],
                    input=[{"type": "function_call_output", "call_id": final["output"][1]["call_id"],
                            "output": RESULT}])
    assert [item["type"] for item in second["output"]] == ["message"]
    prompt = engine.tokenized[-1]
    assert prompt.index("Let me check.") < prompt.index('"city": "Lyon"') < prompt.index('"temp_c": 18')
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
