"""The vLLM and SGLang adapters against servers speaking those projects' documented request / response shapes.

No GPU here, so each server is a small FastAPI app serving exactly the shapes the adapter relies on, taken from:

vLLM (vllm-project/vllm):
  * vllm/entrypoints/openai/protocol.py: ``CompletionRequest`` (prompt as token ids, ``top_k`` -1 = off,
    ``min_tokens``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
    ``return_token_ids``: "the result will include token IDs alongside the generated text. In streaming mode ...
    token_ids contains the delta tokens for each chunk"), ``CompletionResponse`` / ``CompletionResponseChoice``
    (``text``, ``token_ids``, ``finish_reason``), ``UsageInfo.prompt_tokens_details.cached_tokens``,
    ``TokenizeResponse`` ``{count, max_model_len, tokens}``, ``DetokenizeResponse`` ``{prompt}``,
    ``ErrorResponse`` ``{error: {message, type: "BadRequestError", param, code: 400}}``;
  * vllm/entrypoints/openai/api_server.py: ``GET /health`` (200, empty), ``GET /version``, ``POST /tokenize``,
    ``POST /detokenize``, ``GET /v1/models`` (``ModelCard`` with ``owned_by="vllm"``, ``max_model_len``);
  * docs/design/metrics.md, vllm/v1/metrics/loggers.py: ``vllm:num_requests_running``,
    ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info{block_size,
    num_gpu_blocks}``.
SGLang (sgl-project/sglang):
  * python/sglang/srt/managers/io_struct.py ``GenerateReqInput`` ("input_ids: The token ids for text; one can
    either specify text or input_ids"), docs/basic_usage/sampling_params.md (``max_new_tokens``,
    ``min_new_tokens``, ``stop``, ``stop_token_ids``, ``top_k`` -1, ``ignore_eos``, ``no_stop_trim``,
    ``sampling_seed``);
  * python/sglang/srt/entrypoints/http_server.py: ``POST /generate`` -> ``{text, output_ids, meta_info: {id,
    finish_reason: {type, matched}, prompt_tokens, completion_tokens, cached_tokens}}``, streamed as ``data:``
    events with the text so far, then ``data: [DONE]``; ``GET /health``; ``GET /get_server_info`` (server args
    + ``max_total_num_tokens`` + ``internal_states``); ``POST /tokenize`` / ``/detokenize``; ``/v1/models``
    ``owned_by="sglang"``.

The fake "model" (the same in both): one token per character (id = code point); the reply to a prompt of n
tokens is ``"<n> tail words"``, so every answer shows how long a prompt the server saw. Each fake keeps the
prompts it was sent and reports as cached the longest prefix shared with an earlier one (a prefix cache).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

import parrot as P
from parrot.api import ServerSettings, create_app
from parrot.backends import BackendKind, BackendSpec, build_backend, detect_kind
from parrot.backends.settings import BackendSettings
from parrot.common.errors import BadSamplingParams, ContextLengthExceeded, EngineUnavailable, StepFailed
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.protocol.interface import EngineCapabilities
from servers import serve

WINDOW = 256


def reply(n: int) -> str:
    return f"<{n}> tail words"


class FakeModel:
    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.requests: list[dict] = []

    def run(self, prompt: list[int], max_tokens: int, stop: list[str]) -> tuple[str, str, int]:
        """(text, finish, cached) of one completion."""
        cached = max((_common(prompt, p) for p in self.prompts), default=0)
        self.prompts.append(list(prompt))
        full = reply(len(prompt))
        cut = min((full.find(s) for s in stop if s in full), default=-1)
        if 0 <= cut < max_tokens:
            return full[:cut], "stop", cached
        if len(full) > max_tokens:
            return full[:max_tokens], "length", cached
        return full, "stop", cached


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def vllm_app(model: FakeModel) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/version")
    async def version():
        return {"version": "0.11.0"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake/llama", "object": "model", "created": 0, "owned_by": "vllm",
                                            "root": "fake/llama", "parent": None, "max_model_len": WINDOW}]}

    @app.post("/tokenize")
    async def tokenize(req: Request):
        body = await req.json()
        ids = [ord(c) for c in body["prompt"]]
        if body.get("add_special_tokens", True):  # vLLM's default; this model's tokenizer adds a BOS (id 1)
            ids = [1, *ids]
        return {"count": len(ids), "max_model_len": WINDOW, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: Request):
        return {"prompt": "".join(chr(t) for t in (await req.json())["tokens"])}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="fake/llama"} 2.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0",model_name="fake/llama"} 1.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{engine="0",model_name="fake/llama"} 0.25\n'
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",'
            'num_gpu_blocks="1024"} 1.0\n')

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        model.requests.append(body)
        if body.get("temperature", 0) > 2:  # vLLM validates sampling params -> 400 ErrorResponse
            return JSONResponse({"error": {"message": "temperature must be in [0, 2]", "type": "BadRequestError",
                                           "param": None, "code": 400}}, status_code=400)
        prompt = body["prompt"]
        text, finish, cached = model.run(prompt, body["max_tokens"], body.get("stop") or [])
        ids = [ord(c) for c in text]
        if body.get("stream"):
            async def events():
                for i, c in enumerate(text):
                    last = i == len(text) - 1
                    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake/llama",
                             "choices": [{"index": 0, "text": c, "logprobs": None,
                                          "finish_reason": finish if last else None, "stop_reason": None,
                                          "token_ids": [ord(c)]}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):  # vLLM's last chunk: usage only
                    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                             "total_tokens": len(prompt) + len(ids), "prompt_tokens_details": {"cached_tokens": cached}}
                    yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake/llama",
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                             "token_ids": ids if body.get("return_token_ids") else None}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids), "prompt_tokens_details": {"cached_tokens": cached}}}

    return app


def sglang_app(model: FakeModel) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake/llama", "object": "model", "created": 0, "owned_by": "sglang",
                                            "root": "fake/llama"}]}

    @app.get("/get_server_info")
    async def server_info():
        return {"model_path": "fake/llama", "served_model_name": "fake/llama", "context_length": WINDOW,
                "max_total_num_tokens": 50000, "version": "0.5.0",
                "internal_states": [{"num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 1234}]}

    @app.post("/tokenize")
    async def tokenize(req: Request):
        ids = [ord(c) for c in (await req.json())["prompt"]]
        return {"tokens": ids, "count": len(ids), "max_model_len": WINDOW}

    @app.post("/detokenize")
    async def detokenize(req: Request):
        return {"text": "".join(chr(t) for t in (await req.json())["tokens"])}

    @app.post("/generate")
    async def generate(req: Request):
        body = await req.json()
        model.requests.append(body)
        params = body["sampling_params"]
        prompt = body["input_ids"]
        text, finish, cached = model.run(prompt, params["max_new_tokens"], params.get("stop") or [])
        meta = {"id": "r1", "finish_reason": {"type": finish}, "prompt_tokens": len(prompt),
                "completion_tokens": len(text), "cached_tokens": cached}
        if body.get("stream"):
            async def events():  # cumulative text and output ids, the server's default
                for i in range(1, len(text) + 1):
                    m = dict(meta, finish_reason=meta["finish_reason"] if i == len(text) else None)
                    yield f"data: {json.dumps({'text': text[:i], 'output_ids': [ord(c) for c in text[:i]], 'meta_info': m})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"text": text, "output_ids": [ord(c) for c in text], "meta_info": meta}

    return app


@pytest.fixture(params=["vllm", "sglang"])
def server(request):
    model = FakeModel()
    app = vllm_app(model) if request.param == "vllm" else sglang_app(model)
    with serve(app) as url:
        yield request.param, url, model


def test_detects_kind_and_reports_capabilities(server):
    kind, url, _ = server
    assert asyncio.run(detect_kind(url)) is BackendKind(kind)

    async def go():
        eng = build_backend(BackendSpec(url), BackendKind(kind), "ext-0")
        try:
            info, status = await eng.model_info(), await eng.status()
        finally:
            await eng.close()
        return info, status

    info, status = asyncio.run(go())
    assert info.name == "fake/llama" and info.max_model_len == WINDOW
    caps = EngineCapabilities.from_status(status)
    assert caps is not None and caps.fork and caps.prefix_cache and not caps.shared_prefix_attention
    assert status.extra["capabilities"]["token_ids"] is True and status.extra["backend"]["kind"] == kind
    if kind == "vllm":  # 1024 blocks x 16 tokens, a quarter used; running / waiting from the gauges
        assert caps.kv_tokens == 16384 and status.kv_blocks_used == 4096
        assert (status.num_running, status.num_waiting) == (2, 1)
    else:
        assert caps.kv_tokens == 50000 and status.kv_blocks_used == 1234 and status.num_running == 1


def test_fork_sends_parent_prefix_and_keeps_generated_tokens(server):
    kind, url, model = server

    async def go():
        eng = build_backend(BackendSpec(url), BackendKind(kind), "ext-0")
        try:
            prefix = await eng.tokenize("shared prefix. ")
            await eng.fill(prefix, "p")
            await eng.fill(await eng.tokenize("one"), "a", "p")
            await eng.fill(await eng.tokenize("two!"), "b", "p")
            ra = await eng.generate(SamplingParams(max_tokens=20, stop=(" ",)), "a")
            rb = await eng.generate(SamplingParams(max_tokens=20, stop=(" ",)), "b")
            await eng.fill(await eng.tokenize(" more"), "a")  # continues after the generated tokens
            ra2 = await eng.generate(SamplingParams(max_tokens=3), "a")
            await eng.free_context("p")  # children keep the shared prefix
            rb2 = await eng.generate(SamplingParams(max_tokens=20, stop=(" ",)), "b")
            return prefix, ra, rb, ra2, rb2
        finally:
            await eng.close()

    prefix, ra, rb, ra2, rb2 = asyncio.run(go())
    n = len(prefix)
    assert ra.text == f"<{n + 3}>" and ra.finish_reason is FinishReason.STOP and ra.prompt_len == n + 3
    assert rb.text == f"<{n + 4}>"
    assert ra.token_ids == tuple(ord(c) for c in ra.text)  # the server's reported ids
    # the second generation of `a` saw prefix + "one" + its own output + " more"
    assert ra2.prompt_len == n + 3 + len(ra.text) + 5 and ra2.finish_reason is FinishReason.LENGTH
    assert ra2.text == reply(ra2.prompt_len)[:3]
    assert rb2.text == f"<{n + 4 + len(rb.text)}>"
    prompts = model.requests
    key = "prompt" if kind == "vllm" else "input_ids"
    sent = [r[key] for r in prompts]
    text = "".join(chr(t) for t in sent[0])
    assert text == "shared prefix. one" and sent[1][:n] == sent[0][:n]  # token ids with the parent's prefix
    assert sent[2] == sent[0] + [ord(c) for c in ra.text] + [ord(c) for c in " more"]


def test_sampling_fields_map_to_each_server(server):
    kind, url, model = server

    async def go():
        eng = build_backend(BackendSpec(url), BackendKind(kind), "ext-0")
        try:
            await eng.fill(await eng.tokenize("hello"), "c")
            s = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=20, min_tokens=1,
                               repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25, stop=("x",),
                               stop_token_ids=(5,), ignore_eos=True, seed=11, logit_bias={7: 2.5}, min_p=0.05)
            return await eng.generate(s, "c")
        finally:
            await eng.close()

    asyncio.run(go())
    body = model.requests[-1]
    if kind == "vllm":
        assert body["prompt"] == [ord(c) for c in "hello"] and body["model"] == "fake/llama"
        expect = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_tokens": 1,
                  "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25, "stop": ["x"],
                  "stop_token_ids": [5], "ignore_eos": True, "seed": 11, "return_token_ids": True, "stream": False,
                  "logit_bias": {"7": 2.5}, "min_p": 0.05}
        assert {k: body[k] for k in expect} == expect
    else:
        assert body["input_ids"] == [ord(c) for c in "hello"] and body["stream"] is False
        expect = {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_new_tokens": 1,
                  "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25, "stop": ["x"],
                  "stop_token_ids": [5], "ignore_eos": True, "sampling_seed": 11, "logit_bias": {"7": 2.5},
                  "min_p": 0.05}
        assert {k: body["sampling_params"][k] for k in expect} == expect


def test_stream_yields_increments_and_extends_context(server):
    kind, url, model = server

    async def go():
        eng = build_backend(BackendSpec(url), BackendKind(kind), "ext-0")
        try:
            await eng.fill(await eng.tokenize("abc"), "c")
            chunks = [c async for c in eng.generate_stream(SamplingParams(max_tokens=4), "c")]
            after = await eng.generate(SamplingParams(max_tokens=20, stop=(" ",)), "c")
            return chunks, after
        finally:
            await eng.close()

    chunks, after = asyncio.run(go())
    assert "".join(c.text for c in chunks) == "<3> "[:4] and chunks[-1].finish_reason is FinishReason.LENGTH
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert [t for c in chunks for t in c.token_ids] == [ord(c) for c in "<3> "]  # increments, not cumulative
    assert after.text == "<7>"  # 3 prompt + 4 streamed tokens


def test_the_servers_prefix_cache_hit_is_reported_whole_and_streamed(server):
    """An external server prefills at generate time: its own cached count (the fake's longest shared prefix with
    an earlier prompt) comes back on the result and on the stream's last chunk."""
    kind, url, model = server

    async def go():
        eng = build_backend(BackendSpec(url), BackendKind(kind), "ext-0")
        try:
            await eng.fill(await eng.tokenize("shared head one"), "a")
            first = await eng.generate(SamplingParams(max_tokens=2), "a")
            await eng.fill(await eng.tokenize("shared head two"), "b")
            again = await eng.generate(SamplingParams(max_tokens=2), "b")
            await eng.fill(await eng.tokenize("shared head three"), "c")
            chunks = [c async for c in eng.generate_stream(SamplingParams(max_tokens=2), "c")]
            return first, again, chunks
        finally:
            await eng.close()

    first, again, chunks = asyncio.run(go())
    assert (first.cached_prompt_tokens, again.cached_prompt_tokens) == (0, len("shared head "))
    assert chunks[-1].finish_reason is not None and chunks[-1].cached_prompt_tokens == len("shared head t")


