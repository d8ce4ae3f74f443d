"""Engine registration: `parrot engine --manager-url ...` processes announce themselves and push heartbeats."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from parrot.common.errors import EngineUnavailable, InvalidRequestError, NotFoundError
from parrot.engine import wire
from parrot.engine.http_client import HTTPEngineClient
from parrot.manager.manager import Manager

router = APIRouter(prefix="/api/v1/engines", tags=["engines"])


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str = Field(pattern=r"^http://(127\.\d+\.\d+\.\d+|localhost|\[::1\])(:\d+)?/?$")


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: dict


def _manager(request: Request) -> Manager:
    return request.app.state.manager


@router.post("/register")
async def register(req: RegisterRequest, request: Request) -> dict:
    registry = _manager(request).registry
    old = next((e for e in registry.entries() if e.name == req.name), None)
    entry = registry.register(HTTPEngineClient(req.url, req.name))
    if old is not None:
        await old.client.close()
    await registry.probe(entry)
    return {"name": entry.name, "healthy": entry.healthy}


@router.post("/{name}/heartbeat")
async def heartbeat(name: str, req: HeartbeatRequest, request: Request) -> dict:
    try:
        status = wire.engine_status(req.status)
    except TypeError as e:
        raise InvalidRequestError(f"bad engine status: {e}", param="status") from None
    try:
        entry = _manager(request).registry.record_heartbeat(name, status)
    except EngineUnavailable:
        raise NotFoundError(f"engine {name!r} is not registered", param="name") from None
    return {"name": entry.name, "healthy": entry.healthy}


@router.get("")
async def list_engines(request: Request) -> dict:
    return {"engines": [
        {"name": e.name, "healthy": e.healthy, "model": e.info.name if e.info else None,
         "status": wire.to_json(e.status) if e.status else None, "last_error": e.last_error}
        for e in _manager(request).registry.entries()]}
