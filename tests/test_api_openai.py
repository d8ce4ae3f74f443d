"""OpenAI-compatible API through the official ``openai`` client against a real uvicorn server (fake engine)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from parrot.api import ServerSettings, create_app
from fakes import CHAT_TEMPLATE, TAIL, FakeEngine
from servers import serve

KEY = "sk-test"


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(max_model_len=256)
    with serve(create_app(ServerSettings(api_key=KEY, engine_heartbeat_s=0), [engine])) as url:
        yield url, engine
    assert engine.contexts == {}  # every context freed by the end


@pytest.fixture()
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=30)


def test_models_and_auth(server, oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    bad = openai.OpenAI(base_url=server[0] + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_completion_text_usage_stop_and_stream_equivalence(oai):
    r = oai.completions.create(model="fake-model", prompt="hello", max_tokens=5, temperature=0)
    assert r.choices[0].text == FakeEngine.reply_for("hello")[:5] and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 5, 11)  # BOS + 5 bytes

    full = oai.completions.create(model="fake-model", prompt="hello", max_tokens=100, temperature=0)
    assert full.choices[0].text == FakeEngine.reply_for("hello") + TAIL and full.choices[0].finish_reason == "stop"
    stopped = oai.completions.create(model="fake-model", prompt="hello", max_tokens=100, temperature=0, stop=["l"])
    assert stopped.choices[0].text == "<he"

    chunks = list(oai.completions.create(model="fake-model", prompt="hello", max_tokens=100, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_forks_one_filled_prompt_and_seeds(server, oai):
    engine = server[1]
    before = len(engine.calls)
    r = oai.completions.create(model="fake-model", prompt="fork me", max_tokens=40, n=3, seed=7, temperature=0.8,
                               stop=["\n"])
    calls = engine.calls[before:]
    fills = [c for c in calls if c[0] == "fill"]
    gens = [c for c in calls if c[0] == "generate"]
    assert len(fills) == 1 and len(gens) == 3
    assert {c[2] for c in gens} == {fills[0][1]}  # every choice forks from the filled prompt context
    assert [c.index for c in r.choices] == [0, 1, 2]
    reply = FakeEngine.reply_for("fork me")
    assert [c.text for c in r.choices] == [f"{reply}#7", f"{reply}#8", f"{reply}#9"]  # seed + i per choice
    again = oai.completions.create(model="fake-model", prompt="fork me", max_tokens=40, n=3, seed=7,
                                   temperature=0.8, stop=["\n"])
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_prompt_lists_and_token_ids(oai):
    r = oai.completions.create(model="fake-model", prompt=["ab", "cd"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["<ab", "<ab", "<cd", "<cd"]
    ids = FakeEngine.encode("xyz")
    r = oai.completions.create(model="fake-model", prompt=ids, max_tokens=4, temperature=0)
    assert r.choices[0].text == "<xyz" and r.usage.prompt_tokens == 3  # token prompts get no BOS
    r = oai.completions.create(model="fake-model", prompt=[ids, FakeEngine.encode("q")], max_tokens=2, temperature=0)
    assert [c.text for c in r.choices] == ["<x", "<q"]


def test_vllm_extras(oai):
    r = oai.completions.create(model="fake-model", prompt="hi", max_tokens=60, temperature=0,
                               extra_body={"ignore_eos": True, "top_k": -1, "min_tokens": 1,
                                           "repetition_penalty": 1.1, "stop_token_ids": [5]})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 60
    assert r.choices[0].text.endswith(".")


def _rendered(messages):
    import jinja2
    return jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def test_chat_completion_stream_and_not(oai):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    r = oai.chat.completions.create(model="fake-model", messages=messages, temperature=0)
    rendered = _rendered([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"}])
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == FakeEngine.reply_for(rendered) + TAIL
    assert r.choices[0].finish_reason == "stop" and r.usage.prompt_tokens == 1 + len(rendered.encode())

    chunks = list(oai.chat.completions.create(model="fake-model", messages=messages, temperature=0, stream=True,
                                              stream_options={"include_usage": True}, max_tokens=8))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content[:8]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_context_length_and_unknown_model_errors(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="fake-model", prompt="x" * 200, max_tokens=100)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x" * 300}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-nope", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="fake-model", prompt="x", logprobs=21)
    assert e.value.code == "bad_sampling_params" and e.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="fake-model", prompt="x", suffix="y")
    assert e.value.code == "invalid_request" and e.value.param == "suffix"


def test_stream_client_disconnect_frees_context(server):
    base, engine = server
    engine.token_delay_s = 0.05
    try:
        body = {"model": "fake-model", "prompt": "long", "max_tokens": 200, "stream": True,
                "ignore_eos": True, "temperature": 0}
        with httpx.Client(timeout=10) as h:
            with h.stream("POST", base + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                got = [next(lines) for _ in range(3)]
                assert got[0].startswith("data: ")
                ctx = next(c[1] for c in reversed(engine.calls) if c[0] == "fill")
        t0 = time.monotonic()
        while ctx not in engine.freed and time.monotonic() - t0 < 2:
            time.sleep(0.02)
        # freed long before the generation would have ended (~250 tokens to the window x 50 ms)
        assert ctx in engine.freed and ctx not in engine.contexts
    finally:
        engine.token_delay_s = 0.0


def test_sdk_parses_completion_logprobs_with_echo_and_no_generation(oai):
    r = oai.completions.create(model="fake-model", prompt="score me", logprobs=2, echo=True, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == "score me" and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert len(choice.logprobs.tokens) == r.usage.prompt_tokens == 9  # BOS + 8 bytes
    assert all(isinstance(x, float) for x in choice.logprobs.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in choice.logprobs.top_logprobs[1:])
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens_details.cached_tokens == 0


def test_sdk_parses_chat_logprobs(oai):
    r = oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                    temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(p.token for p in content) == r.choices[0].message.content and len(content) == 6
    assert all(len(p.top_logprobs) == 3 and p.bytes == list(p.token.encode()) for p in content)
    chunks = list(oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                              stream=True))
    streamed = [p for c in chunks for ch in c.choices if ch.logprobs for p in ch.logprobs.content]
    assert [(p.token, p.logprob) for p in streamed] == [(p.token, p.logprob) for p in content]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    assert e.value.param == "top_logprobs"


def test_sdk_responses_plain_stream_and_previous_response_id(oai):
    first = oai.responses.create(model="fake-model", input="Tell me about parrots.", instructions="Be brief.",
                                 temperature=0)
    assert first.status == "completed" and first.output_text.endswith(TAIL)
    assert first.usage.input_tokens > 0 and first.usage.input_tokens_details.cached_tokens == 0

    events = list(oai.responses.create(model="fake-model", input="And crows?", previous_response_id=first.id,
                                       instructions="Be brief.", temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    second = events[-1].response
    assert second.output_text == deltas and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn, from the prefix cache

    with oai.responses.stream(model="fake-model", input="And finches?", previous_response_id=second.id,
                              temperature=0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(texts) and final.status == "completed"
    # at max_output_tokens the stream ends with response.incomplete, as OpenAI's does (the SDK's stream helper
    # then has no final response: get_final_response() waits for response.completed only)
    events = list(oai.responses.create(model="fake-model", input="x", temperature=0, max_output_tokens=4,
                                       stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 4
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"

    assert oai.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="fake-model", input="x", previous_response_id="resp_unknown")
    assert e.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="fake-model", input="x", tools=[{"type": "web_search"}])
    assert e.value.param == "tools[0].type" and "web_search" in e.value.message  # function tools only