def test_errors_are_typed(server):
    kind, url, model = server

    async def go():
        eng = build_backend(BackendSpec(url), BackendKind(kind), "ext-0")
        try:
            await eng.fill(await eng.tokenize("hi"), "c")
            if kind == "vllm":
                with pytest.raises(BadSamplingParams):  # the server's 400
                    await eng.generate(SamplingParams(temperature=3.0), "c")
            with pytest.raises(BadSamplingParams, match="logprobs"):  # not mapped: refused before sending
                await eng.generate(SamplingParams(logprobs=2), "c")
            with pytest.raises(BadSamplingParams, match="bad_words"):
                await eng.generate(SamplingParams(bad_words_ids=((5, 6),)), "c")
            with pytest.raises(ContextLengthExceeded):  # beyond the window: checked here, nothing sent
                await eng.fill([65] * WINDOW, "c")
            sent = len(model.requests)
            with pytest.raises(BadSamplingParams, match="prompt_logprobs"):
                await eng.fill([65], "d", prompt_logprobs=1)
            assert len(model.requests) == sent
        finally:
            await eng.close()

    asyncio.run(go())


def test_unreachable_server_is_engine_unavailable():
    async def go():
        eng = build_backend(BackendSpec("http://127.0.0.1:9"), BackendKind.VLLM, "gone",
                            BackendSettings(connect_timeout_s=1, probe_timeout_s=1))
        try:
            with pytest.raises(EngineUnavailable, match="unreachable"):
                await eng.status()
        finally:
            await eng.close()

    asyncio.run(go())
    with pytest.raises(EngineUnavailable):
        asyncio.run(detect_kind("http://127.0.0.1:9", BackendSettings(probe_timeout_s=1)))


