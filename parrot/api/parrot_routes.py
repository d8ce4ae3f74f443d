"""Parrot API routes (``/api/v1``): sessions, Semantic Variables, submit, get, DAG (docs/api.md).

Routes validate and delegate to the :class:`~parrot.manager.Manager` in ``app.state``; errors are typed and
mapped once by :mod:`parrot.http_edge`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request

from parrot.api.schemas import (
    CreateSessionRequest,
    CreateVariableRequest,
    DagResponse,
    DeletedResponse,
    SessionResponse,
    SetVariableRequest,
    SubmitRequest,
    SubmitResponse,
    VariableResponse,
)
from parrot.api.tenants import ANONYMOUS, Tenant
from parrot.common.perf import LatencyTargets
from parrot.manager.manager import Manager
from parrot.manager.session import SessionState
from parrot.manager.submit import PlaceholderSpec, SubmitSpec

router = APIRouter(prefix="/api/v1", tags=["parrot"])

SESSION_TOKEN_HEADER = "X-Parrot-Session-Token"


def get_manager(request: Request) -> Manager:
    return request.app.state.manager


def get_tenant(request: Request) -> Tenant:
    """The caller's tenant (set by parrot.api.middleware.TenantMiddleware)."""
    return getattr(request.state, "tenant", ANONYMOUS)


def get_session(sid: str, request: Request,
                token: Annotated[str | None, Header(alias=SESSION_TOKEN_HEADER)] = None) -> SessionState:
    return get_manager(request).session(sid, token, get_tenant(request).name)


ManagerDep = Annotated[Manager, Depends(get_manager)]
SessionDep = Annotated[SessionState, Depends(get_session)]


@router.post("/sessions", response_model=SessionResponse)
async def create_session(manager: ManagerDep, request: Request,
                         body: CreateSessionRequest | None = None) -> SessionResponse:
    tenant = get_tenant(request)
    session = manager.create_session(body.ttl_s if body else None, owner=tenant.name, owner_limit=tenant.max_sessions)
    return SessionResponse(session_id=session.session_id, token=session.token, ttl_s=session.ttl_s)


@router.delete("/sessions/{sid}", response_model=DeletedResponse)
async def delete_session(manager: ManagerDep, session: SessionDep) -> DeletedResponse:
    await manager.delete_session(session)
    return DeletedResponse(deleted=True)


@router.post("/sessions/{sid}/variables", response_model=VariableResponse)
async def create_variable(manager: ManagerDep, session: SessionDep, body: CreateVariableRequest) -> VariableResponse:
    var = manager.create_variable(session, body.name, body.value)
    return VariableResponse(var_id=var.var_id, name=var.name, status=var.status.value, value=var.value)


@router.put("/sessions/{sid}/variables/{vid}", response_model=VariableResponse)
async def set_variable(vid: str, manager: ManagerDep, session: SessionDep,
                       body: SetVariableRequest) -> VariableResponse:
    var = manager.set_variable(session, vid, body.value)
    return VariableResponse(var_id=var.var_id, name=var.name, status=var.status.value, value=var.value)


@router.get("/sessions/{sid}/variables/{vid}", response_model=VariableResponse,
            responses={424: {"description": "the producer (or an upstream step) failed; error.cause names why"}})
async def get_variable(
    vid: str, manager: ManagerDep, session: SessionDep,
    criteria: Annotated[str | None, Query(description="latency | throughput (recorded: GetPerfObj)")] = None,
    timeout: Annotated[float, Query(ge=0, description="long-poll seconds (capped at 60)")] = 0.0,
    ttft_ms: Annotated[float | None, Query(gt=0, description="latency target: time to first token")] = None,
    tpot_ms: Annotated[float | None, Query(gt=0, description="latency target: time per output token")] = None,
    deadline_s: Annotated[float | None, Query(gt=0, description="latency target: value wanted within this")] = None,
) -> VariableResponse:
    targets = None
    if ttft_ms is not None or tpot_ms is not None or deadline_s is not None:
        targets = LatencyTargets(ttft_s=ttft_ms / 1000 if ttft_ms is not None else None,
                                 tpot_s=tpot_ms / 1000 if tpot_ms is not None else None,
                                 deadline_s=deadline_s).pinned(manager.clock())
    view = await manager.get_variable(session, vid, criteria=criteria, timeout_s=timeout, targets=targets)
    return VariableResponse(var_id=view.var_id, name=view.name, status=view.status.value, value=view.value)


@router.post("/sessions/{sid}/submit", response_model=SubmitResponse)
async def submit(manager: ManagerDep, session: SessionDep, body: SubmitRequest) -> SubmitResponse:
    spec = SubmitSpec(prompt=body.prompt, models=tuple(body.models), name=body.name, placeholders=[
        PlaceholderSpec(p.name, p.is_output, p.var_id, p.sampling, tuple(p.transforms)) for p in body.placeholders])
    req = manager.submit(session, spec)
    outputs = {b.name: b.var_id for b in req.bindings.values() if b.is_output}
    return SubmitResponse(request_id=req.request_id, outputs=outputs)


@router.get("/stats")
async def stats(manager: ManagerDep) -> dict:
    """Manager counters: open sessions and prefix sharing (contexts created/freed, forks, tokens saved)."""
    return manager.stats()


@router.get("/sessions/{sid}/dag", response_model=DagResponse)
async def dag(manager: ManagerDep, session: SessionDep) -> DagResponse:
    dump = manager.dag(session)
    return DagResponse(requests=dump.requests, variables=dump.variables, text=dump.text)
