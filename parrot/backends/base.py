"""The external-engine adapter: an :class:`EngineClient` over an OpenAI-compatible server of some kind.

The manager sees an engine like any other. Underneath, Fill / Generate / FreeContext run over the adapter's own
context tree (:mod:`parrot.backends.contexts`): a fill only records tokens, a generate sends the context's whole
sequence to the server and appends what comes back. What differs between servers (endpoints, request fields,
response shapes, load reports, error bodies) is a :class:`Dialect`, one module per kind::

    manager --EngineClient--> BackendEngine --+-- ContextTree (token ids, or UTF-8 bytes for text-only servers)
                                              +-- Dialect (openai / vllm / sglang / llamacpp) --HTTP--> server

Errors: unreachable server, connection dropped, timeout -> EngineUnavailable (the registry marks the engine dead and
failover reschedules); a prompt beyond the window -> ContextLengthExceeded (checked here, before sending); the
server refusing parameters (4xx) -> BadSamplingParams; anything else from the server -> EngineError. ``status()``
doubles as the heartbeat: it fails with EngineUnavailable when the server's health check does.
"""

from __future__ import annotations

import abc
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar

import httpx

from parrot.backends.contexts import ContextTree
from parrot.backends.settings import BackendSettings
from parrot.common.errors import (
    ERROR_CLASSES,
    BadSamplingParams,
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    InvalidRequestError,
    ParrotError,
)
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.common.step_cost import StepStats
from parrot.protocol.interface import (
    EngineCapabilities,
    EngineClient,
    EngineStatus,
    FillResult,
    GenerateChunk,
    GenerateResult,
    ModelInfo,
    OpHint,
)

logger = logging.getLogger(__name__)

Prompt = list[int] | str
KEEPALIVE_S = 2.0  # idle pooled connections are dropped after this (see Http)
TOKEN_CACHE_ENTRIES = 4096  # texts whose token ids the adapter remembers (LRU)
TOKEN_CACHE_MAX_CHARS = 8192  # longer texts (documents, generated values) are not remembered


@dataclass(frozen=True)
class Completion:
    """One parsed response, or one stream event (``text`` / ``token_ids`` are then the increment)."""

    text: str
    token_ids: tuple[int, ...] | None  # None: the server did not report them
    finish_reason: FinishReason | None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served
    ttft_s: float | None = None  # the server's own prompt time, when it reports one


@dataclass(frozen=True)
class Load:
    """What a server reports about its load (None: not reported)."""

    num_running: int | None = None
    num_waiting: int | None = None
    kv_tokens: int | None = None
    kv_used_tokens: int | None = None