def test_spec_parsing():
    assert BackendSpec.parse("http://h:1/") == BackendSpec("http://h:1", None)
    assert BackendSpec.parse("llama.cpp=http://h:1").kind is BackendKind.LLAMACPP
    assert BackendSpec.parse("vllm=https://h").kind is BackendKind.VLLM
    with pytest.raises(Exception, match="unknown backend kind"):
        BackendSpec.parse("tgi=http://h:1")
    with pytest.raises(Exception, match="expected"):
        BackendSpec.parse("h:1")


@P.semantic_function(max_tokens=20, stop=[" "])
def first(task: P.SemanticVariable):
    """Task: {{input:task}} -> {{output:a}}"""


@P.semantic_function(max_tokens=20, stop=[" "])
def second(task: P.SemanticVariable, a: P.SemanticVariable):
    """Task: {{input:task}} after {{input:a}} -> {{output:b}}"""


def test_app_runs_through_manager_over_each_kind(server):
    """A dependent two-step app through a real manager whose only engine is the adapter."""
    kind, url, model = server
    eng = build_backend(BackendSpec(url), BackendKind(kind), f"{kind}-0")
    app = create_app(ServerSettings(engine_heartbeat_s=0.2), [eng])
    with serve(app) as manager_url, P.connect(manager_url) as s:
        task = P.SemanticVariable("go", session=s)
        a = first(task, session=s)
        b = second(task, a, session=s)
        va, vb = a.get(perf=P.LATENCY), b.get(perf=P.LATENCY)
        dag = s.dag()
    bos = 1 if kind == "vllm" else 0  # the vLLM fake's tokenizer adds a BOS: the manager puts it first
    head_a = "Task: go ->"  # the template's space before the output is left for the model to generate
    assert va == f"<{len(head_a) + bos}>"
    assert vb.startswith("<") and vb.endswith(">")
    assert {r["engine"] for r in dag["requests"]} == {f"{kind}-0"}
    first_prompt = model.requests[0]["prompt" if kind == "vllm" else "input_ids"]
    assert first_prompt[:bos] == [1] * bos and "".join(chr(t) for t in first_prompt[bos:]) == head_a


