"""OpenAI chat with tools (LAMPS, issue 17): an answer whose finish reason is ``tool_calls`` pauses its context on
the engine (tool = the first call) instead of freeing it, streamed or not; a plain answer is freed; a forced call
carries its tool in the generate's hint; the follow-up request carrying the tool's result is served from the
paused context's KV (``usage.prompt_tokens_details.cached_tokens``), on the fake engine and on the builtin
engine with the tiny random model."""

from __future__ import annotations

import asyncio
import json

from fastapi.testclient import TestClient

from parrot.api import ServerSettings, create_app
from parrot.protocol.interface import ToolHint
from test_tool_calls_dag import PausingEngine, record_pauses

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
SYSTEM = ("You are a helpful assistant for travellers. You may call tools to look things up; answer in one short "
          "sentence once you know.")
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def first_turn(**extra):
    return {"model": "fake-model", "max_tokens": 60, "tools": TOOLS, "tool_choice": FORCED,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "What is the weather in Paris today?"}], **extra}


def follow_up(first: dict, answer: dict) -> dict:
    call = answer["choices"][0]["message"]["tool_calls"][0]
    messages = first["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
    return {"model": first["model"], "max_tokens": 8, "tools": first["tools"], "messages": messages}


def app(engine):
    return TestClient(create_app(ServerSettings(engine_heartbeat_s=0), [engine]))


def test_tool_call_answer_pauses_its_context_and_the_follow_up_is_served_from_it():
    eng = PausingEngine(max_model_len=4096)
    with app(eng) as c:
        body = first_turn()
        r = c.post("/v1/chat/completions", json=body).json()
        assert r["choices"][0]["finish_reason"] == "tool_calls"
        assert [p[0] for p in eng.pauses] and eng.pauses[0][1].name == "get_weather"
        ctx, _, tokens = eng.pauses[0]
        assert ctx not in eng.freed
        # the forced call was announced to the engine with the generate
        hint = next(h for c_, h in eng.hints if c_ == ctx)
        assert hint.tool == ToolHint("get_weather", None) and hint.predicted_output_tokens is not None
        r2 = c.post("/v1/chat/completions", json=follow_up(body, r)).json()
        cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= r["usage"]["prompt_tokens"] // 16 * 16 > 0
        assert r2["choices"][0]["finish_reason"] != "tool_calls"
        assert len(eng.pauses) == 1  # the plain answer was freed
        assert eng.freed_paused == [ctx]  # the follow-up took the paused KV: the pause is over
        stats = c.get("/api/v1/stats").json()["tools"]
    assert stats["pauses_requested"] == {"preserve": 1}
    # the pause (answer with the call -> follow-up with its result) was learned as the tool's duration
    assert c.app.state.manager.predictors.tool_durations.predict("get_weather") is not None
    assert stats["output_length"]["observations"] == 2


def test_streamed_tool_call_pauses_too_and_n_choices_do_not():
    eng = PausingEngine(max_model_len=4096)
    with app(eng) as c:
        with c.stream("POST", "/v1/chat/completions", json=first_turn(stream=True)) as resp:
            lines = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
        finish = [json.loads(ln[6:])["choices"][0].get("finish_reason") for ln in lines
                  if json.loads(ln[6:])["choices"]]
        assert "tool_calls" in finish
        assert len(eng.pauses) == 1 and eng.pauses[0][1].name == "get_weather"
        r = c.post("/v1/chat/completions", json=first_turn(n=2)).json()
        assert [ch["finish_reason"] for ch in r["choices"]] == ["tool_calls", "tool_calls"]
        assert len(eng.pauses) == 1  # several choices share a prompt: freed as before


def test_engine_without_pause_support_frees():
    from fakes import FakeEngine

    eng = FakeEngine(max_model_len=4096)
    with app(eng) as c:
        r = c.post("/v1/chat/completions", json=first_turn()).json()
        assert r["choices"][0]["finish_reason"] == "tool_calls"
        assert c.get("/api/v1/stats").json()["tools"]["pauses_requested"] == {"free": 1}
    assert len(eng.freed) == 1


def test_tiny_engine_follow_up_resumes_the_paused_context():
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.settings import EngineSettings

    client = build_local_engine_client(EngineSettings(random_model="tiny", dtype="float32", kv_cache_tokens=4096,
                                                      block_size=16))
    paused = record_pauses(client)
    model = client._info.name
    # a call whose arguments the grammar leaves little room in (a random model fills strings up to max_tokens)
    tools = TOOLS + [{"type": "function", "function": {"name": "is_open", "parameters": {
        "type": "object", "properties": {"open": {"type": "boolean"}}, "required": ["open"]}}}]
    try:
        with app(client) as c:
            body = first_turn(model=model, max_tokens=40, tools=tools,
                              tool_choice={"type": "function", "function": {"name": "is_open"}})
            r = c.post("/v1/chat/completions", json=body).json()
            assert r["choices"][0]["finish_reason"] == "tool_calls", r
            assert len(paused) == 1 and paused[0] is not None
            r2 = c.post("/v1/chat/completions", json=follow_up(body, r)).json()
            stats = c.get("/api/v1/stats").json()["tools"]
        engine_pauses = asyncio.run(client.status()).extra["tool_pauses"]
    finally:
        asyncio.run(client.close())
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    # at least every whole block of the first prompt (the rendered call may differ from the generated one after it)
    assert cached >= r["usage"]["prompt_tokens"] // 16 * 16 > 0
    assert stats["pauses_requested"] == {paused[0].handling: 1}
    by_handling = engine_pauses["by_handling"]
    assert by_handling[paused[0].handling] == sum(by_handling.values()) == 1
    assert engine_pauses["paused"] == 0, engine_pauses  # resumed by the engine, or released after the follow-up


def test_paused_chats_match_follow_ups_by_prompt_and_stay_bounded():
    from parrot.manager.tool_context import HEAD_TOKENS, PROMPT_SLACK, PausedChats

    now = [0.0]
    chats = PausedChats(max_entries=2, ttl_s=10, clock=lambda: now[0])
    a = list(range(100, 100 + HEAD_TOKENS + 20))
    b = list(range(100, 100 + HEAD_TOKENS)) + [7] * 20  # same head, another conversation
    chats.add("e0", None, "ctx-a", a)
    chats.add("e0", None, "ctx-b", b)
    chats.add("e0", None, "short", a[:HEAD_TOKENS - 1])  # too short to tell apart: not kept
    assert len(chats) == 2
    assert chats.take(a[:-PROMPT_SLACK - 1] + [1, 2]) == []  # diverges before the slack: not a follow-up of a
    follow = a[:-PROMPT_SLACK] + [5] * 30  # the re-rendered generation header may differ
    assert [p.context_id for p in chats.take(follow)] == ["ctx-a"]
    assert chats.take(follow) == [] and len(chats) == 1
    now[0] = 11.0
    assert chats.take(b + [1]) == [] and len(chats) == 0  # expired
    for i in range(3):
        chats.add("e0", None, f"c{i}", [i] * (HEAD_TOKENS + 1))
    assert len(chats) == 2 and chats.take([0] * (HEAD_TOKENS + 9)) == []  # the oldest was dropped
