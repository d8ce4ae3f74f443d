"""EngineClient over HTTP: the manager's view of an engine running in another process (`parrot engine`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from parrot.common.errors import EngineError, EngineUnavailable, NotFoundError, error_from_body
from parrot.common.sampling import SamplingParams
from parrot.engine import wire
from parrot.engine.interface import EngineClient, EngineStatus, FillResult, GenerateChunk, GenerateResult, ModelInfo


class HTTPEngineClient(EngineClient):
    def __init__(self, url: str, name: str | None = None, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.name = name or self.url
        self._http = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._info: ModelInfo | None = None

    async def _post(self, path: str, body: dict) -> dict:
        try:
            r = await self._http.post(path, json=body)
        except httpx.TransportError as e:
            raise EngineUnavailable(f"engine {self.name} at {self.url} unreachable: {e!r}") from None
        return self._check(r)

    async def _get(self, path: str) -> dict:
        try:
            r = await self._http.get(path)
        except httpx.TransportError as e:
            raise EngineUnavailable(f"engine {self.name} at {self.url} unreachable: {e!r}") from None
        return self._check(r)

    @staticmethod
    def _check(r: httpx.Response) -> dict:
        try:
            body = r.json()
        except ValueError:
            body = {"error": {"message": r.text[:500]}}
        if r.status_code >= 400:
            raise error_from_body(r.status_code, body)
        return body

    async def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None, *,
                   prompt_logprobs: int | None = None) -> FillResult:
        body = {"token_ids": list(token_ids), "context_id": context_id, "parent_context_id": parent_context_id}
        if prompt_logprobs is not None:  # absent when off: an engine server without the field still serves fills
            body["prompt_logprobs"] = prompt_logprobs
        return wire.fill_result(await self._post("/engine/v1/fill", body))

    async def generate(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None
    ) -> GenerateResult:
        body = {"sampling": sampling.to_dict(), "context_id": context_id, "parent_context_id": parent_context_id}
        return wire.generate_result(await self._post("/engine/v1/generate", body))

    async def generate_stream(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None
    ) -> AsyncIterator[GenerateChunk]:
        body = {"sampling": sampling.to_dict(), "context_id": context_id, "parent_context_id": parent_context_id,
                "stream": True}
        try:
            async with self._http.stream("POST", "/engine/v1/generate", json=body) as r:
                if r.status_code >= 400:
                    await r.aread()
                    self._check(r)
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        return
                    d = json.loads(data)
                    if "error" in d:
                        raise error_from_body(500, d)
                    yield wire.generate_chunk(d)
        except httpx.TransportError as e:
            raise EngineUnavailable(f"engine {self.name} at {self.url} unreachable: {e!r}") from None
        raise EngineError(f"engine {self.name} closed the stream without [DONE]")

    async def free_context(self, context_id: str) -> None:
        await self._post("/engine/v1/free_context", {"context_id": context_id})

    async def status(self) -> EngineStatus:
        return wire.engine_status(await self._get("/engine/v1/status"))

    async def set_token_cap(self, max_running_tokens: int | None) -> bool:
        try:
            await self._post("/engine/v1/token_cap", {"max_running_tokens": max_running_tokens})
        except NotFoundError:
            return False  # an engine server without the endpoint
        return True

    async def tokenize(self, text: str) -> list[int]:
        return (await self._post("/engine/v1/tokenize", {"text": text}))["token_ids"]

    async def detokenize(self, token_ids: list[int]) -> str:
        return (await self._post("/engine/v1/detokenize", {"token_ids": list(token_ids)}))["text"]

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = wire.model_info(await self._get("/engine/v1/model_info"))
        return self._info

    async def close(self) -> None:
        await self._http.aclose()
