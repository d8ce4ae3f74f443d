"""The request fields OpenAI and vLLM clients send (docs/api.md, "Request fields"), against a real server on the
real default model: each honoured field changes the answer as it should, recorded ones are accepted and change
nothing, refused ones are a 400 naming the field, unknown ones are logged and ignored on every OpenAI endpoint.
Also guidellm's request shape, and a scheduler unit test for ``priority``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import httpx
import pytest

from parrot.api import ServerSettings, create_app
from parrot.common.log_context import ContextFilter
from parrot.engine.runtime.context import Context, Op, OpKind
from parrot.protocol.interface import OpHint
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.runtime.sampler import bad_word_tokens
from parrot.engine.scheduler.scheduler import Scheduler
from servers import serve

pytestmark = pytest.mark.model

# the default model's template, plus Qwen3's switch: chat_template_kwargs {"enable_thinking": false} adds an
# empty think block after the generation prompt
THINK_SWITCH = "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}" \
               "{{ '<think>\n\n</think>\n\n' }}{% endif %}"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
IM_START = 1  # <|im_start|>, a special token of the default model


@pytest.fixture(scope="module")
def real(default_model_path):
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.settings import EngineSettings

    engine = build_local_engine_client(EngineSettings(model=default_model_path, kv_cache_tokens=8192, num_threads=1))
    engine._info = dataclasses.replace(engine._info, chat_template=engine._info.chat_template + THINK_SWITCH)
    added: list[tuple[OpKind, int]] = []  # (kind, priority) of every op the engine's scheduler queues
    scheduler = engine.engine.scheduler
    add = scheduler.add

    def recording_add(op: Op) -> None:
        added.append((op.kind, op.hint.priority if op.hint is not None else 0))
        add(op)

    scheduler.add = recording_add
    try:
        with serve(create_app(ServerSettings(engine_heartbeat_s=0), [engine])) as url:
            with httpx.Client(base_url=url, timeout=60) as client:
                model = client.get("/v1/models").json()["data"][0]["id"]
                yield client, model, added
    finally:
        asyncio.run(engine.close())


def post(real, path: str, **body) -> httpx.Response:
    client, model, _ = real
    return client.post(path, json={"model": model, **body})


def ok(real, path: str, **body) -> dict:
    r = post(real, path, **body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(real, **body) -> dict:
    return ok(real, "/v1/chat/completions", **{"messages": QUESTION, "max_tokens": 6, "temperature": 0, **body})


def complete(real, **body) -> dict:
    return ok(real, "/v1/completions", **{"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
                                          **body})


def refused(real, path: str, param: str, **body) -> None:
    r = post(real, path, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def streamed(real, **body) -> list[dict]:
    client, model, _ = real
    with client.stream("POST", "/v1/chat/completions", json={"model": model, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---- honoured ---------------------------------------------------------------------------------------------------
def test_logit_bias_forces_a_token_and_is_checked(real):
    r = complete(real, logit_bias={"28": 100}, logprobs=0, return_tokens_as_token_ids=True)
    assert r["choices"][0]["logprobs"]["tokens"] == ["token_id:28"] * 4  # "," every time
    assert r["choices"][0]["text"] == ",,,,"
    refused(real, "/v1/completions", "logit_bias", prompt="x", logit_bias={"49152": 1})  # past the vocabulary
    refused(real, "/v1/completions", "logit_bias", prompt="x", logit_bias={"28": 101})
    refused(real, "/v1/chat/completions", "logit_bias", messages=QUESTION, logit_bias={"comma": 1})


def test_bad_words_removes_a_word_the_model_says_greedily(real):
    plain = chat(real, max_tokens=8)["choices"][0]["message"]["content"]
    assert "Paris" in plain
    banned = chat(real, max_tokens=8, bad_words=["Paris"])["choices"][0]["message"]["content"]
    assert "Paris" not in banned and banned != plain


def test_bad_word_tokens_ban_a_words_last_token_after_the_rest():
    words = [(5,), (7, 8, 9)]
    assert bad_word_tokens(words, []) == [5]
    assert bad_word_tokens(words, [1, 7]) == [5]  # the output ends with 7, not 7 8
    assert bad_word_tokens(words, [1, 7, 8]) == [5, 9]


def test_min_p_is_greedy_at_one_and_changes_nothing_at_temperature_0(real):
    greedy = complete(real, max_tokens=8)["choices"][0]["text"]
    assert complete(real, max_tokens=8, min_p=0.5)["choices"][0]["text"] == greedy
    for seed in (1, 2, 3):  # only the most likely token survives: sampling is greedy whatever the seed
        assert complete(real, max_tokens=8, temperature=1.0, min_p=1.0, seed=seed)["choices"][0]["text"] == greedy
    refused(real, "/v1/completions", "min_p", prompt="x", min_p=1.5)


def test_skip_special_tokens_leaves_them_out_of_the_text(real):
    forced = {"logit_bias": {str(IM_START): 100}, "max_tokens": 3}
    kept = complete(real, **forced)
    assert kept["choices"][0]["text"] == "<|im_start|>" * 3
    skipped = complete(real, skip_special_tokens=True, **forced)
    assert skipped["choices"][0]["text"] == "" and skipped["usage"]["completion_tokens"] == 3
    # spaces_between_special_tokens: accepted (as vLLM with a fast tokenizer, it changes nothing)
    assert complete(real, spaces_between_special_tokens=False, **forced)["choices"][0]["text"] == "<|im_start|>" * 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(real):
    whole = complete(real)["usage"]["prompt_tokens"]
    cut = complete(real, truncate_prompt_tokens=3, echo=True)
    assert cut["usage"]["prompt_tokens"] == 3 < whole
    assert cut["choices"][0]["text"].startswith(" of France is")  # the echo is the kept prompt (3 tokens)
    assert chat(real, truncate_prompt_tokens=4)["usage"]["prompt_tokens"] == 4
    assert complete(real, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == whole
    refused(real, "/v1/completions", "truncate_prompt_tokens", prompt="x", truncate_prompt_tokens=0)


def test_priority_reaches_the_engine_scheduler(real):
    _, _, added = real
    added.clear()
    chat(real, priority=-7, max_tokens=2)
    assert [p for _, p in added] == [-7, -7] and {k for k, _ in added} == {OpKind.FILL, OpKind.GENERATE}


def test_priority_orders_waiting_work():
    s = Scheduler(BlockPool(64, 16), max_num_seqs=1, max_batch_tokens=64)
    ops = {}
    for i, (name, priority) in enumerate([("late", 5), ("urgent", -1), ("normal", 0), ("late2", 5)]):
        ops[name] = Op(OpKind.FILL, Context(name, None, tokens=list(range(100 * i, 100 * i + 8))), arrival=i,
                       hint=OpHint(priority=priority))
        s.add(ops[name])
    assert [o.ctx.id for o in s.waiting] == ["urgent", "normal", "late", "late2"]  # FCFS among equals
    assert [c.op.ctx.id for c in s.schedule().chunks] == ["urgent"]  # one seat: the most urgent takes it


def test_request_id_is_the_response_id_and_labels_the_logs(real, caplog):
    caplog.set_level(logging.DEBUG, logger="parrot.manager.dispatcher")
    caplog.handler.addFilter(ContextFilter())
    assert chat(real, request_id="my-req-1")["id"] == "chatcmpl-my-req-1"
    placed = [r for r in caplog.records if r.getMessage().startswith("dispatch ")]
    assert placed and {r.request_id for r in placed} == {"chatcmpl-my-req-1"}
    assert complete(real, request_id="my-req-1")["id"] == "cmpl-my-req-1"
    # the same id twice at once: each run still has its own engine contexts
    client, model, _ = real

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=60) as ac:
            body = {"model": model, "prompt": "Hi", "max_tokens": 3, "request_id": "dup"}
            return await asyncio.gather(*(ac.post("/v1/completions", json=body) for _ in range(2)))

    assert [r.status_code for r in asyncio.run(both())] == [200, 200]


def test_continue_final_message_continues_the_text(real):
    msgs = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    r = chat(real, messages=msgs, add_generation_prompt=False, continue_final_message=True)
    assert r["choices"][0]["message"]["content"].startswith(" Paris")
    refused(real, "/v1/chat/completions", "continue_final_message", messages=msgs, continue_final_message=True)
    # without a generation prompt the model sees the closed turn: a new turn, not the continued sentence
    closed = chat(real, messages=msgs, add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert closed > r["usage"]["prompt_tokens"]


def test_chat_template_kwargs_reach_the_template(real):
    plain = chat(real, max_tokens=1)["usage"]["prompt_tokens"]
    off = chat(real, max_tokens=1, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"]
    assert off > plain  # the template added its empty think block
    assert chat(real, max_tokens=1, chat_template_kwargs={"enable_thinking": True})["usage"]["prompt_tokens"] == plain
    refused(real, "/v1/chat/completions", "chat_template_kwargs.messages", messages=QUESTION,
            chat_template_kwargs={"messages": []})


def test_prompt_logprobs_in_vllms_shape(real):
    r = complete(real, prompt_logprobs=2, max_tokens=1, n=2)
    n_prompt = r["usage"]["prompt_tokens"]
    for choice in r["choices"]:
        plp = choice["prompt_logprobs"]
        assert len(plp) == n_prompt and plp[0] is None
        for entry in plp[1:]:
            assert 2 <= len(entry) <= 3  # the 2 most likely, and the prompt's token when it is not one of them
            ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
            assert ranks == [1, 2] and all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str)
                                           for v in entry.values())
    body = chat(real, prompt_logprobs=0, max_tokens=1)
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"] and body["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in chat(real, max_tokens=1)  # nothing when not asked
    refused(real, "/v1/chat/completions", "prompt_logprobs", messages=QUESTION, prompt_logprobs=1, stream=True)
    refused(real, "/v1/completions", "prompt_logprobs", prompt="x", prompt_logprobs=21)


def test_return_tokens_as_token_ids_in_chat_logprobs(real):
    content = chat(real, logprobs=True, top_logprobs=1, max_tokens=3,
                   return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(c["token"].startswith("token_id:") for c in content)
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


def test_continuous_usage_stats_put_usage_on_every_chunk(real):
    chunks = streamed(real, messages=QUESTION, max_tokens=6, temperature=0,
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 6
    assert chunks[-1]["choices"] == [] and "prompt_tokens_details" in chunks[-1]["usage"]


def test_guidellm_request_shape(real):
    chunks = streamed(real, messages=QUESTION, max_completion_tokens=16, ignore_eos=True,
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


# ---- recorded, refused, unknown ------------------------------------------------------------------------------
def test_recorded_fields_are_accepted_and_change_nothing(real):
    plain = chat(real)
    recorded = chat(real, metadata={"team": "a"}, store=False, service_tier="auto", user="u-1",
                    cache_salt="salt", reasoning_effort="low", length_penalty=1.5, use_beam_search=False)
    assert recorded["choices"][0]["message"] == plain["choices"][0]["message"]
    assert set(recorded) == set(plain) and "metadata" not in recorded


def test_beam_search_is_refused(real):
    refused(real, "/v1/chat/completions", "use_beam_search", messages=QUESTION, use_beam_search=True)
    refused(real, "/v1/completions", "use_beam_search", prompt="x", use_beam_search=True)


def test_unknown_fields_are_logged_and_ignored_on_every_openai_endpoint(real, caplog):
    caplog.set_level(logging.WARNING, logger="parrot.api.schemas")
    body = chat(real, not_a_field=1, another={"x": 1})
    assert "not_a_field" not in body and "another" not in body
    complete(real, not_a_field=1)
    ok(real, "/v1/responses", input="Hi", max_output_tokens=16, not_a_field=1)
    warned = [r.getMessage() for r in caplog.records if "unknown field" in r.getMessage()]
    assert warned == ["ChatCompletionRequest: ignoring unknown field(s) another, not_a_field",
                      "CompletionRequest: ignoring unknown field(s) not_a_field",
                      "ResponsesRequest: ignoring unknown field(s) not_a_field"]
    r = real[0].post("/api/v1/sessions", json={"ttl_s": 60, "foo": 1})  # the Parrot API keeps refusing them
    assert r.status_code == 400 and "foo" in r.text, r.text
