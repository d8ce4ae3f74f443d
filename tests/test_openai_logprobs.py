"""Logprobs, echo and cached tokens on /v1/completions and /v1/chat/completions (TestClient, fake engine with
deterministic fake logprobs: see tests/fakes.py)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from parrot.api import ServerSettings, create_app
from parrot.protocol.interface import GenerateResult
from fakes import BOS, EOS, TAIL, FakeEngine

MODEL = "fake-model"


@pytest.fixture()
def engine():
    return FakeEngine(max_model_len=512)


@pytest.fixture()
def client(engine):
    with TestClient(create_app(ServerSettings(engine_heartbeat_s=0), [engine]), raise_server_exceptions=False) as c:
        yield c


def post(client, path, **body):
    r = client.post(path, json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(client, path, **body) -> list[dict]:
    with client.stream("POST", path, json={"model": MODEL, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def expected_positions(ids: list[int], k: int, *, first_unscored: bool) -> tuple[list, list, list]:
    """tokens, token_logprobs, top_logprobs the fake engine implies for ``ids`` (the first follows BOS unless
    it is an echoed prompt's unscored first token)."""
    tokens, lps, tops = [], [], []
    for j, t in enumerate(ids):
        chosen = FakeEngine.token_logprob(t, ids[j - 1] if j else BOS)
        tokens.append(chosen.token)
        if j == 0 and first_unscored:
            lps.append(None)
            tops.append(None)
            continue
        prev = ids[j - 1] if j else BOS
        top = {}
        for i in range(k):
            alt = FakeEngine.token_logprob((prev + 1 + i) % 259, prev)
            top.setdefault(alt.token, alt.logprob)
        top.setdefault(chosen.token, chosen.logprob)
        lps.append(chosen.logprob)
        tops.append(top)
    return tokens, lps, tops


def concat_logprobs(chunks: list[dict], index: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] == index and ch["logprobs"] is not None:
                for key in out:
                    out[key] += ch["logprobs"][key]
    return out


# ---- completions ------------------------------------------------------------------------------------------------
def test_completion_logprobs_cover_every_generated_token_eos_included(client):
    r = post(client, "/v1/completions", prompt="hi", max_tokens=100, logprobs=2)
    choice = r["choices"][0]
    answer = FakeEngine.reply_for("hi") + TAIL
    assert choice["text"] == answer and choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    generated = FakeEngine.encode(answer) + [EOS]
    assert len(lp["tokens"]) == r["usage"]["completion_tokens"] == len(generated)
    prompt_last = FakeEngine.encode("hi")[-1]
    tokens, lps, tops = expected_positions([prompt_last, *generated], 2, first_unscored=True)
    assert (lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]) == (tokens[1:], lps[1:], tops[1:])
    assert lp["tokens"][-1] == "</s>"  # the EOS that ended it is listed (its text is not in the choice text)
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"])  # k alternatives, plus the chosen one
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets


@pytest.mark.parametrize("extra", [{}, {"stop": ["st of"]}, {"n": 2, "seed": 3, "temperature": 0.7}])
def test_completion_stream_carries_the_same_logprobs(client, extra):
    body = {"prompt": "hello there", "max_tokens": 60, "logprobs": 1, **extra}
    whole = post(client, "/v1/completions", **body)
    chunks = sse(client, "/v1/completions", **body)
    for choice in whole["choices"]:
        streamed = concat_logprobs(chunks, choice["index"])
        assert streamed == choice["logprobs"]
        text = "".join(ch["text"] for c in chunks for ch in c["choices"] if ch["index"] == choice["index"])
        assert text == choice["text"]


def test_echo_prepends_the_prompt_and_its_logprobs(client, engine):
    r = post(client, "/v1/completions", prompt="abc", max_tokens=3, logprobs=1, echo=True)
    choice = r["choices"][0]
    assert choice["text"] == "abc" + FakeEngine.reply_for("abc")[:3]
    prompt = [BOS, *FakeEngine.encode("abc")]
    generated = FakeEngine.encode(FakeEngine.reply_for("abc")[:3])
    tokens, lps, tops = expected_positions(prompt + generated, 1, first_unscored=True)
    lp = choice["logprobs"]
    assert lp["tokens"] == tokens and lp["token_logprobs"] == lps and lp["top_logprobs"] == tops
    assert lp["tokens"][0] == "<s>" and lp["token_logprobs"][0] is None  # BOS: unscored
    assert len(lp["tokens"]) == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
    assert engine.calls_of("fill")[-1][3] == prompt


def test_echo_with_max_tokens_0_scores_the_prompt_only_and_token_prompts_work(client, engine):
    ids = [FakeEngine.encode("pq")[0], *FakeEngine.encode("rs")]  # a token-id prompt (no BOS added)
    r = post(client, "/v1/completions", prompt=[ids, ids], max_tokens=0, logprobs=0, echo=True, n=2)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for c in r["choices"]:
        assert c["text"] == "prs" and c["finish_reason"] == "length"
        assert c["logprobs"]["token_logprobs"] == expected_positions(ids, 0, first_unscored=True)[1]
        assert c["logprobs"]["tokens"] == ["p", "r", "s"]
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == 6
    assert engine.calls_of("generate") == [] and len(engine.calls_of("fill")) == 2  # each prompt filled once
    assert engine.contexts == {}

    chunks = sse(client, "/v1/completions", prompt=ids, max_tokens=0, logprobs=0, echo=True)
    assert len(chunks) == 1 and chunks[0]["choices"][0]["text"] == "prs"
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[0]["choices"][0]["logprobs"] == r["choices"][0]["logprobs"]


