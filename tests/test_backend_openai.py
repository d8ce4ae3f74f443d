"""A generic OpenAI-compatible backend for real: `parrot serve` (builtin engine, default model) behind another
`parrot serve --backend URL` (no engine of its own), both real processes.

The conformance programs at the bottom run unchanged against the builtin engine (the first server directly) and
the adapter (the second), with the same assertions."""

from __future__ import annotations

import httpx
import pytest

import parrot as P
from backend_servers import parrot_serve

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def servers(default_model_path):
    with parrot_serve() as (inner, _):
        with parrot_serve("--backend", inner, "--engine-heartbeat-s", "0.5", timeout_s=60) as (outer, _):
            yield inner, outer


@P.semantic_function(max_tokens=8, stop=[])
def answer(question: P.SemanticVariable):
    """Fact: {{input:question}}{{output:a}}"""


def test_backend_registered_with_its_capabilities(servers):
    _, outer = servers
    engines = httpx.get(f"{outer}/api/v1/engines", timeout=10).json()["engines"]
    assert [e["name"] for e in engines] == ["openai-0"] and engines[0]["healthy"]
    extra = engines[0]["status"]["extra"]
    assert extra["backend"]["kind"] == "openai"
    assert extra["capabilities"]["fork"] is True and extra["capabilities"]["token_ids"] is False
    models = httpx.get(f"{outer}/v1/models", timeout=10).json()["data"]
    assert models[0]["id"] == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_adapter_output_is_the_servers_completion_of_the_same_text(servers):
    """The adapter's context is the exact prompt text: its output equals the inner server's own completion."""
    inner, outer = servers
    with P.connect(outer) as s:
        value = answer(P.SemanticVariable("The capital of France is", session=s), session=s).get(perf=P.LATENCY)
        dag = s.dag()
    direct = httpx.post(f"{inner}/v1/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "prompt": "Fact: The capital of France is",
        "max_tokens": 8, "temperature": 0}).json()
    assert value == direct["choices"][0]["text"] and value.strip()
    assert dag["requests"][0]["engine"] == "openai-0"


def test_openai_api_through_the_adapter(servers):
    inner, outer = servers
    body = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "prompt": "The capital of France is", "max_tokens": 6,
            "temperature": 0}
    via = httpx.post(f"{outer}/v1/completions", json=body, timeout=120).json()
    direct = httpx.post(f"{inner}/v1/completions", json=body, timeout=120).json()
    assert via["choices"][0]["text"] == direct["choices"][0]["text"]
    assert via["choices"][0]["finish_reason"] == "length"
    with httpx.stream("POST", f"{outer}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        streamed = "".join(__import__("json").loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                           if line.startswith("data: {"))
    assert streamed == direct["choices"][0]["text"]
    chat = httpx.post(f"{outer}/v1/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 6, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"]


# ---- conformance: the same app programs over the builtin engine and the adapter ---------------------------------
@P.semantic_function(max_tokens=8)
def write_code(task: P.SemanticVariable):
    """You are an expert software engineer.
    Write python code of {{input:task}}.
    Code: {{output:code}}"""


@P.semantic_function(max_tokens=8)
def write_test(task: P.SemanticVariable, code: P.SemanticVariable):
    """You are an experienced QA engineer.
    You write test code for {{input:task}}.
    Code: {{input:code}}.
    Your test code: {{output:test}}"""


@P.semantic_function(max_tokens=8, stop=["\n"], transforms=[P.strip()])
def summarize(chunk: P.SemanticVariable):
    """Summarize: {{input:chunk}}
Summary: {{output:summary}}"""


@P.semantic_function(max_tokens=8, stop=["\n"], transforms=[P.strip()])
def combine(a: P.SemanticVariable, b: P.SemanticVariable):
    """Combine these summaries: {{input:a}}; {{input:b}}
Combined: {{output:final}}"""


def _fig7(s):
    task = P.SemanticVariable("a snake game", session=s)
    code = write_code(task, session=s)
    test = write_test(task, code, session=s)
    return [code.get(perf=P.LATENCY), test.get(perf=P.LATENCY)]


def _map_reduce(s):
    parts = [summarize(P.SemanticVariable(c, session=s), session=s)
             for c in ("Lighthouses guide ships at night.", "Keepers once lived in the towers.")]
    final = combine(*parts, session=s)
    return [final.get(perf=P.LATENCY), *(p.get(perf=P.LATENCY) for p in parts)]


@pytest.mark.parametrize("program", [_fig7, _map_reduce], ids=["fig7", "map_reduce"])
@pytest.mark.parametrize("target", ["builtin", "adapter"])
def test_conformance_programs(servers, program, target):
    inner, outer = servers
    url = inner if target == "builtin" else outer
    with P.connect(url) as s:
        values = program(s)
        dag = s.dag()
    assert all(isinstance(v, str) for v in values) and any(v.strip() for v in values)
    # every request ran (a value is set before its request is marked finished, so "running" may still show)
    assert all(r["status"] in ("running", "finished") for r in dag["requests"]), dag["text"]
    engines = {r["engine"] for r in dag["requests"]}
    assert engines == ({"openai-0"} if target == "adapter" else {"engine-0"})
