"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (stream or not).

Planning (validation, tokenization, window check) happens before the response starts, so bad input is a
proper 4xx even for ``stream: true``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from parrot.api.completions import CompletionService
from parrot.api.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from parrot.api.streaming import EventStreamResponse
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
    plan = await service.plan_completion(body)
    if body.stream:
        return EventStreamResponse(service.stream(plan))
    return JSONResponse(await service.complete(plan))


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    service = _service(request)
    plan = await service.plan_chat(body)
    if body.stream:
        return EventStreamResponse(service.stream(plan))
    return JSONResponse(await service.complete(plan))
