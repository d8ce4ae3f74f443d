"""llama.cpp's own server (`llama-server`, built by scripts/install-llama-server.sh) on the default GGUF as an
external engine: the adapter's operations against it, then the paper's apps through `parrot serve --backend`,
and what happens when that server dies (with and without another engine left)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

import parrot as P
from backend_servers import ROOT, llama_server, llama_server_or_skip, parrot_serve
from parrot.backends import BackendKind, BackendSpec, build_backend, detect_kind
from parrot.common.errors import ContextLengthExceeded, StepFailed
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.protocol.interface import EngineCapabilities

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def llama(default_model_path):
    llama_server_or_skip()
    with llama_server(default_model_path, ctx=4096, slots=4) as (url, proc):
        yield url


def _engine(url: str):
    return build_backend(BackendSpec(url), BackendKind.LLAMACPP, "llamacpp-0")


def test_detect_info_and_status(llama):
    assert asyncio.run(detect_kind(llama)) is BackendKind.LLAMACPP

    async def go():
        eng = _engine(llama)
        try:
            return await eng.model_info(), await eng.status(), await eng.tokenize("Hello world")
        finally:
            await eng.close()

    info, status, ids = asyncio.run(go())
    assert info.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and info.max_model_len == 4096  # one unified 4096-token cache
    assert info.chat_template and info.eos_token_ids
    caps = EngineCapabilities.from_status(status)
    assert caps.fork and caps.prefix_cache and caps.kv_tokens and caps.kv_tokens >= 4096
    assert len(ids) == 2  # "Hello", " world"


def test_fill_fork_generate_stream_stop(llama):
    async def go():
        eng = _engine(llama)
        try:
            prefix = await eng.tokenize("The capital of France is Paris. The capital of Spain is Madrid.")
            await eng.fill(prefix, "p")
            await eng.fill(await eng.tokenize(" The capital of Italy is"), "a", "p")
            await eng.fill(await eng.tokenize(" The capital of Germany is"), "b", "p")
            ra = await eng.generate(SamplingParams(max_tokens=6), "a")
            # the fork `b` shares p's prefix: llama.cpp's slot cache serves it (cache_prompt)
            rb = await eng.generate(SamplingParams(max_tokens=6, stop=(".",)), "b")
            chunks = [c async for c in eng.generate_stream(SamplingParams(max_tokens=5), "c", "p")]
            # a second generation of `a` continues after what the first one produced
            await eng.fill(await eng.tokenize(" And"), "a")
            ra2 = await eng.generate(SamplingParams(max_tokens=3), "a")
            text_a = await eng.detokenize(list(prefix) + await eng.tokenize(" The capital of Italy is"))
            return prefix, ra, rb, chunks, ra2, text_a
        finally:
            await eng.close()

    prefix, ra, rb, chunks, ra2, text_a = asyncio.run(go())
    assert "Rome" in ra.text and ra.finish_reason is FinishReason.LENGTH and len(ra.token_ids) == 6
    assert "Berlin" in rb.text and "." not in rb.text and rb.finish_reason is FinishReason.STOP
    assert ra2.prompt_len == ra.prompt_len + len(ra.token_ids) + 1
    assert chunks[-1].finish_reason is FinishReason.LENGTH and "".join(c.text for c in chunks).strip()
    assert sum(len(c.token_ids) for c in chunks) == 5
    assert text_a.endswith("The capital of Italy is")


def test_greedy_matches_llama_server_directly(llama):
    """Through the adapter or straight to the server: the same tokens for the same prompt."""
    async def go():
        eng = _engine(llama)
        try:
            ids = await eng.tokenize("Once upon a time")
            await eng.fill(ids, "x")
            return ids, await eng.generate(SamplingParams(max_tokens=8), "x")
        finally:
            await eng.close()

    ids, r = asyncio.run(go())
    direct = httpx.post(f"{llama}/completion", timeout=60, json={
        "prompt": ids, "n_predict": 8, "temperature": 0, "return_tokens": True, "cache_prompt": False}).json()
    assert list(r.token_ids) == direct["tokens"] and r.text == direct["content"]


def test_context_length_is_typed(llama):
    async def go():
        eng = _engine(llama)
        try:
            with pytest.raises(ContextLengthExceeded):
                await eng.fill([1] * 5000, "big")
        finally:
            await eng.close()

    asyncio.run(go())


# ---- the apps through `parrot serve --backend <llama-server>` ------------------------------------------------------
@pytest.fixture(scope="module")
def manager(llama):
    with parrot_serve("--backend", llama, "--engine-heartbeat-s", "0.5", timeout_s=60) as (url, _):
        yield url


def _example(name: str, url: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--url", url, *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_fig7_and_map_reduce_examples(manager):
    fig7 = _example("snake_game.py", manager)
    assert "=== code ===" in fig7 and "=== test ===" in fig7
    code = fig7.split("=== code ===", 1)[1].split("=== test ===")[0]
    assert code.strip()
    mr = _example("map_reduce_summary.py", manager, "--chunks", "3", "--chunk-words", "60", "--max-tokens", "16")
    assert "=== final summary (3 maps + 1 reduce" in mr and mr.count("[chunk ") == 3


@P.semantic_function(max_tokens=12)
def write_code(task: P.SemanticVariable):
    """You are an expert software engineer.
    Write python code of {{input:task}}.
    Code: {{output:code}}"""


@P.semantic_function(max_tokens=12)
def write_test(task: P.SemanticVariable, code: P.SemanticVariable):
    """You are an experienced QA engineer.
    You write test code for {{input:task}}.
    Code: {{input:code}}.
    Your test code: {{output:test}}"""


def test_dag_dump_names_the_external_engine(manager):
    with P.connect(manager) as s:
        task = P.SemanticVariable("a snake game", session=s)
        code = write_code(task, session=s)
        test = write_test(task, code, session=s)
        assert code.get(perf=P.LATENCY) is not None and test.get(perf=P.LATENCY) is not None
        dag = s.dag()
    assert {r["engine"] for r in dag["requests"]} == {"llamacpp-0"}
    assert dag["text"].count("engine llamacpp-0") == 2, dag["text"]


@P.semantic_function(max_tokens=400, ignore_eos=True, stop=[])
def ramble(topic: P.SemanticVariable):
    """Write a very long essay about {{input:topic}}: {{output:essay}}"""


@P.semantic_function(max_tokens=8)
def title(essay: P.SemanticVariable):
    """A title for: {{input:essay}}
