"""Engine registration: `parrot engine --manager-url ...` processes announce themselves and push heartbeats.

Engines are not tenants. They prove themselves with the server's engine secret (``X-Parrot-Engine-Secret``,
compared in constant time), never with an API key; without a configured secret registration is closed (403).
Each engine process also sends an ``instance`` token of its own (random per process), and a name belongs to the
instance that holds it::

    register(name, url, instance)
      secret wrong / missing                      -> 401  (nothing changes)
      name held by a builtin (in-process) engine  -> 409
      name held by a live engine, other instance  -> 409  (a newcomer never takes over a live engine)
      url outside --engine-networks               -> 400  (the manager calls only where engines may live)
      url does not answer its health check        -> 400  (nothing changes: a live engine is never evicted)
      otherwise                                   -> the engine is (re)registered under the name

Same instance again (the manager forgot it, or restarted) or a dead holder (crashed, replaced) may register.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from parrot.common.errors import (
    EngineNameTaken,
    EngineRegistrationClosed,
    EngineUnavailable,
    InvalidEngineSecret,
    InvalidRequestError,
    NotFoundError,
)
from parrot.protocol import wire
from parrot.engine.clients.http_client import HTTPEngineClient
from parrot.manager.manager import Manager

router = APIRouter(prefix="/api/v1/engines", tags=["engines"])
_RESOLVE_TIMEOUT_S = 5.0  # a registering engine's host name
SECRET_HEADER = wire.ENGINE_SECRET_HEADER


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    # scheme, host (name, IPv4 or [IPv6]) and port only: no user info, path, query or fragment
    url: str = Field(max_length=300,
                     pattern=r"^https?://[A-Za-z0-9.\-]+(:\d+)?/?$|^https?://\[[0-9A-Fa-f:.]+\](:\d+)?/?$")
    instance: str = Field(min_length=8, max_length=128, description="random per engine process (parrot engine)")

    @field_validator("url")
    @classmethod
    def _parsable(cls, url: str) -> str:
        """The pattern admits URL-looking text; this admits only what parses, with a port in 1..65535 (whether
        the host is in the server's ``engine_networks`` is checked by the route)."""
        try:
            parts = urlsplit(url)
            port = parts.port  # ValueError for a port outside 0..65535
            if not parts.hostname:
                raise ValueError("no host")
        except ValueError as e:
            raise ValueError(f"bad engine url {url!r}: {e}") from None
        if port == 0:
            raise ValueError(f"bad engine url {url!r}: port 0")
        return url


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: dict
    instance: str = Field(min_length=8, max_length=128)


def _manager(request: Request) -> Manager:
    return request.app.state.manager


def _check_secret(request: Request) -> None:
    secret = request.app.state.settings.engine_secret
    if secret is None:
        raise EngineRegistrationClosed("engine registration is closed: start the server with --engine-secret "
                                       "(PARROT_ENGINE_SECRET) and give the engines the same secret "
                                       "(--manager-secret / PARROT_ENGINE_SERVER_MANAGER_SECRET)")
    given = request.headers.get(SECRET_HEADER, "").encode()
    if not hmac.compare_digest(given, secret.get_secret_value().encode()):
        raise InvalidEngineSecret(f"{'missing' if not given else 'invalid'} engine secret: send {SECRET_HEADER}",
                                  param=SECRET_HEADER)


@router.post("/register")
async def register(req: RegisterRequest, request: Request) -> dict:
    _check_secret(request)
    registry = _manager(request).registry
    instances: dict[str, str] = request.app.state.engine_instances
    old = next((e for e in registry.entries() if e.name == req.name), None)
    if old is not None and instances.get(req.name) != req.instance:
        if req.name not in instances:
            raise EngineNameTaken(f"engine name {req.name!r} belongs to an engine inside the server", param="name")
        if old.healthy:
            raise EngineNameTaken(f"engine name {req.name!r} is held by another live engine", param="name")
    await _check_network(req.url, request.app.state.settings)
    client = HTTPEngineClient(req.url, req.name, policy=request.app.state.settings.engine_call_policy())
    try:
        await client.model_info()  # the health check comes before anything changes
    except EngineUnavailable as e:
        await client.close()
        raise InvalidRequestError(f"engine {req.name!r} at {req.url} did not answer its health check: {e}; "
                                  "not registered", param="url") from None
    entry = registry.register(client)
    instances[req.name] = req.instance
    if old is not None:
        await old.client.close()
    await registry.probe(entry)
    return {"name": entry.name, "healthy": entry.healthy}


async def _check_network(url: str, settings) -> None:
    """400 (param ``url``) unless every address the URL's host resolves to is in ``engine_networks``: the manager
    calls only where its operator said engines live."""
    networks = settings.parse_networks(settings.engine_networks)
    if networks is None:
        return
    host = urlsplit(url).hostname or ""
    try:
        addrs = {ipaddress.ip_address(host)}
    except ValueError:
        addrs = set()
    if not addrs and host == "localhost":
        addrs = {ipaddress.ip_address("127.0.0.1")}
    elif not addrs and all(n.is_loopback for n in networks):
        pass  # loopback networks only: a name other than localhost is outside them (no DNS lookup)
    elif not addrs:
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM), _RESOLVE_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            raise InvalidRequestError(f"engine url host {host!r} does not resolve: {e!r}", param="url") from None
        addrs = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    outside = sorted(str(a) for a in addrs if not any(a in n for n in networks))
    if outside or not addrs:
        raise InvalidRequestError(f"engine url {url!r}: {', '.join(outside) or host} is outside the server's engine "
                                  f"networks ({settings.engine_networks}; --engine-networks)", param="url")


@router.post("/{name}/heartbeat")
async def heartbeat(name: str, req: HeartbeatRequest, request: Request) -> dict:
    _check_secret(request)
    holder = request.app.state.engine_instances.get(name)
    if holder is not None and holder != req.instance:  # a replaced process: it must stop speaking for the name
        raise EngineNameTaken(f"engine name {name!r} is held by another engine instance", param="name")
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
         "status": wire.to_json(e.status) if e.status else None, "last_error": e.last_error,
         "retries": getattr(e.client, "num_retries", None)}  # calls repeated after network failures (HTTP engines)
        for e in _manager(request).registry.entries()]}
