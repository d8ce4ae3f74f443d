"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (stream or not).

Routes only translate: the request becomes the completion service's plain spec (:mod:`parrot.api.openai_shapes`),
the service plans and runs it (:mod:`parrot.manager.completions`), the typed result is shaped back into OpenAI
JSON or an SSE stream (:class:`parrot.http_edge.EventStreamResponse`, which stops the work at once when the
client disconnects). Planning (validation, tokenization, window check) happens before the response starts, so
bad input is a proper 4xx even for ``stream: true``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from parrot.api import openai_shapes as shapes
from parrot.api.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from parrot.http_edge import EventStreamResponse
from parrot.manager.completions import CompletionPlan, CompletionService
from parrot.manager.manager import Manager

router = APIRouter(prefix="/v1", tags=["openai"])


def _service(request: Request) -> CompletionService:
    return request.app.state.completions


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    manager: Manager = request.app.state.manager
    created = int(request.app.state.started_at)
    registry = manager.registry
    return ModelList(data=[ModelCard(id=info.name, created=created, max_model_len=info.max_model_len,
                                     numerics=registry.numerics_of(info.name)) for info in registry.model_infos()])


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    service = _service(request)
    return await _respond(service, await service.plan_completion(shapes.completion_spec(body)), body)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    service = _service(request)
    return await _respond(service, await service.plan_chat(shapes.chat_spec(body)), body)


async def _respond(service: CompletionService, plan: CompletionPlan,
                   body: CompletionRequest | ChatCompletionRequest) -> Response:
    if body.stream:
        return EventStreamResponse(shapes.stream_chunks(plan, service.stream(plan),
                                                        with_usage=shapes.include_usage(body)))
    return JSONResponse(shapes.completion_body(plan, await service.complete(plan)))
