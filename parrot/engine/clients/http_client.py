"""EngineClient over HTTP: the manager's view of an engine running in another process (`parrot engine`).

The network path is where engines fail, so each call states what may be repeated (:class:`CallPolicy`):

    failure of one attempt                     | idempotent call          | generate (plain or streamed)
    -------------------------------------------+--------------------------+------------------------------
    connection refused / connect timeout       | retried with backoff     | retried (never reached the engine)
    connection reset / closed before an answer | retried with backoff     | EngineUnavailable -> failover
    read timeout (the engine accepted, silent) | EngineTimeout            | EngineTimeout -> failover
    an HTTP error answer (4xx / 5xx body)      | its typed error          | its typed error

Idempotent calls: status, model_info, tokenize, detokenize, token_cap, free_context (a repeated free of a context
the first attempt freed answers UnknownContext, which every caller takes as "gone"), pause_context (a repeated pause
answers the first one's record), and fill: each fill carries an
``op_id`` (fresh per call, the same on its retries) and the engine answers a repeated op id with the first
attempt's result instead of appending the tokens again (:mod:`parrot.engine.server.op_memo`), so a fill whose answer was
lost on a reset connection after the engine applied it is never applied twice.

Backoff is exponential with full jitter (attempt k waits uniform(0, min(max_backoff_s, backoff_s * 2**k)));
the last failure becomes ``EngineUnavailable`` (the registry then declares the engine dead and its requests
fail over). Timeouts: ``connect_s`` for every call, ``control_s`` to read the answer of the short calls, and
``op_s`` for fill / generate / tokenize (None: unbounded; a long generation answers only at its end, and an engine
that hangs is found by its missed heartbeats, which cancels the calls waiting on it).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_random_exponential

from parrot.common.errors import (EngineError, EngineTimeout, EngineUnavailable, NotFoundError, UnknownContext,
                                  error_from_body)
from parrot.common.sampling import SamplingParams
from parrot.protocol import wire
from parrot.protocol.interface import (EngineClient, EngineStatus, FillResult, GenerateChunk, GenerateResult, ModelInfo,
                                     OpHint, PauseResult, ToolHint)

log = logging.getLogger(__name__)

# the request was never sent: repeating it cannot do its work twice
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# the answer was lost after the request may have been sent (reset, closed, a broken write)
_LOST = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


@dataclass(frozen=True)
class CallPolicy:
    """Timeouts and retries of one engine's calls (ServerSettings.engine_call_policy() builds the manager's)."""

    connect_s: float = 5.0
    control_s: float = 10.0
    op_s: float | None = None
    attempts: int = 4  # tries of a retryable call in all (1 = no retry)
    backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("connect_s", "control_s", "backoff_s", "max_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.op_s is not None and not self.op_s > 0:
            raise ValueError(f"op_s must be > 0 or None, got {self.op_s!r}")
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts!r}")


class HTTPEngineClient(EngineClient):
    """``num_retries`` counts the attempts repeated after a network failure (all calls)."""

    def __init__(self, url: str, name: str | None = None, *, policy: CallPolicy | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.policy = policy or CallPolicy()
        p = self.policy
        self._control = httpx.Timeout(p.control_s, connect=p.connect_s)
        self._op = httpx.Timeout(p.op_s, connect=p.connect_s)
        self._http = httpx.AsyncClient(base_url=self.url, timeout=self._control)
        self._info: ModelInfo | None = None
        self.num_retries = 0

    # ---- plumbing ---------------------------------------------------------------------------------------------
    def _retrying(self, what: str, idempotent: bool) -> AsyncRetrying:
        retryable = _NOT_SENT + _LOST if idempotent else _NOT_SENT

        def before_sleep(state: RetryCallState) -> None:
            self.num_retries += 1
            log.info("engine %s: %s failed (%r); retry %d of %d in %.2f s", self.name, what,
                     state.outcome.exception() if state.outcome else None, state.attempt_number,
                     self.policy.attempts - 1, state.upcoming_sleep)

        return AsyncRetrying(stop=stop_after_attempt(self.policy.attempts),
                             wait=wait_random_exponential(multiplier=self.policy.backoff_s,
                                                          max=self.policy.max_backoff_s),
                             retry=retry_if_exception(lambda e: isinstance(e, retryable)), reraise=True,
                             before_sleep=before_sleep)

    def _transport_error(self, e: httpx.TransportError, what: str) -> EngineError:
        if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
            return EngineTimeout(f"engine {self.name} at {self.url} did not answer {what} in time: {e!r}")
        return EngineUnavailable(f"engine {self.name} at {self.url} unreachable ({what}): {e!r}")

    async def _call(self, method: str, path: str, body: dict | None = None, *, idempotent: bool = True,
                    timeout: httpx.Timeout | None = None) -> dict:
        try:
            async for attempt in self._retrying(path, idempotent):
                with attempt:
                    r = await self._http.request(method, path, json=body, timeout=timeout or self._control)
        except httpx.TransportError as e:
            raise self._transport_error(e, path) from None
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

    # ---- EngineClient -----------------------------------------------------------------------------------------
    async def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None, *,
                   prompt_logprobs: int | None = None, hint: OpHint | None = None) -> FillResult:
        body = {"token_ids": list(token_ids), "context_id": context_id, "parent_context_id": parent_context_id,
                "op_id": uuid.uuid4().hex}  # the same on every retry of this fill: the engine applies it once
        if prompt_logprobs is not None:  # absent when off: an engine server without the field still serves fills
            body["prompt_logprobs"] = prompt_logprobs
        if hint is not None:
            body["hint"] = hint.to_wire()
        return wire.fill_result(await self._call("POST", "/engine/v1/fill", body, timeout=self._op))

    async def generate(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None, *,
        hint: OpHint | None = None,
    ) -> GenerateResult:
        body = {"sampling": sampling.to_dict(), "context_id": context_id, "parent_context_id": parent_context_id}
        if hint is not None:  # absent without one: an engine server without the field still serves generates
            body["hint"] = hint.to_wire()
        return wire.generate_result(await self._call("POST", "/engine/v1/generate", body, idempotent=False,
                                                     timeout=self._op))

    async def generate_stream(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None, *,
        hint: OpHint | None = None,
    ) -> AsyncIterator[GenerateChunk]:
        body = {"sampling": sampling.to_dict(), "context_id": context_id, "parent_context_id": parent_context_id,
                "stream": True}
        if hint is not None:
            body["hint"] = hint.to_wire()
        path = "/engine/v1/generate"
        try:
            async for attempt in self._retrying(path, idempotent=False):  # connecting only: nothing was sent yet
                with attempt:
                    r = await self._http.send(self._http.build_request("POST", path, json=body, timeout=self._op),
                                              stream=True)
            try:
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
            finally:
                await r.aclose()
        except httpx.TransportError as e:
            raise self._transport_error(e, path) from None
        raise EngineError(f"engine {self.name} closed the stream without [DONE]")

    async def free_context(self, context_id: str) -> None:
        await self._call("POST", "/engine/v1/free_context", {"context_id": context_id})

    async def pause_context(self, context_id: str, tool: ToolHint) -> PauseResult | None:
        """Retried like free (a repeat answers the first pause's record, or UnknownContext once it was resumed or
        expired). An engine server without the endpoint (a 404 that is not UnknownContext) gets a free instead."""
        try:
            d = await self._call("POST", "/engine/v1/pause_context", {"context_id": context_id,
                                                                      "tool": tool.to_wire()})
        except NotFoundError as e:
            if isinstance(e, UnknownContext):
                raise
            await self.free_context(context_id)
            return None
        return PauseResult.from_wire(d) if d.get("handling") else None

    async def status(self) -> EngineStatus:
        return wire.engine_status(await self._call("GET", "/engine/v1/status"))

    async def set_token_cap(self, max_running_tokens: int | None) -> bool:
        try:
            await self._call("POST", "/engine/v1/token_cap", {"max_running_tokens": max_running_tokens})
        except NotFoundError:
            return False  # an engine server without the endpoint
        return True

    async def tokenize(self, text: str) -> list[int]:
        return (await self._call("POST", "/engine/v1/tokenize", {"text": text}, timeout=self._op))["token_ids"]

    async def detokenize(self, token_ids: list[int]) -> str:
        return (await self._call("POST", "/engine/v1/detokenize", {"token_ids": list(token_ids)},
                                 timeout=self._op))["text"]

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = wire.model_info(await self._call("GET", "/engine/v1/model_info"))
        return self._info

    async def close(self) -> None:
        await self._http.aclose()
