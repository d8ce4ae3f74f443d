"""`parrot engine` over HTTP (tiny random model): wire protocol, streaming, typed 4xx, and registration with
a manager (heartbeats make it healthy; the manager then serves completions through it)."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
import torch

from parrot.api.app import create_app
from parrot.api.settings import ServerSettings
from parrot.common.errors import BadSamplingParams, ContextLengthExceeded, UnknownContext
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.builder import build_engine
from parrot.engine.http_client import HTTPEngineClient
from parrot.engine.local_client import LocalEngineClient
from parrot.engine.models.llama import build_random_model
from parrot.engine.server import EngineServerSettings, create_engine_app
from parrot.engine.settings import EngineSettings
from parrot.frontend.local import LocalServer
from test_engine import TINY, default_tokenizer  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def engine_server(default_tokenizer):  # noqa: F811
    model = build_random_model(TINY, dtype=torch.float32, seed=0)
    eng = build_engine(EngineSettings(name="tiny-0", dtype="float32", weight_quant="none", kv_cache_tokens=2048),
                       model=model, tokenizer=default_tokenizer)
    srv = LocalServer(create_engine_app(LocalEngineClient(eng)))
    yield srv.url, eng
    srv.stop()


def test_http_client_roundtrip(engine_server):
    url, eng = engine_server

    async def main():
        c = HTTPEngineClient(url, "tiny-0")
        try:
            ids = await c.tokenize("Hello there, general Kenobi")
            assert await c.detokenize(ids) == "Hello there, general Kenobi"
            r = await c.fill(ids, "h1")
            assert r.context_len == len(ids)
            sp = SamplingParams(max_tokens=6, ignore_eos=True)
            g = await c.generate(sp, "h2", parent_context_id="h1")
            chunks = [ch async for ch in c.generate_stream(sp, "h3", parent_context_id="h1")]
            assert tuple(t for ch in chunks for t in ch.token_ids) == g.token_ids
            assert chunks[-1].finish_reason is FinishReason.LENGTH
            st = await c.status()
            assert st.name == "tiny-0" and st.num_contexts >= 3 and st.kv_blocks_used > 0
            info = await c.model_info()
            assert info.vocab_size == 49152 and info.max_model_len == 512
            with pytest.raises(UnknownContext):
                await c.free_context("nope")
            with pytest.raises(UnknownContext):
                await c.generate(sp, "x", parent_context_id="missing")
            with pytest.raises(ContextLengthExceeded):
                await c.fill(list(range(3, 700)), "big")
            for cid in ("h1", "h2", "h3"):
                await c.free_context(cid)
        finally:
            await c.close()

    asyncio.run(main())


def test_bad_input_is_4xx_with_a_named_problem(engine_server):
    url, _ = engine_server
    r = httpx.post(f"{url}/engine/v1/generate", json={"context_id": "a", "sampling": {"top_p": 7}})
    assert r.status_code == 400 and r.json()["error"]["code"] == BadSamplingParams.code
    assert "top_p" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/engine/v1/generate", json={"context_id": "a", "sampling": {"bogus": 1}})
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/engine/v1/fill", json={"context_id": "", "token_ids": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "context_id"
    r = httpx.post(f"{url}/engine/v1/fill", json={"context_id": "a", "token_ids": [-5]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_engine_registers_with_manager(default_tokenizer):  # noqa: F811
    manager = LocalServer(create_app(ServerSettings(engine_heartbeat_s=0)))
    model = build_random_model(TINY, dtype=torch.float32, seed=0)
    eng = build_engine(EngineSettings(name="reg-0", dtype="float32", weight_quant="none", kv_cache_tokens=1024),
                       model=model, tokenizer=default_tokenizer)
    with socket.socket() as s:  # learn a free port to advertise
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    es = EngineServerSettings(port=port, manager_url=manager.url, heartbeat_s=0.2)
    srv = LocalServer(create_engine_app(LocalEngineClient(eng), es), port=port)
    try:
        deadline = time.monotonic() + 20
        engines = []
        while time.monotonic() < deadline:
            engines = httpx.get(f"{manager.url}/api/v1/engines").json()["engines"]
            if engines and engines[0]["healthy"] and engines[0]["status"]:
                break
            time.sleep(0.1)
        assert engines and engines[0]["name"] == "reg-0" and engines[0]["healthy"]
        r = httpx.post(f"{manager.url}/v1/completions",
                       json={"model": engines[0]["model"], "prompt": "Once upon a time", "max_tokens": 4,
                             "ignore_eos": True}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()
        manager.stop()
