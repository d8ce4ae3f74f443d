"""Structured output and tool calls end to end on the real default model (SmolLM2-135M-Instruct in an in-process
engine behind a real uvicorn server): every constrained answer of a concurrent mixed batch obeys its constraint,
streams carry only valid prefixes, the official ``openai`` client's ``parse`` and LangChain's
``with_structured_output`` (json_schema and function_calling) return parsed objects, forced tool calls carry
arguments that validate, a conversation with tool results renders, and bad constraints are 400s naming the field.

Validity oracle: llguidance's matcher over a byte vocabulary (one token per byte), fed the answer's bytes: a
prefix is valid iff no byte is rejected, a whole answer iff it is accepted at the end. Independent of the
engine's tokenizer and masks."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import llguidance
import openai
import pytest
from pydantic import BaseModel, Field

from parrot.api import ServerSettings, create_app
from parrot.common.constraints import Constraint
from servers import serve

pytestmark = pytest.mark.model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                         "parameters": {"type": "object", "properties": {
                                             "timezone": {"type": "string", "maxLength": 24}},
                                             "required": ["timezone"], "additionalProperties": False}}}
ASK_PERSON = [{"role": "user", "content": "Give me a JSON object for a person called Ada who is 36."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=150)


class Color(BaseModel):
    color: Literal["red", "green", "blue"]
    shade: int = Field(ge=0, le=9)


# ---- oracle -----------------------------------------------------------------------------------------------------
class _Bytes:
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]

    def __call__(self, text: str) -> list[int]:
        return list(text.encode())


_BYTE_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def accepts(constraint: Constraint, text: str, *, whole: bool = True) -> bool:
    """``text`` is a valid prefix (``whole=False``) or a complete value of ``constraint``."""
    m = llguidance.LLMatcher(_BYTE_TOKENIZER, constraint.llguidance_grammar())
    ok = m.consume_tokens(list(text.encode())) and not m.is_error()
    return ok and (m.is_accepting() or not whole)


def check_person(value: dict) -> None:
    assert set(value) == {"name", "age"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 16
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150


def check_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("celsius",
                                                                                               "fahrenheit")


# ---- server -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(default_model_path):
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.settings import EngineSettings

    engine = build_local_engine_client(EngineSettings(model=default_model_path, kv_cache_tokens=8192, num_threads=1))
    try:
        with serve(create_app(ServerSettings(engine_heartbeat_s=0), [engine])) as url:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            yield url, model
    finally:
        asyncio.run(engine.close())


@pytest.fixture()
def oai(real):
    return openai.OpenAI(base_url=real[0] + "/v1", api_key="none", max_retries=0, timeout=300)


# ---- 400s over HTTP ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
    ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/chat/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/chat/completions", {"guided_grammar": "start: ("}, "guided_grammar"),
    ("/v1/chat/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
])
def test_bad_constraints_are_400_naming_the_field(real, path, body, param):
    url, model = real
    prompt = {"prompt": "x"} if path == "/v1/completions" else {"input": "x"} if path == "/v1/responses" else {
        "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(url + path, json={"model": model, **prompt, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- a concurrent batch of mixed constraints --------------------------------------------------------------------
def test_concurrent_mixed_constraints_each_obeyed(real):
    url, model = real
    phone = r"\d{3}-\d{4}"
    chat = {"model": model, "temperature": 0.7, "seed": 3, "max_tokens": 60}
    jobs = {
        "schema": ("/v1/chat/completions", {**chat, "messages": ASK_PERSON, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}}),
        "schema2": ("/v1/chat/completions", {**chat, "messages": ASK_PERSON, "guided_json": PERSON, "seed": 4}),
        "object": ("/v1/completions", {**chat, "prompt": "A JSON object describing a cat:", "response_format": {
            "type": "json_object"}, "max_tokens": 80}),
        "regex": ("/v1/completions", {**chat, "prompt": "Call me at ", "guided_regex": phone}),
        "choice": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "Is fire hot?"}],
                                            "guided_choice": ["yes", "no", "maybe"]}),
        "none": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "Say hi."}],
                                          "max_tokens": 12}),
    }

    def run(item):
        name, (path, body) = item
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, (name, r.text)
        choice = r.json()["choices"][0]
        return name, choice.get("text", (choice.get("message") or {}).get("content")), choice["finish_reason"]

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = {name: (text, reason) for name, text, reason in pool.map(run, jobs.items())}
    for name in ("schema", "schema2"):
        text, reason = answers[name]
        assert reason == "stop", (name, text)
        check_person(json.loads(text))
        assert accepts(Constraint.json_schema(PERSON), text)
    text, reason = answers["object"]
    assert reason == "stop" and isinstance(json.loads(text), dict), text
    text, reason = answers["regex"]
    assert reason == "stop" and re.fullmatch(phone, text), text
    text, reason = answers["choice"]
    assert reason == "stop" and text in ("yes", "no", "maybe"), text
    text, reason = answers["none"]
    assert isinstance(text, str) and reason in ("stop", "length")


# ---- streaming ----------------------------------------------------------------------------------------------------
def test_stream_yields_only_valid_prefixes(oai, real):
    schema_constraint = Constraint.json_schema(PERSON)
    stream = oai.chat.completions.create(
        model=real[1], messages=ASK_PERSON, temperature=0, max_tokens=60, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            assert accepts(schema_constraint, text, whole=False), text
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop" and accepts(schema_constraint, text)
    check_person(json.loads(text))

    choices = ["alpha", "beta", "gamma"]
    stream = oai.completions.create(model=real[1], prompt="Pick a Greek letter:", max_tokens=10, stream=True,
                                    temperature=0, extra_body={"guided_choice": choices})
    text = ""
    for chunk in stream:
        text += chunk.choices[0].text
        assert any(c.startswith(text) for c in choices), text
    assert text in choices


# ---- official client and LangChain --------------------------------------------------------------------------------
def test_openai_client_parse(oai, real):
    completion = oai.chat.completions.parse(model=real[1], messages=ASK_PERSON, response_format=Person,
                                            temperature=0, max_tokens=60)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person)

    response = oai.responses.parse(model=real[1], input="Pick a colour and a shade from 0 to 9.", text_format=Color,
                                   temperature=0, max_output_tokens=40)
    assert isinstance(response.output_parsed, Color)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(real, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=real[0] + "/v1", api_key="none", model=real[1], temperature=0, max_tokens=60,
                     max_retries=0, timeout=300)
    result = llm.with_structured_output(Person, method=method).invoke(ASK_PERSON[0]["content"])
    assert isinstance(result, Person)


# ---- tools --------------------------------------------------------------------------------------------------------
def test_named_tool_choice_is_one_call_with_valid_arguments(oai, real):
    r = oai.chat.completions.create(model=real[1], messages=ASK_WEATHER, tools=[WEATHER, TIME], temperature=0,
                                    max_tokens=60, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    check_weather_args(call.function.arguments)

    # streamed: the arguments arrive as fragments of one call and join to the same kind of value
    stream = oai.chat.completions.create(model=real[1], messages=ASK_WEATHER, tools=[WEATHER], temperature=0,
                                        max_tokens=60, stream=True,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    arguments, names, reasons = "", [], []
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                names += [tc.function.name] if tc.function.name else []
                arguments += tc.function.arguments or ""
            reasons.append(c.finish_reason)
    assert names == ["get_weather"] and reasons[-1] == "tool_calls"
    check_weather_args(arguments)


def test_required_tool_choice_calls_one_of_the_tools(oai, real):
    r = oai.chat.completions.create(model=real[1], messages=ASK_WEATHER, tools=[WEATHER, TIME], temperature=0,
                                    max_tokens=80, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    tool = WEATHER if call.function.name == "get_weather" else TIME
    assert accepts(Constraint.json_schema(tool["function"]["parameters"]), call.function.arguments)

    stream = oai.chat.completions.create(model=real[1], messages=ASK_WEATHER, tools=[WEATHER, TIME], temperature=0,
                                        max_tokens=80, tool_choice="required", parallel_tool_calls=False, stream=True)
    calls = [tc for chunk in stream for c in chunk.choices for tc in c.delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].function.name == call.function.name


def test_conversation_with_tool_results_renders_and_answers(oai, real):
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    r = oai.chat.completions.create(model=real[1], messages=messages, tools=[WEATHER, TIME], temperature=0,
                                    max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # the rendered prompt holds the tool block, the earlier call and its result
    without = oai.chat.completions.create(model=real[1], messages=ASK_WEATHER, temperature=0, max_tokens=1)
    assert r.usage.prompt_tokens > without.usage.prompt_tokens + 100


def test_responses_text_format_json_schema(real):
    url, model = real
    r = httpx.post(url + "/v1/responses", timeout=300, json={
        "model": model, "input": ASK_PERSON[0]["content"], "temperature": 0, "max_output_tokens": 60,
        "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed" and body["text"]["format"]["type"] == "json_schema"
    check_person(json.loads(body["output"][0]["content"][0]["text"]))