class Http:
    """The server's HTTP client with our error mapping. ``errors`` turns an error response into a typed error."""

    def __init__(self, url: str, name: str, settings: BackendSettings) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.settings = settings
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        # idle connections expire before the servers drop them (llama.cpp's cpp-httplib and uvicorn close idle
        # keep-alive connections after 5 s): a request on a connection the server is closing is lost
        self.client = httpx.AsyncClient(
            base_url=self.url, headers=headers, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
            timeout=httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s))

    def unreachable(self, e: Exception) -> EngineUnavailable:
        return EngineUnavailable(f"engine {self.name} at {self.url} unreachable: {type(e).__name__}: {e}")

    async def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send, once more on a fresh connection when the first attempt got no answer at all (refused, or a
        pooled connection closed under it). Every call is safe to repeat: the servers keep no state of ours (a
        generation is appended to our context only once it is back). A second failure: EngineUnavailable."""
        for attempt in range(1 + self.settings.connection_retries):
            try:
                return await self.client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.RemoteProtocolError) as e:
                if attempt == self.settings.connection_retries:
                    raise self.unreachable(e) from None
                logger.info("engine %s: %s on %s, retrying on a new connection", self.name, type(e).__name__,
                            request.url.path)
            except httpx.TransportError as e:  # timeouts, reads cut mid-answer
                raise self.unreachable(e) from None
        raise AssertionError("unreachable: the loop returns or raises")

    async def request(self, method: str, path: str, body: dict | None = None, *, probe: bool = False,
                      errors=None) -> httpx.Response:
        timeout = self.settings.probe_timeout_s if probe else httpx.USE_CLIENT_DEFAULT
        r = await self._send(self.client.build_request(method, path, json=body, timeout=timeout))
        if r.status_code >= 400:
            raise (errors or default_error)(self.name, r.status_code, _json_or_text(r))
        return r

    async def get(self, path: str, **kw) -> dict | list:
        return _json(await self.request("GET", path, **kw), self.name)

    async def post(self, path: str, body: dict, **kw) -> dict | list:
        return _json(await self.request("POST", path, body, **kw), self.name)

    async def events(self, path: str, body: dict, *, errors=None) -> AsyncIterator[dict]:
        """Server-sent events of a streaming POST, each ``data:`` line as JSON, until ``[DONE]`` or the end."""
        r = await self._send(self.client.build_request("POST", path, json=body), stream=True)
        try:
            if r.status_code >= 400:
                await r.aread()
                raise (errors or default_error)(self.name, r.status_code, _json_or_text(r))
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError:
                    raise EngineError(f"engine {self.name} sent a malformed stream event: {data[:200]!r}") from None
                if isinstance(event, dict) and "error" in event:
                    raise (errors or default_error)(self.name, 500, event)
                yield event
        except httpx.TransportError as e:
            raise self.unreachable(e) from None
        finally:
            await r.aclose()

    async def close(self) -> None:
        await self.client.aclose()


def _json_or_text(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        return {"error": {"message": r.text[:500]}}
    return body if isinstance(body, dict) else {"error": {"message": str(body)[:500]}}


def _json(r: httpx.Response, name: str) -> dict | list:
    try:
        return r.json()
    except ValueError:
        raise EngineError(f"engine {name} answered {r.request.url.path} with non-JSON: {r.text[:200]!r}") from None


def error_fields(body: dict) -> tuple[str, str, object]:
    """(message, type, code) of an OpenAI-style error body (``{"error": {...}}``, or vLLM's flat
    ``{"object": "error", "message", "type", "code"}``)."""
    err = body.get("error", body) if isinstance(body, dict) else {}
    if not isinstance(err, dict):
        err = {"message": str(err)}
    return str(err.get("message") or err.get("detail") or ""), str(err.get("type") or ""), err.get("code")


def default_error(name: str, status: int, body: dict) -> ParrotError:
    """An error response as a typed error, by status and the body's ``code`` (never by its text).

    A Parrot server behind us names its error classes in ``code``: those are rebuilt as they are. Otherwise
    400 / 422 -> BadSamplingParams (the server refused what we sent), 503 -> EngineUnavailable, the rest ->
    EngineError."""
    message, etype, code = error_fields(body)
    text = f"engine {name} answered HTTP {status}: {message or etype or 'no message'}"
    cls = ERROR_CLASSES.get(code) if isinstance(code, str) else None
    if cls is not None and issubclass(cls, (InvalidRequestError, EngineError)):
        return cls(text)
    if status in (400, 422):
        return BadSamplingParams(text)
    if status == 503:
        return EngineUnavailable(text)
    return EngineError(text)


class Dialect(abc.ABC):
    """One kind of server: how to ask it for a completion, read its answers, its tokenizer and its load."""

    kind: ClassVar[str]
    token_prompts: ClassVar[bool]  # prompts as token ids (else text: the context holds UTF-8 bytes)
    prefix_cache: ClassVar[bool]  # the server reuses a cached prompt prefix across requests

    def __init__(self, http: Http) -> None:
        self.http = http

    def error(self, name: str, status: int, body: dict) -> ParrotError:
        """This server's error response as a typed error (the default reads OpenAI-style bodies)."""
        return default_error(name, status, body)

    async def post(self, path: str, body: dict, **kw) -> dict | list:
        return await self.http.post(path, body, errors=self.error, **kw)

    async def get(self, path: str, **kw) -> dict | list:
        return await self.http.get(path, errors=self.error, **kw)

    async def optional(self, path: str) -> dict:
        """A GET of an endpoint the server may lack (e.g. vLLM's ``/tokenizer_info``): {} when it does not answer
        with a JSON object."""
        try:
            body = await self.get(path, probe=True)
        except ParrotError:
            return {}
        return body if isinstance(body, dict) else {}

    @abc.abstractmethod
    async def model_info(self) -> ModelInfo:
        """Model name, window, special tokens, chat template (asked once, at registration)."""

    @abc.abstractmethod
    async def load(self) -> Load:
        """The health check and load report; raises EngineUnavailable when the server is not ready."""

    @abc.abstractmethod
    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS); only called on token-prompt kinds."""

    @abc.abstractmethod
    async def detokenize(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``; only called on token-prompt kinds."""

    @abc.abstractmethod
    def completion_request(self, prompt: Prompt, sampling: SamplingParams, max_tokens: int,
                           stream: bool) -> tuple[str, dict]:
        """(path, body) of one completion of ``prompt``; raises BadSamplingParams for what the server lacks."""

    @abc.abstractmethod
    def parse(self, body: dict) -> Completion:
        """A non-streamed response."""

    @abc.abstractmethod
    def parse_event(self, event: dict, state: dict) -> Completion:
        """One stream event as increments; ``state`` is this stream's own (empty at its start)."""

    def unsupported(self, sampling: SamplingParams, *, fields: tuple[str, ...] = ()) -> None:
        """Raise BadSamplingParams for sampling features this kind cannot map (named in ``fields``)."""
        checks = {
            "logprobs": sampling.logprobs is not None,
            "constraint": sampling.constraint is not None,
            "min_tokens": sampling.min_tokens > 0,
            "repetition_penalty": sampling.repetition_penalty != 1.0,
            "top_k": sampling.top_k > 0,
            "stop_token_ids": bool(sampling.stop_token_ids),
            "include_stop_str_in_output": sampling.include_stop_str_in_output,
            "logit_bias": bool(sampling.logit_bias),
            "min_p": sampling.min_p > 0.0,
            # no dialect maps it (vLLM's takes words, ours are token sequences): refused, never silently dropped
            "bad_words": bool(sampling.bad_words_ids),
        }
        for name in (*fields, "bad_words"):
            if checks[name]:
                raise BadSamplingParams(f"{name} is not supported by {self.kind} backends (engine "
                                        f"{self.http.name})", param=name)


