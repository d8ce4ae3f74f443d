"""The FastAPI application: Parrot API + OpenAI-compatible API over a :class:`~parrot.manager.Manager`.

``create_app(settings, engines)`` builds the app; its lifespan creates the manager (sessions, DAG executor,
dispatcher, cleanup and heartbeat tasks) and the completion service in ``app.state`` and closes them on
shutdown (every session's engine contexts are freed). The engines are owned by the caller: the app never
closes them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from parrot.api import engine_routes, openai_routes, parrot_routes, tokenize_routes, ui_routes
from parrot.api import metrics_routes
from parrot.api.limits import InFlight
from parrot.api.middleware import BodyLimitMiddleware, TenantMiddleware
from parrot.api.tenants import RateLimiter, TenantKeys
from parrot.api.schemas import HealthResponse
from parrot.api.settings import ServerSettings
from parrot.drain import Drain, DrainMiddleware
from parrot.protocol.interface import EngineClient
from parrot.http_edge import install_error_handlers
from parrot.manager.completions import CompletionService
from parrot.manager.dispatcher import Policy
from parrot.manager.engine_registry import EngineRegistry, Listener
from parrot.manager.manager import Manager
from parrot.manager.responses_store import ResponsesService, ResponseStore


def create_app(settings: ServerSettings | None = None, engines: Sequence[EngineClient] = (), *,
               policy: Policy | None = None, clock: Callable[[], float] = time.time,
               engine_listeners: Sequence[Listener] = ()) -> FastAPI:
    """``clock``: the manager's one clock (session TTLs, stored responses' TTL); tests pass a fake one.
    ``engine_listeners``: called with each engine entry whose state changes (alive, dead), from the first
    probe on (``parrot serve`` prints "ready" from one)."""
    settings = settings or ServerSettings()
    engine_list = list(engines)
    EngineRegistry(engine_list)  # fail fast on nameless or duplicate engines, before serving

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry = EngineRegistry(engine_list)
        for listener in engine_listeners:
            registry.add_listener(listener)
        manager = Manager(registry, policy=policy, config=settings.manager_config(), clock=clock)
        await manager.start()
        app.state.manager = manager
        app.state.in_flight = InFlight(manager)  # per-tenant calls in flight (parrot.api.limits)
        app.state.completions = CompletionService(manager.dispatcher, max_n=settings.max_n,
                                                   max_attempts=settings.max_attempts, recent=manager.recent,
                                                   metrics=manager.metrics, predictors=manager.predictors)
        app.state.responses = ResponsesService(app.state.completions, ResponseStore(
            ttl_s=settings.responses_ttl_s, max_entries=settings.max_stored_responses, clock=manager.clock))
        app.state.started_at = time.time()
        try:
            yield
        finally:
            await manager.stop()

    app = FastAPI(title="Parrot", version="0.1.0", lifespan=lifespan,
                  description="LLM service for applications: Semantic Variables + OpenAI-compatible API")
    app.state.settings = settings
    app.state.engine_instances = {}  # registered engine name -> the instance token of the process holding it
    install_error_handlers(app)
    app.include_router(parrot_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(engine_routes.router)
    app.include_router(tokenize_routes.router)
    app.include_router(metrics_routes.router)  # GET /metrics (Prometheus)
    app.include_router(ui_routes.router)  # the live web view (/ui)

    @app.get("/health", response_model=HealthResponse, tags=["ops"])
    async def health(request: Request) -> HealthResponse:
        manager: Manager = request.app.state.manager
        engines_view = [{"name": e.name, "model": e.info.name if e.info else None, "healthy": e.healthy}
                        for e in manager.registry.entries()]
        return HealthResponse(status="ok", engines=engines_view)

    @app.get("/ready", tags=["ops"])
    async def ready(request: Request) -> JSONResponse:
        """200 when at least one engine is registered and healthy (work can run), else 503: a readiness probe.
        503 with ``"draining": true`` once SIGTERM started the drain (parrot.drain)."""
        live = [e.name for e in request.app.state.manager.registry.entries() if e.healthy]
        draining = request.app.state.drain.draining
        ok = bool(live) and not draining
        body = {"ready": ok, "engines": live, **({"draining": True} if draining else {})}
        return JSONResponse(body, status_code=200 if ok else 503)

    # the last middleware added is the outermost: the tenant (key, rate) first, then the body limit
    keys = TenantKeys(api_key=settings.api_key, keys_file=settings.api_keys_file, reload_s=settings.api_keys_reload_s)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(TenantMiddleware, keys=keys, limiter=RateLimiter(),
                       exempt_paths=("/health", "/ready", *ui_routes.PUBLIC_PATHS))  # /ui's page and code, no data
    # outermost: while draining, new work is refused before anything else reads it (parrot.drain)
    app.state.drain = Drain(grace_s=settings.shutdown_grace_s)
    app.add_middleware(DrainMiddleware, drain=app.state.drain, is_work=_is_work)
    return app


def _is_work(method: str, path: str) -> bool:
    """What a draining server refuses: requests that start something, but not the engines' own calls."""
    return method in ("POST", "PUT") and not path.startswith("/api/v1/engines/")
