"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (stream or not) and
the Responses API (``/v1/responses``: create, stream, get, delete).

Routes only translate: the request becomes the completion service's plain spec (:mod:`parrot.api.openai_shapes`),
the service plans and runs it (:mod:`parrot.manager.completions`), the typed result is shaped back into OpenAI
JSON or an SSE stream (:class:`parrot.http_edge.EventStreamResponse`). Abandoned work is cancelled: a client that
disconnects, streaming or not, stops its work at once (the stream's close, or
:func:`parrot.http_edge.cancel_on_disconnect` around a whole answer), which leaves the engine batch and frees
its contexts; ``parrot_cancelled_requests_total{reason="client_disconnected"}`` counts it. Planning
(validation, tokenization, window check) happens before the response starts, so bad input is a proper 4xx even
for ``stream: true``. Stored responses belong to the caller's API key (a hash
of the bearer the key check let through; ``anonymous`` when the server has no key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from parrot.api import openai_shapes as shapes
from parrot.api import responses_shapes
from parrot.api.limits import InFlight, RequestLimits, request_limits
from parrot.api.tenants import ANONYMOUS
from parrot.api.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, ResponsesRequest
from parrot.common.errors import NotReady
from parrot.http_edge import EventStreamResponse, cancel_on_disconnect
from parrot.manager.completion_types import CompletionPlan
from parrot.manager.completions import CompletionService
from parrot.manager.manager import Manager
from parrot.manager.metrics import CancelReason
from parrot.manager.responses_store import ResponsesService

router = APIRouter(prefix="/v1", tags=["openai"])


def _service(request: Request) -> CompletionService:
    return request.app.state.completions


MODELS_WAIT_S = 2.0  # how long /v1/models waits for a first engine before answering 503 (a server starting)


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The models of the registered engines. While none has registered (the server is starting) it waits up to
    :data:`MODELS_WAIT_S`, then answers 503 ``not_ready`` with ``Retry-After``: never an empty list that looks
    final to a client that lists models before its first request."""
    manager: Manager = request.app.state.manager
    created = int(request.app.state.started_at)
    registry = manager.registry
    infos = await registry.wait_for_models(MODELS_WAIT_S)
    if not infos:
        raise NotReady("no engine has registered yet (the server is starting); retry shortly")
    return ModelList(data=[ModelCard(id=info.name, created=created, max_model_len=info.max_model_len,
                                     numerics=registry.numerics_of(info.name)) for info in infos])


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    service, limits = _service(request), request_limits(request)
    _in_flight(request).admit(limits)
    plan = await service.plan_completion(limits.completion_spec(shapes.completion_spec(body), "max_tokens",
                                                                asked="max_tokens" in body.model_fields_set))
    return await _respond(request, service, plan, body, limits)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    service, limits = _service(request), request_limits(request)
    _in_flight(request).admit(limits)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = body.max_completion_tokens is not None or body.max_tokens is not None
    plan = await service.plan_chat(limits.completion_spec(shapes.chat_spec(body), param, asked=asked))
    return await _respond(request, service, plan, body, limits)


def _in_flight(request: Request) -> InFlight:
    return request.app.state.in_flight


def _on_disconnect(request: Request, api: str) -> Callable[[], None]:
    """Counts a client that went away from ``api`` before its answer (its work is cancelled)."""
    metrics = request.app.state.manager.metrics
    return lambda: metrics.cancelled(api, CancelReason.CLIENT_DISCONNECTED)


async def _respond(request: Request, service: CompletionService, plan: CompletionPlan,
                   body: CompletionRequest | ChatCompletionRequest, limits: RequestLimits) -> Response:
    """Run a planned call, counted in flight for its tenant until its last byte (limits.InFlight)."""
    limits.check_plan(plan)
    in_flight = _in_flight(request)
    gone = _on_disconnect(request, "chat" if plan.chat else "completions")
    if body.stream:
        return EventStreamResponse(in_flight.held(limits.tenant, shapes.stream_chunks(
            plan, service.stream(plan), with_usage=shapes.include_usage(body))), on_disconnect=gone)
    result = await cancel_on_disconnect(request, in_flight.counted(limits.tenant, service.complete(plan)),
                                        on_disconnect=gone)
    return JSONResponse(shapes.completion_body(plan, result))


# ---- Responses API --------------------------------------------------------------------------------------------
def _responses(request: Request) -> ResponsesService:
    return request.app.state.responses


def _owner(request: Request) -> str:
    """Who a stored response belongs to: the caller's tenant (parrot.api.tenants; set by the middleware)."""
    return getattr(request.state, "tenant", ANONYMOUS).name


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    service, limits, in_flight = _responses(request), request_limits(request), _in_flight(request)
    in_flight.admit(limits)
    spec = responses_shapes.response_spec(body)
    max_output = limits.output_tokens(spec.max_output_tokens, "max_output_tokens")
    if max_output != spec.max_output_tokens:
        spec = dataclasses.replace(spec, max_output_tokens=max_output)
    plan = await service.plan(spec, _owner(request))
    limits.check_plan(plan.completion)
    gone = _on_disconnect(request, "responses")
    if body.stream:
        return EventStreamResponse(in_flight.held(limits.tenant, responses_shapes.response_events(
            plan, service.stream(plan))), named=True, on_disconnect=gone)
    result = await cancel_on_disconnect(request, in_flight.counted(limits.tenant, service.complete(plan)),
                                        on_disconnect=gone)
    return JSONResponse(responses_shapes.response_body(plan, result))


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict:
    result = _responses(request).get(_owner(request), response_id)
    return responses_shapes.response_body(result.plan, result)


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    _responses(request).delete(_owner(request), response_id)
    return responses_shapes.deleted_body(response_id)
