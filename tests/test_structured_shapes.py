"""Structured output and tools, pure mapping: request fields -> the one constraint (and the 400s naming the
field), tools / tool_choice -> the tool plan and its constraint, output text -> tool calls (whole and streamed),
and rendering tools into a chat template that knows them and one that does not."""

from __future__ import annotations

import json

import pytest

from parrot.api.openai_shapes import _ToolDeltas, chat_spec, completion_spec, message_dicts
from parrot.api.responses_shapes import response_spec, text_body
from parrot.api.schemas import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from parrot.common.constraints import Constraint, ConstraintKind
from parrot.common.errors import BadSamplingParams, InvalidRequestError
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.manager.chat_template import ChatRenderer
from parrot.manager.tool_calls import AutoCallStream, ToolChoice, plan_tools, polyfill_messages

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "p", **fields})


def constraint_of(spec) -> Constraint | None:
    return SamplingParams.from_dict({**spec.choices.sampling, "max_tokens": 1}).constraint


# ---- response_format and vLLM's fields -----------------------------------------------------------------------
@pytest.mark.parametrize("fields, kind, spec", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     ConstraintKind.JSON_SCHEMA, Constraint.json_schema(SCHEMA).spec),
    ({"response_format": {"type": "json_object"}}, ConstraintKind.JSON_OBJECT, ""),
    ({"guided_json": SCHEMA}, ConstraintKind.JSON_SCHEMA, Constraint.json_schema(SCHEMA).spec),
    ({"guided_json": json.dumps(SCHEMA)}, ConstraintKind.JSON_SCHEMA,
     Constraint.json_schema(SCHEMA).spec),
    ({"guided_regex": "[0-9]{3}"}, ConstraintKind.REGEX, "[0-9]{3}"),
    ({"guided_choice": ["yes", "no"]}, ConstraintKind.CHOICE, '["yes", "no"]'),
    ({"guided_grammar": 'start: "a" | "b"'}, ConstraintKind.GRAMMAR, 'start: "a" | "b"'),
    ({"structured_outputs": {"regex": "a+"}}, ConstraintKind.REGEX, "a+"),
    ({"structured_outputs": {"json": SCHEMA}}, ConstraintKind.JSON_SCHEMA,
     Constraint.json_schema(SCHEMA).spec),
    ({"structured_outputs": {"choice": ["x"]}}, ConstraintKind.CHOICE, '["x"]'),
    ({"structured_outputs": {"json_object": True}}, ConstraintKind.JSON_OBJECT, ""),
])
def test_fields_map_to_one_constraint_on_both_endpoints(fields, kind, spec):
    for built in (chat_spec(chat(**fields)), completion_spec(completion(**fields))):
        c = constraint_of(built)
        assert c is not None and c.kind is kind and c.spec == spec
        # the constraint crosses the wire with the sampling params
        assert SamplingParams.from_dict(SamplingParams(constraint=c).to_dict()).constraint == c


