"""`parrot engine` over HTTP (tiny random model): wire protocol, streaming, typed 4xx, and registration with
a manager (heartbeats make it healthy; the manager then serves completions through it)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from parrot.api.app import create_app
from parrot.api.settings import ServerSettings
from parrot.common.errors import BadSamplingParams, ContextLengthExceeded, EngineError, UnknownContext
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.loader.builder import build_engine
from parrot.engine.clients.http_client import HTTPEngineClient
from parrot.engine.clients.local_client import LocalEngineClient
from parrot.engine.models.assembly import build_random_model
from parrot.engine.server.app import EngineServerSettings, create_engine_app
from parrot.engine.settings import EngineSettings
from parrot.frontend.local import LocalServer
from fakes import FakeEngine
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
    for hint in ({"tpot_s": -1}, {"elapsed_s": "soon"}, {"priority": "high"}):
        for path, body in (("fill", {"context_id": "h", "token_ids": [1]}), ("generate", {"context_id": "h"})):
            r = httpx.post(f"{url}/engine/v1/{path}", json={**body, "hint": hint})
            assert r.status_code == 400 and r.json()["error"]["param"] == "hint", (path, hint, r.text)
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_engine_registers_with_manager(default_tokenizer):  # noqa: F811
    secret = "engine-server-test-secret-123"
    manager = LocalServer(create_app(ServerSettings(engine_heartbeat_s=0, engine_secret=secret)))
    model = build_random_model(TINY, dtype=torch.float32, seed=0)
    eng = build_engine(EngineSettings(name="reg-0", dtype="float32", weight_quant="none", kv_cache_tokens=1024),
                       model=model, tokenizer=default_tokenizer)
    with socket.socket() as s:  # learn a free port to advertise
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    es = EngineServerSettings(port=port, manager_url=manager.url, heartbeat_s=0.2, manager_secret=secret)
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


def test_engine_server_loads_neither_the_api_nor_the_manager():
    code = ("import sys, parrot.engine.server.app; "
            "loaded = sorted(m for m in sys.modules if m.startswith(('parrot.api', 'parrot.manager'))); "
            "assert not loaded, loaded")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


class StallingEngine(FakeEngine):
    """Streams one token, then either hangs (until the stream is closed) or fails with EngineError."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__("stall-0")
        self.fail = fail
        self.streaming = threading.Event()  # set once the first token is out
        self.closed = threading.Event()  # set when the engine stream is closed (the generation would abort)

    async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
        try:
            yield (await anext(super().generate_stream(sampling, context_id, parent_context_id, hint=hint)))
            self.streaming.set()
            if self.fail:
                raise EngineError("fake engine failure mid-stream")
            await asyncio.Event().wait()  # never set: only closing the stream ends it
        finally:
            self.closed.set()


def asgi_spec(app, version: str | None):
    """``app`` as served by a server speaking ASGI ``version`` (None: as uvicorn says). From 2.4 on Starlette's
    own StreamingResponse stops listening for disconnects and waits for a failed write instead."""
    if version is None:
        return app

    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": version}}
        await app(scope, receive, send)

    return wrapped


@pytest.mark.parametrize("spec_version", [None, "2.4"])
def test_engine_stream_client_disconnect_closes_the_engine_stream_at_once(spec_version):
    engine = StallingEngine()
    srv = LocalServer(asgi_spec(create_engine_app(engine), spec_version))
    try:
        asyncio.run(engine.fill(FakeEngine.encode("hello"), "c1"))
        body = {"context_id": "c1", "sampling": {"max_tokens": 50, "ignore_eos": True}, "stream": True}
        with httpx.Client(timeout=10) as h, h.stream("POST", f"{srv.url}/engine/v1/generate", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()  # held: closing this iterator would close the response
            first = next(lines)
            assert first.startswith("data: ") and '"token_ids":[' in first
            assert engine.streaming.wait(5) and not engine.closed.is_set()  # hanging, with no chunk to come
        # no further chunk would ever come: only the disconnect watcher can notice the client left
        assert engine.closed.wait(2), "the engine stream was not closed when the client disconnected"
    finally:
        srv.stop()


def test_engine_stream_error_event_reaches_the_http_client_typed():
    engine = StallingEngine(fail=True)
    srv = LocalServer(create_engine_app(engine))

    async def main():
        await engine.fill(FakeEngine.encode("hello"), "c1")
        c = HTTPEngineClient(srv.url, "stall-0")
        got = []
        try:
            with pytest.raises(EngineError, match="mid-stream"):
                async for chunk in c.generate_stream(SamplingParams(max_tokens=50, ignore_eos=True), "c1"):
                    got.append(chunk)
        finally:
            await c.close()
        return got

    try:
        got = asyncio.run(main())
        assert len(got) == 1 and len(got[0].token_ids) == 1 and engine.closed.is_set()
    finally:
        srv.stop()