def test_failed_server_fails_dependent_gets():
    model = FakeModel()
    with serve(vllm_app(model)) as url:
        eng = build_backend(BackendSpec(url), BackendKind.VLLM, "vllm-0")
        app = create_app(ServerSettings(engine_heartbeat_s=0.2), [eng])
        with serve(app) as manager_url, P.connect(manager_url) as s:
            task = P.SemanticVariable("go", session=s)
            a = first.options(temperature=3.0)(task, session=s)  # the server refuses it (400)
            b = second(task, a, session=s)
            for v in (a, b):
                with pytest.raises(StepFailed, match="HTTP 400"):
                    v.get(perf=P.LATENCY)


def test_the_adapter_reports_its_servers_step_cost_pooled_apart_from_builtin_engines(server):
    """Policies see an external engine's cost as they see a builtin one's: step statistics learned from its own
    generations, in its status; the dispatcher pools them per (model, kind), never with builtin engines."""
    from types import SimpleNamespace

    from parrot.common.step_cost import StepStats
    from parrot.manager.dispatcher import _cost_pool

    kind, url, _ = server

    async def go():
        eng = build_backend(BackendSpec(url), BackendKind(kind), "ext-0")
        try:
            for i in range(12):
                await eng.fill(await eng.tokenize(f"prompt number {i} " * (i + 1)), f"c{i}")
                await eng.generate(SamplingParams(max_tokens=8), f"c{i}")
            return await eng.status()
        finally:
            await eng.close()

    status = asyncio.run(go())
    stats = StepStats.from_wire(status.extra["step_stats"])
    assert stats.n > 11 and stats.fit() is not None  # n decays per sample (0.999)
    info = SimpleNamespace(name="fake/llama")
    assert _cost_pool(SimpleNamespace(info=info, status=status)) == ("fake/llama", kind)
    builtin = SimpleNamespace(info=info, status=SimpleNamespace(extra={"step_stats": status.extra["step_stats"]}))
    assert _cost_pool(builtin) == ("fake/llama", "builtin")
