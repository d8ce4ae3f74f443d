"""Parrot API routes (``/api/v1``): sessions, Semantic Variables, submit, get, DAG (docs/api.md).

Routes validate and delegate to the :class:`~parrot.manager.Manager` in ``app.state``; errors are typed and
mapped once by :mod:`parrot.http_edge`.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Query, Request

from parrot.api.limits import RequestLimits, request_limits
from parrot.api.schemas import (
    CreateSessionRequest,
    CreateVariableRequest,
    DagResponse,
    DeletedResponse,
    FlowStatusResponse,
    PlaceholderModel,
    SessionResponse,
    SetVariableRequest,
    SubmitFlowResponse,
    SubmitRequest,
    SubmitResponse,
    ToolCallErrorRequest,
    ToolCallsResponse,
    VariableResponse,
)
from parrot.api.tenants import ANONYMOUS, Tenant
from parrot.common.errors import InvalidRequestError, StepFailed, TemplateError
from parrot.common.perf import LatencyTargets, PinnedTargets
from parrot.common.sampling import SamplingParams
from parrot.common.template import output_names, parse_template
from parrot.http_edge import EventStreamResponse, cancel_on_disconnect
from parrot.manager.graph import ToolDecl
from parrot.manager.manager import Manager
from parrot.manager.session import SessionState
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from parrot.manager.value_stream import follow

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
    session.max_prompt_tokens = request_limits(request).max_prompt_tokens
    return SessionResponse(session_id=session.session_id, token=session.token, ttl_s=session.ttl_s)


@router.delete("/sessions/{sid}", response_model=DeletedResponse)
async def delete_session(manager: ManagerDep, session: SessionDep) -> DeletedResponse:
    await manager.delete_session(session)
    return DeletedResponse(deleted=True)


@router.post("/sessions/{sid}/variables", response_model=VariableResponse)
async def create_variable(manager: ManagerDep, session: SessionDep, body: CreateVariableRequest) -> VariableResponse:
    tool = None if body.tool is None else ToolDecl(body.tool.name, tuple(body.tool.inputs),
                                                   body.tool.expected_duration_s)
    var = manager.create_variable(session, body.name, body.value, tool=tool)
    return VariableResponse(var_id=var.var_id, name=var.name, status=var.status.value, value=var.value)


@router.put("/sessions/{sid}/variables/{vid}", response_model=VariableResponse)
async def set_variable(vid: str, manager: ManagerDep, session: SessionDep,
                       body: SetVariableRequest) -> VariableResponse:
    var = manager.set_variable(session, vid, body.value)
    return VariableResponse(var_id=var.var_id, name=var.name, status=var.status.value, value=var.value)


@router.get("/sessions/{sid}/variables/{vid}", response_model=VariableResponse,
            responses={424: {"description": "the producer (or an upstream step) failed; error.cause names why"}})
async def get_variable(
    vid: str, manager: ManagerDep, session: SessionDep, request: Request,
    criteria: Annotated[str | None, Query(description="latency | throughput (recorded: GetPerfObj)")] = None,
    timeout: Annotated[float, Query(ge=0, description="long-poll seconds (capped at 60)")] = 0.0,
    ttft_ms: Annotated[float | None, Query(gt=0, description="latency target: time to first token")] = None,
    tpot_ms: Annotated[float | None, Query(gt=0, description="latency target: time per output token")] = None,
    deadline_s: Annotated[float | None, Query(gt=0, description="latency target: value wanted within this")] = None,
) -> VariableResponse:
    targets = _targets(manager, ttft_ms, tpot_ms, deadline_s)
    # a client that leaves mid-poll ends only its wait (the producer runs on for the session)
    view = await cancel_on_disconnect(request, manager.get_variable(session, vid, criteria=criteria,
                                                                     timeout_s=timeout, targets=targets))
    return VariableResponse(var_id=view.var_id, name=view.name, status=view.status.value, value=view.value)


def _targets(manager: Manager, ttft_ms: float | None, tpot_ms: float | None,
             deadline_s: float | None) -> PinnedTargets | None:
    """The latency targets of a GET's query, pinned to the GET's time (None: no target asked)."""
    if ttft_ms is None and tpot_ms is None and deadline_s is None:
        return None
    return LatencyTargets(ttft_s=ttft_ms / 1000 if ttft_ms is not None else None,
                          tpot_s=tpot_ms / 1000 if tpot_ms is not None else None,
                          deadline_s=deadline_s).pinned(manager.clock())


@router.get("/sessions/{sid}/variables/{vid}/stream", response_model=None,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "SSE: piece events, then a done event with the value (or an error "
                                            "event with the typed body), then [DONE]"}})
async def stream_variable(
    vid: str, manager: ManagerDep, session: SessionDep,
    criteria: Annotated[str | None, Query(description="latency | throughput (recorded: GetPerfObj)")] = None,
    ttft_ms: Annotated[float | None, Query(gt=0, description="latency target: time to first token")] = None,
    tpot_ms: Annotated[float | None, Query(gt=0, description="latency target: time per output token")] = None,
    deadline_s: Annotated[float | None, Query(gt=0, description="latency target: value wanted within this")] = None,
) -> EventStreamResponse:
    """The variable's value as it is generated (docs/api.md). Counts as a GET: the criterion and targets are
    recorded (GetPerfObj) before the stream opens; an unknown variable is a 404 before any event."""
    try:
        await manager.get_variable(session, vid, criteria=criteria, timeout_s=0.0,
                                   targets=_targets(manager, ttft_ms, tpot_ms, deadline_s))
    except StepFailed:
        pass  # already failed: the stream's error event says so (after the pieces it had streamed)
    return EventStreamResponse(follow(session.graph.variable(vid), on_event=lambda: manager.sessions.touch(session)))


@router.post("/sessions/{sid}/submit", response_model=SubmitResponse)
async def submit(manager: ManagerDep, session: SessionDep, body: SubmitRequest, request: Request) -> SubmitResponse:
    limits = request_limits(request)
    request.app.state.in_flight.admit(limits)
    spec = SubmitSpec(prompt=body.prompt, models=tuple(body.models), name=body.name, placeholders=[
        PlaceholderSpec(p.name, p.is_output, p.var_id, _limited_sampling(p, limits), tuple(p.transforms))
        for p in body.placeholders])
    req = manager.submit(session, spec)
    outputs = {b.name: b.var_id for b in req.bindings.values() if b.is_output}
    return SubmitResponse(request_id=req.request_id, outputs=outputs)


def _limited_sampling(p: PlaceholderModel, limits: RequestLimits) -> dict | None:
    """An output's sampling within the tenant's max_output_tokens (its default max_tokens when it asks none)."""
    if not p.is_output or limits.max_output_tokens is None:
        return p.sampling
    sampling = dict(p.sampling or {})
    asked = sampling.get("max_tokens")
    if asked is None:
        sampling["max_tokens"] = min(SamplingParams().max_tokens, limits.max_output_tokens)
    elif isinstance(asked, int) and not isinstance(asked, bool):  # other types: SamplingParams names the error
        limits.output_tokens(asked, f"placeholders[{p.name}].sampling.max_tokens")
    return sampling


@router.post("/sessions/{sid}/flows", response_model=SubmitFlowResponse,
             responses={400: {"description": "the declaration is invalid; error.param names the step"}})
async def submit_flow(manager: ManagerDep, session: SessionDep, request: Request,
                      body: Annotated[dict[str, Any], Body(description="a flow declaration (docs/flows.md)")]
                      ) -> SubmitFlowResponse:
    """Branches and loops the manager runs itself: one submission for a whole agent loop (docs/flows.md)."""
    limits = request_limits(request)
    request.app.state.in_flight.admit(limits)
    flow = manager.submit_flow(session, _limited_flow(body, limits))
    return SubmitFlowResponse(flow_id=flow.flow_id, outputs=flow.outputs)


@router.get("/sessions/{sid}/flows/{fid}", response_model=FlowStatusResponse)
async def flow_status(fid: str, manager: ManagerDep, session: SessionDep) -> FlowStatusResponse:
    return FlowStatusResponse(**manager.flow_status(session, fid))


@router.get("/sessions/{sid}/tool_calls", response_model=ToolCallsResponse)
async def tool_calls(
    manager: ManagerDep, session: SessionDep, request: Request,
    timeout: Annotated[float, Query(ge=0, description="long-poll seconds (capped at 60)")] = 0.0,
    tools: Annotated[str | None, Query(description="comma-separated tool names this worker runs (default: all)")]
    = None,
) -> ToolCallsResponse:
    """Client tool calls of this session's flows whose arguments are ready; each is handed out once. Answer with
    ``PUT .../variables/{call_id}`` or ``POST .../tool_calls/{call_id}/error``."""
    names = None if tools is None else {t.strip() for t in tools.split(",") if t.strip()}
    calls = await cancel_on_disconnect(request, manager.flows.take_calls(session, names, timeout))
    manager.sessions.touch(session)
    return ToolCallsResponse(calls=calls)


@router.post("/sessions/{sid}/tool_calls/{call_id}/error", response_model=VariableResponse)
async def tool_call_error(call_id: str, manager: ManagerDep, session: SessionDep,
                          body: ToolCallErrorRequest) -> VariableResponse:
    """The worker could not run the call: its variable fails (cause ``tool_failed``), or holds ``error: <message>``
    for a step declared ``on_error: value``."""
    manager.flows.call_error(session, call_id, body.message)
    var = session.graph.variable(call_id)
    return VariableResponse(var_id=var.var_id, name=var.name, status=var.status.value, value=var.value)


def _limited_flow(body: dict[str, Any], limits: RequestLimits) -> dict[str, Any]:
    """The declaration with every generate's outputs held to the tenant's max_output_tokens (as a submit's)."""
    if limits.max_output_tokens is None:
        return body
    body = copy.deepcopy(body)

    def walk(steps: Any) -> None:
        if not isinstance(steps, list):
            return
        for step in steps:
            if not isinstance(step, dict) or len(step) != 1:
                continue  # the parser names the error
            kind, spec = next(iter(step.items()))
            if not isinstance(spec, dict):
                continue
            if kind == "generate" and isinstance(spec.get("prompt"), str):
                try:
                    outs = output_names(parse_template(spec["prompt"]))
                except TemplateError:
                    continue
                sampling = spec.setdefault("sampling", {})
                if not isinstance(sampling, dict):
                    raise InvalidRequestError("generate.sampling must be an object", param="sampling")
                for out in outs:
                    p = PlaceholderModel(name=out, is_output=True, sampling=sampling.get(out))
                    sampling[out] = _limited_sampling(p, limits)
            for key in ("steps", "default"):
                walk(spec.get(key))
            for case in spec.get("cases") or []:
                if isinstance(case, dict):
                    walk(case.get("steps"))

    walk(body.get("steps"))
    return body


@router.get("/stats")
async def stats(manager: ManagerDep) -> dict:
    """Manager counters: open sessions, prefix sharing (contexts created/freed, forks, tokens saved), scheduler,
    failover, and ``tools``: output-length prediction accuracy, tool durations, context pauses by handling."""
    return manager.stats()


@router.get("/sessions/{sid}/dag", response_model=DagResponse)
async def dag(manager: ManagerDep, session: SessionDep) -> DagResponse:
    dump = manager.dag(session)
    return DagResponse(requests=dump.requests, variables=dump.variables, text=dump.text)