def test_the_evaluation_harness_pattern(client):
    """lm-eval's loglikelihood request: token ids (context + continuation), echo, max_tokens 1, logprobs 1; it
    sums token_logprobs[ctxlen:-1] and calls the continuation greedy when each token is its top-1."""
    context, continuation = FakeEngine.encode("The sky is"), FakeEngine.encode(" blue")
    r = post(client, "/v1/completions", prompt=[context + continuation], max_tokens=1, logprobs=1, echo=True)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(context) + len(continuation) + 1
    ids = context + continuation
    want = sum(FakeEngine.fake_logprob(ids[j], ids[j - 1]) for j in range(len(context), len(ids)))
    assert sum(lp["token_logprobs"][len(context):-1]) == pytest.approx(want)


def test_echo_stream_sends_the_prompt_first_for_each_choice(client):
    chunks = sse(client, "/v1/completions", prompt="xy", max_tokens=4, logprobs=1, echo=True, n=2, seed=1,
                 temperature=0.5)
    whole = post(client, "/v1/completions", prompt="xy", max_tokens=4, logprobs=1, echo=True, n=2, seed=1,
                 temperature=0.5)
    for index in (0, 1):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        assert mine[0]["text"] == "xy" and len(mine[0]["logprobs"]["tokens"]) == 3
        assert concat_logprobs(chunks, index) == whole["choices"][index]["logprobs"]


def test_max_tokens_0_without_echo_and_logprobs_out_of_range_are_400(client):
    for body, param in [({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "logprobs": 21}, "logprobs"),
                        ({"prompt": "x", "logprobs": -1}, "logprobs")]:
        r = client.post("/v1/completions", json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_cached_tokens_count_prefix_cache_hits_once_per_prompt(client):
    prompt = "a prompt long enough to fill two blocks of the cache, and a bit"
    first = post(client, "/v1/completions", prompt=prompt, max_tokens=2, n=3, seed=1, temperature=0.5)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = post(client, "/v1/completions", prompt=prompt, max_tokens=2, n=3, seed=1, temperature=0.5)
    n = 1 + len(prompt)
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": n // 16 * 16}
    two = post(client, "/v1/completions", prompt=[prompt, prompt], max_tokens=2)
    assert two["usage"]["prompt_tokens_details"] == {"cached_tokens": 2 * (n // 16 * 16)}
    sse(client, "/v1/chat/completions", messages=[{"role": "user", "content": prompt}], max_tokens=2)
    chunks = sse(client, "/v1/chat/completions", messages=[{"role": "user", "content": prompt}], max_tokens=2,
                 stream_options={"include_usage": True})
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


# ---- chat ------------------------------------------------------------------------------------------------------
def chat_tokens(logprobs: dict) -> str:
    return b"".join(bytes(p["bytes"]) for p in logprobs["content"]).decode()


@pytest.mark.parametrize("extra", [{}, {"stop": ["rest"]}, {"max_tokens": 7}])
def test_chat_logprobs_spell_the_content_stream_or_not(client, extra):
    body = {"messages": [{"role": "user", "content": "héllo"}], "logprobs": True, "top_logprobs": 3, **extra}
    whole = post(client, "/v1/chat/completions", **body)
    choice = whole["choices"][0]
    content = choice["message"]["content"]
    assert chat_tokens(choice["logprobs"]) == content  # no stop token, no cut stop-string tail
    # a token holding part of a character shows U+FFFD in its text; its bytes are exact
    assert "".join(p["token"] for p in choice["logprobs"]["content"]) == content.replace("é", "\ufffd\ufffd")
    for p in choice["logprobs"]["content"]:
        assert [t["token"] for t in p["top_logprobs"]] and len(p["top_logprobs"]) == 3
        assert set(p) == {"token", "logprob", "bytes", "top_logprobs"}
    chunks = sse(client, "/v1/chat/completions", **body)
    streamed = [p for c in chunks for ch in c["choices"] if ch["logprobs"] for p in ch["logprobs"]["content"]]
    assert streamed == choice["logprobs"]["content"]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text == content


def test_chat_logprobs_validation(client):
    msgs = [{"role": "user", "content": "hi"}]
    r = post(client, "/v1/chat/completions", messages=msgs, max_tokens=3)
    assert r["choices"][0]["logprobs"] is None
    r = post(client, "/v1/chat/completions", messages=msgs, max_tokens=3, logprobs=True)
    assert [p["top_logprobs"] for p in r["choices"][0]["logprobs"]["content"]] == [[], [], []]
    for body, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


class NoLogprobsEngine(FakeEngine):
    """An engine that ignores the logprobs request (the contract says it must not)."""

    async def generate(self, sampling, context_id, parent_context_id=None, *, hint=None) -> GenerateResult:
        res = await super().generate(sampling, context_id, parent_context_id, hint=hint)
        return GenerateResult(res.context_id, res.token_ids, res.text, res.finish_reason, res.prompt_len)


def test_an_engine_that_omits_logprobs_is_an_engine_error_not_a_silent_null():
    engine = NoLogprobsEngine()
    with TestClient(create_app(ServerSettings(engine_heartbeat_s=0), [engine]), raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": 1})
    assert r.status_code == 502 and r.json()["error"]["code"] == "engine_error"
    assert engine.contexts == {}
