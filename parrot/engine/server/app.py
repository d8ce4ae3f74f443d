"""`parrot engine`: the builtin engine as its own FastAPI process (Fill / Generate / FreeContext over HTTP).

Endpoints (prefix /engine/v1): fill, generate (JSON or SSE with ``stream``; optional ``hint``), free_context,
pause_context (a context handed over while a tool runs), status, tokenize,
detokenize, model_info, token_cap (the manager's placement hint); plus /health and /metrics (Prometheus).
Errors are OpenAI-style bodies with the typed error's status and code, and a streamed generate is the shared SSE
response (:mod:`parrot.http_edge`): ``data: {chunk}`` per chunk, an error event if the engine fails mid-stream, then
``data: [DONE]``; a client that disconnects closes the engine stream at once (the generation is aborted).
With a manager URL the engine registers itself and sends heartbeats carrying its status
(:mod:`parrot.engine.server.registration`); standalone it serves. A fill with an ``op_id`` is applied once however often
it is retried (:mod:`parrot.engine.server.op_memo`). On SIGTERM it drains (:mod:`parrot.drain`): new fills and
generates get 503 ``server_draining``, those in flight get ``shutdown_grace_s``.
It imports only the engine side, :mod:`parrot.common` and the HTTP edge: an engine process loads neither the API
app nor the manager (a test checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from parrot.common.errors import InvalidRequestError, UnknownContext
from parrot.common.sampling import SamplingParams
from parrot.drain import Drain, DrainMiddleware
from parrot.protocol.interface import EngineClient, OpHint, ToolHint
from parrot.protocol.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from parrot.protocol.metrics import render_status
from parrot.engine.server.op_memo import OpMemo
from parrot.engine.server.registration import ManagerLink
from parrot.protocol.wire import (
    DetokenizeRequest,
    FillRequest,
    FreeRequest,
    GenerateRequest,
    PauseRequest,
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
    advertise_url: str | None = Field(None, description="URL the manager should call (this engine as seen from the "
                                      "manager's host, e.g. http://10.0.0.5:9001 when bound to 0.0.0.0); default "
                                      "http://host:port")
    heartbeat_s: float = Field(1.0, gt=0, le=60)
    manager_max_backoff_s: float = Field(30.0, gt=0, le=600, description="longest wait between attempts to reach an "
                                         "unreachable or refusing manager (exponential backoff with jitter)")
    shutdown_grace_s: float = Field(5.0, ge=0, le=600, description="on SIGTERM: refuse new fills / generates (503), "
                                    "let those in flight finish for at most this long, then exit")

    def advertised_url(self) -> str:
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        if self.host in ("0.0.0.0", "::", ""):
            raise ValueError("an engine bound to all interfaces needs --advertise-url (the URL the manager calls)")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def create_engine_app(client: EngineClient, settings: EngineServerSettings | None = None) -> FastAPI:
    settings = settings or EngineServerSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None
        if settings.manager_url:
            secret = settings.manager_secret.get_secret_value() if settings.manager_secret is not None else None
            app.state.manager_link = ManagerLink(client, settings.manager_url, settings.advertised_url(),
                                                 secret=secret, heartbeat_s=settings.heartbeat_s,
                                                 max_backoff_s=settings.manager_max_backoff_s,
                                                 draining=lambda: app.state.drain.draining,
                                                 forgotten=free_orphans)
            task = asyncio.create_task(app.state.manager_link.run())
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
    # ids of the contexts made through this server and not freed: when a manager forgets this engine (it restarted,
    # or dropped us), nobody will free them any more, so they are freed before registering again
    contexts: set[str] = set()

    async def free_orphans() -> None:
        orphans = list(contexts)
        contexts.clear()
        for context_id in orphans:
            with contextlib.suppress(UnknownContext):
                await client.free_context(context_id)
        log.info("freed %d context(s) of a manager that no longer knows this engine", len(orphans))
    memo = app.state.op_memo = OpMemo()  # fills by op id: a retried fill is answered, not applied again
    app.state.drain = Drain(grace_s=settings.shutdown_grace_s)
    app.add_middleware(DrainMiddleware, drain=app.state.drain,
                       is_work=lambda method, path: method == "POST" and path in _WORK_PATHS)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "name": client.name}

    @app.post("/engine/v1/fill")
    async def fill(req: FillRequest) -> dict:
        contexts.add(req.context_id)

        hint = _hint(req.hint)

        def work():
            return client.fill(req.token_ids, req.context_id, req.parent_context_id,
                               prompt_logprobs=req.prompt_logprobs, hint=hint)

        if req.op_id is None:
            return to_json(await work())
        key = (req.context_id, req.parent_context_id, req.prompt_logprobs, hash(tuple(req.token_ids)))
        return to_json(await memo.run(req.op_id, key, work))

    @app.post("/engine/v1/generate")
    async def generate(req: GenerateRequest):
        sampling = SamplingParams.from_dict(req.sampling)
        hint = _hint(req.hint)
        contexts.add(req.context_id)
        if not req.stream:
            return to_json(await client.generate(sampling, req.context_id, req.parent_context_id, hint=hint))
        stream = client.generate_stream(sampling, req.context_id, req.parent_context_id, hint=hint)
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
        contexts.discard(req.context_id)
        await client.free_context(req.context_id)
        return {"freed": req.context_id}

    @app.post("/engine/v1/pause_context")
    async def pause_context(req: PauseRequest) -> dict:
        """The context is the engine's now (resumed by a later context continuing it, or freed at its TTL)."""
        res = await client.pause_context(req.context_id, ToolHint.from_wire(req.tool.model_dump()))
        contexts.discard(req.context_id)
        if res is None:  # an engine without tool handling freed it
            return {"context_id": req.context_id, "handling": None}
        return res.to_wire()

    @app.post("/engine/v1/token_cap")
    async def token_cap(req: TokenCapRequest) -> dict:
        applied = await client.set_token_cap(req.max_running_tokens)
        return {"max_running_tokens": req.max_running_tokens, "applied": applied}

    @app.get("/engine/v1/status")
    async def status() -> dict:
        return to_json(await client.status())

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics of this engine's current status (parrot.protocol.metrics)."""
        return Response(render_status(await client.status()), media_type=METRICS_CONTENT_TYPE)

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


_WORK_PATHS = frozenset({"/engine/v1/fill", "/engine/v1/generate"})  # refused while draining


def _hint(wire: dict | None) -> OpHint | None:
    """The request's OpHint; a malformed one is the caller's error (400 naming ``hint``), not the engine's."""
    try:
        return OpHint.from_wire(wire)
    except (TypeError, ValueError, AttributeError) as e:
        raise InvalidRequestError(f"invalid hint: {e}", param="hint") from e