class BackendEngine(EngineClient):
    """An external server as an engine (see the module docstring)."""

    def __init__(self, dialect: Dialect, name: str) -> None:
        self.name = name
        self.dialect = dialect
        self.kind = dialect.kind
        self.url = dialect.http.url
        self._contexts = ContextTree()
        self._info: ModelInfo | None = None
        self._running: dict[int, int] = {}  # our in-flight generations -> their prompt lengths
        self._next_op = 0
        self._byte_window = dialect.http.settings.text_window_bytes_per_token
        self._token_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # LRU: text -> token ids
        # the server's cost as the manager's policies see a builtin engine's (status extra "step_stats"), learned
        # from our own generations: a request's time to first token is one prefill "step" of its prompt, its
        # mean time between tokens one decode step of the generations in flight then (see _learn_cost)
        self.step_stats = StepStats()

    # ---- model and tokenizer ---------------------------------------------------------------------------------
    async def model_info(self) -> ModelInfo:
        if self._info is None:
            info = await self.dialect.model_info()
            if not self.dialect.token_prompts:  # the context counts bytes: allow several per token of the window
                info = ModelInfo(info.name, info.max_model_len * self._byte_window, 256, None, (),
                                 info.chat_template, False, info.numerics)
            self._info = info
        return self._info

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``: the server's tokenizer, remembered per text (templates repeat their constant
        pieces in every request, and each would be one more round trip to the server)."""
        if not self.dialect.token_prompts:
            return list(text.encode("utf-8"))
        ids = self._token_cache.get(text)
        if ids is None:
            ids = tuple(await self.dialect.tokenize(text))
            if len(text) <= TOKEN_CACHE_MAX_CHARS:
                self._token_cache[text] = ids
                if len(self._token_cache) > TOKEN_CACHE_ENTRIES:
                    self._token_cache.popitem(last=False)
        else:
            self._token_cache.move_to_end(text)
        return list(ids)

    async def detokenize(self, token_ids: list[int]) -> str:
        if not self.dialect.token_prompts:
            return bytes(token_ids).decode("utf-8", errors="replace")
        return await self.dialect.detokenize(list(token_ids))

    def _prompt(self, items: list[int]) -> Prompt:
        return items if self.dialect.token_prompts else bytes(items).decode("utf-8", errors="replace")

    def _check_items(self, token_ids: list[int]) -> None:
        top = None if self.dialect.token_prompts else 256
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (top is not None and t >= top):
                raise InvalidRequestError(f"bad token id {t!r} for engine {self.name}", param="token_ids")

    # ---- the context operations --------------------------------------------------------------------------------
    async def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None, *,
                   prompt_logprobs: int | None = None, hint: OpHint | None = None) -> FillResult:
        if prompt_logprobs is not None:
            raise BadSamplingParams(f"prompt_logprobs is not supported by {self.kind} backends (engine "
                                    f"{self.name})", param="prompt_logprobs")
        self._check_items(token_ids)
        info = await self.model_info()
        _, created = self._contexts.open(context_id, parent_context_id)
        length = self._contexts.length(context_id)
        if length + len(token_ids) > info.max_model_len:
            if created:
                self._contexts.free(context_id)
            raise ContextLengthExceeded(f"context {context_id} would hold {length + len(token_ids)} tokens, beyond "
                                        f"the window of engine {self.name} ({info.max_model_len})",
                                        param="token_ids")
        length = self._contexts.append(context_id, token_ids)
        return FillResult(context_id, len(token_ids), length)

    async def _start(self, sampling: SamplingParams, context_id: str, parent_context_id: str | None,
                     stream: bool) -> tuple[list[int], str, dict]:
        info = await self.model_info()
        _, created = self._contexts.open(context_id, parent_context_id)
        items = self._contexts.sequence(context_id)
        room = info.max_model_len - len(items)
        if not items or room < 1:
            if created:
                self._contexts.free(context_id)
            if not items:
                raise InvalidRequestError(f"context {context_id} is empty: fill it before generating",
                                          param="context_id")
            raise ContextLengthExceeded(f"context {context_id} holds {len(items)} tokens: no room to generate in "
                                        f"the window of engine {self.name} ({info.max_model_len})")
        if not self.dialect.token_prompts:
            room = max(1, room // self._byte_window)
        path, body = self.dialect.completion_request(self._prompt(items), sampling, min(sampling.max_tokens, room),
                                                     stream)
        return items, path, body

    def _op(self, prompt_len: int) -> int:
        self._next_op += 1
        self._running[self._next_op] = prompt_len
        return self._next_op

    async def _generated_items(self, text: str, token_ids: tuple[int, ...] | None) -> list[int]:
        if not self.dialect.token_prompts:
            return list(text.encode("utf-8"))
        return list(token_ids) if token_ids is not None else await self.dialect.tokenize(text)

    def _append(self, context_id: str, items: list[int]) -> None:
        if context_id in self._contexts:  # freed meanwhile (an aborted request): nothing to keep
            self._contexts.append(context_id, items)

    async def generate(self, sampling: SamplingParams, context_id: str,
                       parent_context_id: str | None = None, *, hint: OpHint | None = None) -> GenerateResult:
        items, path, body = await self._start(sampling, context_id, parent_context_id, stream=False)
        op, started = self._op(len(items)), time.perf_counter()
        try:
            out = self.dialect.parse(await self.dialect.post(path, body))
        finally:
            self._running.pop(op, None)
        latency = time.perf_counter() - started
        generated = await self._generated_items(out.text, out.token_ids)
        self._append(context_id, generated)
        ids = out.token_ids if out.token_ids is not None else tuple(generated)
        self._learn_cost(len(items), len(ids), out.ttft_s, latency)
        return GenerateResult(context_id, tuple(ids), out.text, out.finish_reason or FinishReason.STOP, len(items),
                              ttft_s=min(out.ttft_s, latency) if out.ttft_s is not None else latency,
                              latency_s=latency, cached_prompt_tokens=out.cached_tokens)

    async def generate_stream(self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None,
                              *, hint: OpHint | None = None) -> AsyncIterator[GenerateChunk]:
        items, path, body = await self._start(sampling, context_id, parent_context_id, stream=True)
        op, started = self._op(len(items)), time.perf_counter()
        first: float | None = None
        texts: list[str] = []
        ids: list[int] = []
        reported = True
        finish: FinishReason | None = None
        cached: int | None = None  # the server's prefix-cache hit, when its stream reports one
        state: dict = {}
        try:
            async for event in self.dialect.http.events(path, body, errors=self.dialect.error):
                piece = self.dialect.parse_event(event, state)
                cached = piece.cached_tokens if piece.cached_tokens is not None else cached
                if piece.token_ids is None:
                    reported = False
                texts.append(piece.text)
                ids.extend(piece.token_ids or ())
                finish = piece.finish_reason or finish
                if piece.text or piece.token_ids:
                    if first is None:
                        first = time.perf_counter() - started
                    yield GenerateChunk(tuple(piece.token_ids or ()), piece.text)
        finally:
            self._running.pop(op, None)
        latency = time.perf_counter() - started
        text = "".join(texts)
        generated = await self._generated_items(text, tuple(ids) if reported else None)
        self._append(context_id, generated)
        self._learn_cost(len(items), len(ids) if reported else len(generated), first, latency)
        yield GenerateChunk((), "", finish or FinishReason.STOP, cached_prompt_tokens=cached)

    async def free_context(self, context_id: str) -> None:
        self._contexts.free(context_id)

    def _learn_cost(self, prompt_len: int, generated: int, ttft_s: float | None, latency_s: float) -> None:
        """Two samples of the server's iteration time from one finished generation (the rows and context of the
        generations still in flight stand for the batch it ran in). The prompt counts whole: the server's prefix
        cache may have served part of it, so prefill is an upper bound, as it is for a builtin engine's caller."""
        rows = len(self._running) + 1
        ctx = sum(self._running.values()) + prompt_len
        if ttft_s is not None and 0 < ttft_s <= latency_s:
            self.step_stats.add(rows - 1, ctx - prompt_len, prompt_len, ttft_s)
            if generated > 1:
                self.step_stats.add(rows, ctx, 0, (latency_s - ttft_s) / (generated - 1))
        elif generated > 0:  # no first-token time: the whole call as decode steps
            self.step_stats.add(rows, ctx, 0, latency_s / generated)

    # ---- status (the heartbeat) ------------------------------------------------------------------------------
    def capabilities(self, load: Load) -> EngineCapabilities:
        # fork is emulated here (a child shares its parent's items); the KV reuse behind it is the server's
        # prefix cache, so a shared prefix is not attended once per step: no shared-prefix attention
        return EngineCapabilities(shared_prefix_attention=False, fork=True, prefix_cache=self.dialect.prefix_cache,
                                  kv_tokens=load.kv_tokens)

    async def status(self) -> EngineStatus:
        info = await self.model_info()
        load = await self.dialect.load()
        ours = list(self._running.values())
        caps = self.capabilities(load)
        kv_total = load.kv_tokens or 0
        kv_used = load.kv_used_tokens if load.kv_used_tokens is not None else min(sum(ours), kv_total)
        return EngineStatus(
            name=self.name, model=info.name, max_model_len=info.max_model_len,
            num_running=max(load.num_running or 0, len(ours)), num_waiting=load.num_waiting or 0,
            running_tokens=sum(ours), waiting_tokens=0, kv_blocks_total=kv_total, kv_blocks_used=kv_used,
            kv_blocks_shared=0, kv_blocks_cached=0, block_size=1, num_contexts=len(self._contexts),
            extra={"capabilities": {**caps.to_wire(), "token_ids": self.dialect.token_prompts},
                   "step_stats": self.step_stats.to_wire(),
                   "backend": {"kind": self.kind, "url": self.url, "held_tokens": self._contexts.total_items()}})

    async def close(self) -> None:
        await self.dialect.http.close()
