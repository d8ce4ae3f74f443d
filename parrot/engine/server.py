"""`parrot engine`: the builtin engine as its own FastAPI process (Fill / Generate / FreeContext over HTTP).

Endpoints (prefix /engine/v1): fill, generate (JSON or SSE with ``stream``), free_context, status, tokenize,
detokenize, model_info, token_cap (the manager's placement hint); plus /health. Errors are OpenAI-style bodies
with the typed error's status and code, and a streamed generate is the shared SSE response
(:mod:`parrot.http_edge`): ``data: {chunk}`` per chunk, an error event if the engine fails mid-stream, then
``data: [DONE]``; a client that disconnects closes the engine stream at once (the generation is aborted).
With a manager URL the engine registers itself and sends heartbeats carrying its status; standalone it serves.
It imports only the engine side, :mod:`parrot.common` and the HTTP edge: an engine process loads neither the API
app nor the manager (a test checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

import anyio
import httpx
from fastapi import FastAPI
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from parrot.common.sampling import SamplingParams
from parrot.engine.interface import EngineClient
from parrot.engine.wire import (
    ENGINE_SECRET_HEADER,
    DetokenizeRequest,
    FillRequest,
    FreeRequest,
    GenerateRequest,
    TokenCapRequest,
    TokenizeRequest,
    to_json,
)
from parrot.http_edge import EventStreamResponse, install_error_handlers

log = logging.getLogger(__name__)


class EngineServerSettings(BaseSettings):
    """Network side of `parrot engine` (the engine itself is configured by EngineSettings)."""

    model_config = SettingsConfigDict(env_prefix="PARROT_ENGINE_SERVER_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(9000, ge=0, le=65535)
    manager_url: str | None = Field(None, description="register with this manager and send heartbeats")
    manager_secret: SecretStr | None = Field(None, description="the manager's engine secret (its --engine-secret), "
                                             "sent with registration and heartbeats")
    advertise_url: str | None = Field(None, description="URL the manager should call; default http://host:port")
    heartbeat_s: float = Field(1.0, gt=0, le=60)


def create_engine_app(client: EngineClient, settings: EngineServerSettings | None = None) -> FastAPI:
    settings = settings or EngineServerSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None
        if settings.manager_url:
            task = asyncio.create_task(_register_loop(client, settings))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await client.close()

    app = FastAPI(title="Parrot engine", lifespan=lifespan)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "name": client.name}

    @app.post("/engine/v1/fill")
    async def fill(req: FillRequest) -> dict:
        return to_json(await client.fill(req.token_ids, req.context_id, req.parent_context_id,
                                         prompt_logprobs=req.prompt_logprobs))

    @app.post("/engine/v1/generate")
    async def generate(req: GenerateRequest):
        sampling = SamplingParams.from_dict(req.sampling)
        if not req.stream:
            return to_json(await client.generate(sampling, req.context_id, req.parent_context_id))
        stream = client.generate_stream(sampling, req.context_id, req.parent_context_id)
        first = await anext(stream)  # errors before the first token still become a typed 4xx/5xx

        async def events() -> AsyncIterator[dict]:
            # the response closes this iterator however the stream ends (done, failed, client gone); closing
            # the engine stream then aborts its generation
            try:
                yield to_json(first)
                async for chunk in stream:
                    yield to_json(chunk)
            finally:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

        return EventStreamResponse(events())

    @app.post("/engine/v1/free_context")
    async def free_context(req: FreeRequest) -> dict:
        await client.free_context(req.context_id)
        return {"freed": req.context_id}

    @app.post("/engine/v1/token_cap")
    async def token_cap(req: TokenCapRequest) -> dict:
        applied = await client.set_token_cap(req.max_running_tokens)
        return {"max_running_tokens": req.max_running_tokens, "applied": applied}

    @app.get("/engine/v1/status")
    async def status() -> dict:
        return to_json(await client.status())

    @app.post("/engine/v1/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        return {"token_ids": await client.tokenize(req.text)}

    @app.post("/engine/v1/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        return {"text": await client.detokenize(req.token_ids)}

    @app.get("/engine/v1/model_info")
    async def model_info() -> dict:
        return to_json(await client.model_info())

    return app


async def _register_loop(client: EngineClient, settings: EngineServerSettings) -> None:
    """Register with the manager, then heartbeat with status; re-register whenever the manager forgets us."""
    url = settings.advertise_url or f"http://{settings.host}:{settings.port}"
    base = settings.manager_url.rstrip("/")
    instance = secrets.token_urlsafe(16)  # this process: the manager keeps our name for us, not for a newcomer
    secret = settings.manager_secret.get_secret_value() if settings.manager_secret is not None else ""
    headers = {ENGINE_SECRET_HEADER: secret} if secret else {}
    registered = False
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as http:
        while True:
            try:
                status = to_json(await client.status())
                if not registered:
                    r = await http.post(f"{base}/api/v1/engines/register",
                                        json={"name": client.name, "url": url, "instance": instance})
                    r.raise_for_status()
                    registered = True
                    log.info("registered with manager %s as %s", base, client.name)
                r = await http.post(f"{base}/api/v1/engines/{client.name}/heartbeat",
                                    json={"status": status, "instance": instance})
                if r.status_code == 404:
                    registered = False  # the manager restarted or declared us dead: register again
                else:
                    r.raise_for_status()
            except httpx.HTTPStatusError as e:  # refused: bad secret, name taken... (retried: it may change)
                registered = False
                log.warning("manager %s refused %s: %s", base, e.request.url.path, _error_message(e.response))
            except httpx.HTTPError as e:
                registered = False
                log.warning("manager %s unreachable (%s); retrying", base, e)
            await asyncio.sleep(settings.heartbeat_s)


def _error_message(resp: httpx.Response) -> str:
    try:
        return f"{resp.status_code} {resp.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{resp.status_code} {resp.text[:200]}"