Title: {{output:title}}"""


def _wait_running(s, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r["status"] == "running" for r in s.dag()["requests"]):
            return
        time.sleep(0.1)
    raise AssertionError("no request started running")


def test_killing_the_only_server_fails_every_dependent_get(default_model_path):
    llama_server_or_skip()
    with llama_server(default_model_path, ctx=4096, slots=4) as (url, proc), \
            parrot_serve("--backend", url, "--engine-heartbeat-s", "0.5", timeout_s=60) as (murl, _):
        with P.connect(murl) as s:
            essays = [ramble(P.SemanticVariable(t, session=s), session=s) for t in ("the sea", "the sky")]
            titles = [title(e, session=s) for e in essays]
            _wait_running(s)
            os.kill(proc.pid, signal.SIGKILL)
            started = time.monotonic()
            for v in essays + titles:
                with pytest.raises(StepFailed) as err:
                    v.get(perf=P.LATENCY, timeout=60)
                assert err.value.cause_code == "engine_unavailable", err.value
            assert time.monotonic() - started < 60
        assert "no live engine" in str(err.value)  # the last one was lost: nowhere to run again


def test_killing_one_of_two_servers_reschedules_on_the_other(default_model_path):
    llama_server_or_skip()
    with llama_server(default_model_path, ctx=4096, slots=4) as (url0, proc0), \
            llama_server(default_model_path, ctx=4096, slots=4) as (url1, _), \
            parrot_serve("--backend", f"llamacpp={url0}", "--backend", url1, "--engine-heartbeat-s", "0.5",
                         "--policy", "round-robin", timeout_s=60) as (murl, _):
        engines = httpx.get(f"{murl}/api/v1/engines", timeout=10).json()["engines"]
        assert sorted(e["name"] for e in engines) == ["llamacpp-0", "llamacpp-1"]
        with P.connect(murl) as s:
            short = ramble.options(max_tokens=120)
            essays = [short(P.SemanticVariable(t, session=s), session=s) for t in ("the sea", "the sky", "rain")]
            titles = [title(e, session=s) for e in essays]
            _wait_running(s)
            os.kill(proc0.pid, signal.SIGKILL)
            values = [v.get(perf=P.LATENCY, timeout=240) for v in essays + titles]
            dag = s.dag()
    assert all(isinstance(v, str) for v in values) and all(values[:3])
    assert {r["engine"] for r in dag["requests"]} == {"llamacpp-1"}  # everything ended up on the survivor


def test_mixed_cluster_builtin_and_external(llama):
    """One manager, a builtin engine process (the tiny random model) and llama-server: both registered, each
    advertising its own capabilities, and requests naming a model go to the engine serving it."""
    from engine_procs import TINY_ENGINE

    # shared-prefix attention forced on: under `auto` the engine keeps it only where it measures faster
    with parrot_serve("--engines", "1", "--backend", llama, "--engine-heartbeat-s", "0.5", *TINY_ENGINE,
                      "--shared-prefix-attention", "on", timeout_s=120) as (url, _):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            engines = {e["name"]: e for e in httpx.get(f"{url}/api/v1/engines", timeout=10).json()["engines"]}
            if len(engines) == 2 and all(e["healthy"] for e in engines.values()):
                break
            time.sleep(0.2)
        assert set(engines) == {"engine-0", "llamacpp-0"}, engines
        builtin, external = engines["engine-0"]["status"]["extra"], engines["llamacpp-0"]["status"]["extra"]
        assert builtin["capabilities"]["shared_prefix_attention"] is True
        assert external["capabilities"]["shared_prefix_attention"] is False
        assert external["capabilities"]["token_ids"] is True and external["backend"]["kind"] == "llamacpp"
        models = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert models == {engines["engine-0"]["model"], "SmolLM2-135M-Instruct.Q4_1.gguf"}
        direct = httpx.post(f"{llama}/v1/completions", timeout=60, json={
            "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}).json()["choices"][0]["text"]
        via = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "prompt": "The capital of France is", "max_tokens": 5,
            "temperature": 0}).json()
        assert via["choices"][0]["text"] == direct  # served by llama.cpp, not by the random model
        tiny = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": engines["engine-0"]["model"], "prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert tiny.status_code == 200, tiny.text


def test_logit_bias_and_min_p_reach_llama_server(llama):
    """logit_bias (+100 on one token) makes the server generate that token; min_p 1.0 keeps only the top token
    (a sampled run at temperature 1 equals the greedy one)."""
    async def go():
        eng = _engine(llama)
        try:
            ids = await eng.tokenize("The capital of France is")
            forced = (await eng.tokenize(" banana"))[0]
            await eng.fill(ids, "x")
            biased = await eng.generate(SamplingParams(max_tokens=3, logit_bias={forced: 100.0}), "x")
            await eng.fill(ids, "g")
            greedy = await eng.generate(SamplingParams(max_tokens=6), "g")
            await eng.fill(ids, "m")
            top_only = await eng.generate(SamplingParams(max_tokens=6, temperature=1.0, min_p=1.0, seed=3), "m")
            return forced, biased, greedy, top_only
        finally:
            await eng.close()

    forced, biased, greedy, top_only = asyncio.run(go())
    assert list(biased.token_ids) == [forced] * 3
    assert top_only.token_ids == greedy.token_ids


def test_cached_tokens_come_from_the_servers_prefix_cache(manager):
    """A prompt llama-server has seen: its slot cache serves the head again, and Parrot's usage says so (an
    external server prefills at generate time, so its own count is the one reported), whole and streamed."""
    import openai

    client = openai.OpenAI(base_url=manager + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    prompt = "Colours: " + ", ".join(["red", "green", "blue", "yellow"] * 30) + ". Name one:"
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 100
    assert 100 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens, again.usage
    streamed = list(client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens > 100, streamed[-1].usage