def test_text_format_and_no_fields_mean_no_constraint():
    assert constraint_of(chat_spec(chat(response_format={"type": "text"}))) is None
    assert constraint_of(completion_spec(completion())) is None


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
])
def test_two_constraints_are_a_400_naming_them(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        chat_spec(chat(**fields))
    assert e.value.param == param and "at most one constraint" in e.value.message
    for name in fields:
        assert name in e.value.message or name == "structured_outputs"


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strange"}}}}, "guided_json"),
    ({"guided_regex": "[unclosed"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(fields, param):
    for build, req in ((chat_spec, chat), (completion_spec, completion)):
        with pytest.raises(BadSamplingParams) as e:
            build(req(**fields))
        assert e.value.param == param and e.value.status_code == 400
        assert e.value.message.startswith(param.split(".")[0])


# ---- tools ----------------------------------------------------------------------------------------------------
def test_tool_choice_maps_to_plans_and_constraints():
    auto = chat_spec(chat(tools=[WEATHER, TIME]))
    assert auto.tools.choice is ToolChoice.AUTO and constraint_of(auto) is None
    assert [t["function"]["name"] for t in auto.tools.shown] == ["get_weather", "get_time"]
    assert chat_spec(chat(tools=[WEATHER], tool_choice="none")).tools.shown == []

    named = chat_spec(chat(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                "function": {"name": "get_weather"}}))
    assert named.tools.choice is ToolChoice.NAMED and constraint_of(named).schema == SCHEMA
    # undeclared arguments are closed off unless the schema allows them; the prompt shows the schema as given
    open_time = chat_spec(chat(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert constraint_of(open_time).schema == {**TIME["function"]["parameters"], "additionalProperties": False}
    assert open_time.tools.shown == [TIME]

    required = chat_spec(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    schema = constraint_of(required).schema
    assert schema["type"] == "array" and (schema["minItems"], schema["maxItems"]) == (1, 1)
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"] for v in variants] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert variants[0]["properties"]["arguments"] == SCHEMA
    parallel = constraint_of(chat_spec(chat(tools=[WEATHER], tool_choice="required"))).schema
    assert "maxItems" not in parallel


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tool_choice"),
])
def test_tool_400s(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        chat_spec(chat(**fields))
    assert e.value.param == param


def test_named_output_is_one_call_with_those_arguments():
    plan = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    out = plan.parse(' {"city": "Paris", "days": 2}')
    assert out.content is None and [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    assert out.calls[0].id.startswith("call_")


def test_required_output_is_the_array_of_calls():
    plan = plan_tools([WEATHER, TIME], "required", None)
    out = plan.parse('[{"name": "get_time", "arguments": {"tz": "UTC"}}, '
                     '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]')
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo", "days": 1})]
    assert len({c.id for c in out.calls}) == 2
    cut = plan.parse('[{"name": "get_time", "argu')  # max_tokens cut it: the text stays content
    assert cut.calls == () and cut.content == '[{"name": "get_time", "argu'


def test_auto_output_reads_hermes_blocks():
    plan = plan_tools([WEATHER, TIME], "auto", None)
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}')  # no closing tag
    out = plan.parse(text)
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Rome", "days": 3}), ("get_time", {"tz": "CET"})]
    assert plan.parse("Just text.").calls == () and plan.parse("Just text.").content == "Just text."
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert plan.parse(unknown).calls == () and plan.parse(unknown).content == unknown
    assert plan.parse("<tool_call>{broken").content == "<tool_call>{broken"


def test_auto_stream_sends_content_at_once_and_holds_calls():
    plan = plan_tools([WEATHER], "auto", None)
    s = AutoCallStream(plan)
    assert s.push("Hello <") == "Hello "  # '<' may begin a tag: held
    assert s.push("b>") == "<b>"
    assert s.push(" <tool_") == " "
    assert s.push('call>{"name": "get_weather", ') == ""
    assert s.push('"arguments": {"city": "X", "days": 1}}</tool_call>') == ""
    out = s.finish()
    assert out.content is None and [c.name for c in out.calls] == ["get_weather"]
    s = AutoCallStream(plan)
    assert s.push("a <tool_call> not json") == "a "
    assert s.finish().content == "<tool_call> not json"


def test_streamed_tool_deltas():
    named = _ToolDeltas(plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None))
    first, reason = named.push('{"city": ', None)
    call = first["tool_calls"][0]
    assert reason is None and call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert named.push('"A", "days": 1}', None) == ({"tool_calls": [{"index": 0, "function": {
        "arguments": '"A", "days": 1}'}}]}, None)
    assert named.push("", FinishReason.STOP) == ({}, "tool_calls")

    required = _ToolDeltas(plan_tools([WEATHER], "required", None))
    assert required.push('[{"name": "get_weather", ', None) == ({}, None)
    delta, reason = required.push('"arguments": {"city": "B", "days": 2}}]', FinishReason.STOP)
    assert reason == "tool_calls" and delta["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {"city": "B", "days": 2}

    auto = _ToolDeltas(plan_tools([WEATHER], "auto", None))
    assert auto.push("plain answer", None) == ({"content": "plain answer"}, None)
    assert auto.push("", FinishReason.LENGTH) == ({}, "length")


# ---- rendering -----------------------------------------------------------------------------------------------
SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nDefault<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
NATIVE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
          "{% for m in messages %}{{ m.role }}:"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
          "{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "22C"},
]


def test_template_without_tools_gets_a_system_block_and_text_calls():
    messages = message_dicts(chat(messages=CONVERSATION).messages)
    text = ChatRenderer().render(SMOL, messages, tools=[WEATHER])
    assert "Default" not in text and text.startswith("<|im_start|>system\nYou can call the following tools")
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
            '\n</tool_call><|im_end|>') in text
    # the two tool results are one user turn
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response>" in text
    # an existing system message keeps its text, the block follows it
    with_system = ChatRenderer().render(SMOL, [{"role": "system", "content": "Be brief."}, *messages], tools=[TIME])
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\nYou can call")


def test_template_with_tools_gets_them_natively():
    messages = message_dicts(chat(messages=CONVERSATION).messages)
    text = ChatRenderer().render(NATIVE, messages, tools=[WEATHER, TIME])
    assert text.startswith("TOOLS:get_weather;get_time;user:")
    assert 'CALL get_weather {"city": "Paris", "days": 1}' in text  # arguments handed over as a dict
    assert "tool:sunnytool:22C" in text and "You can call" not in text


def test_polyfill_keeps_plain_messages():
    plain = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert polyfill_messages(plain) == plain


# ---- Responses API text.format ---------------------------------------------------------------------------------
def responses(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_responses_text_format():
    spec = response_spec(responses(text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA,
                                                    "strict": True}}))
    c = spec.sampling["constraint"]
    assert c.kind is ConstraintKind.JSON_SCHEMA and c.schema == SCHEMA
    assert text_body(c)["format"]["schema"] == SCHEMA
    obj = response_spec(responses(text={"format": {"type": "json_object"}})).sampling["constraint"]
    assert obj.kind is ConstraintKind.JSON_OBJECT and text_body(obj) == {"format": {"type": "json_object"}}
    assert response_spec(responses(text={"format": {"type": "text"}})).sampling["constraint"] is None
    assert text_body(None) == {"format": {"type": "text"}}


@pytest.mark.parametrize("text, param", [
    ({"format": {"type": "json_schema", "name": "w", "schema": {"type": "nope"}}}, "text.format.schema"),
    ({"format": {"type": "json_schema", "name": "w"}}, "text.format.schema"),
    ({"format": {"type": "json_schema", "schema": SCHEMA}}, "text.format.name"),
    ({"format": {"type": "regex"}}, "text.format.type"),
    ({"format": {"type": "json_object", "x": 1}}, "text.format.x"),
])
def test_responses_text_format_400s(text, param):
    with pytest.raises(InvalidRequestError) as e:
        response_spec(responses(text=text))
    assert e.value.param == param


# ---- "auto" calls through the HTTP edge (fake engine: its reply starts with reply_lead) -------------------------
def test_auto_calls_over_http_whole_and_streamed():
    from fastapi.testclient import TestClient

    from parrot.api import ServerSettings, create_app
    from fakes import FakeEngine

    engine = FakeEngine(max_model_len=2048)
    engine.reply_lead = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
    body = {"model": "fake-model", "messages": USER, "tools": [WEATHER], "temperature": 0, "max_tokens": 400}
    with TestClient(create_app(ServerSettings(engine_heartbeat_s=0), [engine])) as c:
        whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert whole["finish_reason"] == "tool_calls"
        (call,) = whole["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 2}
        assert whole["message"]["content"].startswith("Checking.<") and "tool_call" not in whole["message"]["content"]

        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [ch["choices"][0] for ch in chunks]
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [tc for d in deltas for tc in d["delta"].get("tool_calls") or []]
        assert content.startswith("Checking.") and "<tool_call>" not in content
        assert [tc["function"]["name"] for tc in calls] == ["get_weather"] and calls[0]["index"] == 0
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
        assert deltas[-1]["finish_reason"] == "tool_calls"
        # tool_choice "none": the same text is plain content
        plain = c.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()["choices"][0]
        assert plain["finish_reason"] == "stop" and "<tool_call>" in plain["message"]["content"]
