"""OpenAI-style completions over the engine abstraction (request-centric path; no Semantic Variables).

A request becomes a :class:`CompletionPlan` (validated, tokenized, sampling resolved) before any engine work,
so bad input is a 4xx before a stream starts. Execution per prompt: take a lease from the dispatcher (the same
policy that places DAG requests), ``fill`` the prompt once into a base context and, for ``n > 1``, ``generate``
each choice in a child context forked from it (``parent_context_id``; the prompt KV is shared, not copied)::

    base: | prompt |            n == 1: generate into base
            ├── base.0: | prompt | choice 0 ...
            └── base.1: | prompt | choice 1 ...

Failover (as for Parrot requests, :mod:`parrot.manager.failover`): when the prompt's engine becomes unreachable
(a call fails with ``EngineUnavailable``, or the registry declares it dead while a call hangs), the engine is
marked dead and the prompt restarts from its fill on another engine, up to ``max_attempts`` runs in all. A
streamed prompt restarts only while none of its tokens has been sent; after that the stream ends with an
``engine_unavailable`` error event saying how many tokens were sent (a stream cannot be resumed elsewhere).

Every context is freed and every lease released when the response ends, fails or the client disconnects
(cleanup runs shielded from cancellation); contexts left on a dead engine are freed if that same engine
process comes back (:class:`~parrot.manager.failover.OrphanContexts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from parrot.api.chat_template import ChatRenderer
from parrot.api.schemas import ChatCompletionRequest, CompletionRequest, _SamplingRequest
from parrot.common.errors import (
    ContextLengthExceeded,
    EngineUnavailable,
    InvalidRequestError,
    ParrotError,
    UnknownContext,
)
from parrot.common.sampling import SamplingParams
from parrot.engine.interface import EngineClient, GenerateChunk, GenerateResult, ModelInfo
from parrot.manager.dispatcher import Dispatcher, DispatchRequest, Lease
from parrot.manager.engine_registry import EngineState
from parrot.manager.failover import OrphanContexts, run_unless_lost

logger = logging.getLogger(__name__)

MAX_PROMPTS = 256
T = TypeVar("T")


@dataclass(frozen=True)
class PromptJob:
    index: int  # position of the prompt in the request
    token_ids: list[int]
    samplings: tuple[SamplingParams, ...]  # one per choice


@dataclass(frozen=True)
class CompletionPlan:
    chat: bool
    id: str
    created: int
    model: str
    n: int
    jobs: list[PromptJob]
    include_usage: bool

    @property
    def prompt_tokens(self) -> int:
        return sum(len(j.token_ids) for j in self.jobs)


class CompletionService:
    def __init__(self, dispatcher: Dispatcher, *, max_n: int = 16, renderer: ChatRenderer | None = None,
                 max_attempts: int = 3) -> None:
        """``max_attempts``: runs of a prompt in all when its engine dies under it (1 = no restart)."""
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
        self.dispatcher = dispatcher
        self.max_n = max_n
        self.max_attempts = max_attempts
        self.renderer = renderer or ChatRenderer()
        self.num_restarted = 0  # prompts restarted on another engine after theirs died
        self.orphans = OrphanContexts(dispatcher.registry)  # contexts left on dead engines
        self._special_text: dict[tuple[str, int], str] = {}  # (model, token id) -> text

    # ---- planning (all validation happens here) ---------------------------------------------------------------
    async def plan_completion(self, req: CompletionRequest) -> CompletionPlan:
        _reject_unsupported(req, {"echo": req.echo, "logprobs": req.logprobs is not None,
                                  "suffix": req.suffix is not None,
                                  "best_of": req.best_of is not None and req.best_of != req.n})
        client, info = self._tokenizer_for(req.model)
        prompts: list[Any] = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) \
            else list(req.prompt)
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
        jobs = []
        for i, p in enumerate(prompts):
            ids = await self._encode(client, info, p) if isinstance(p, str) else _check_ids(p, info)
            max_tokens = req.max_tokens if req.max_tokens is not None else info.max_model_len - len(ids)
            _check_window(info, len(ids), max_tokens, "prompt")
            jobs.append(PromptJob(i, ids, _samplings(req, max_tokens, self.max_n)))
        return CompletionPlan(False, f"cmpl-{secrets.token_hex(12)}", int(time.time()), req.model, req.n, jobs,
                              bool(req.stream and req.stream_options and req.stream_options.include_usage))

    async def plan_chat(self, req: ChatCompletionRequest) -> CompletionPlan:
        _reject_unsupported(req, {"logprobs": bool(req.logprobs), "top_logprobs": req.top_logprobs is not None})
        client, info = self._tokenizer_for(req.model)
        bos = await self._token_text(client, info, info.bos_token_id)
        eos = await self._token_text(client, info, info.eos_token_ids[0] if info.eos_token_ids else None)
        text = self.renderer.render(info.chat_template, req.messages, bos_token=bos, eos_token=eos)
        ids = await self._encode(client, info, text)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = asked if asked is not None else info.max_model_len - len(ids)
        _check_window(info, len(ids), max_tokens, "messages")
        return CompletionPlan(True, f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), req.model, req.n,
                              [PromptJob(0, ids, _samplings(req, max_tokens, self.max_n))],
                              bool(req.stream and req.stream_options and req.stream_options.include_usage))

    def _tokenizer_for(self, model: str) -> tuple[EngineClient, ModelInfo]:
        entry = self.dispatcher.registry.candidates((model,))[0]  # engines of one model share a tokenizer
        assert entry.info is not None
        return entry.client, entry.info

    async def _encode(self, client: EngineClient, info: ModelInfo, text: str) -> list[int]:
        ids = await client.tokenize(text)
        if info.add_bos and info.bos_token_id is not None and (not ids or ids[0] != info.bos_token_id):
            ids = [info.bos_token_id, *ids]
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    async def _token_text(self, client: EngineClient, info: ModelInfo, token_id: int | None) -> str:
        if token_id is None:
            return ""
        key = (info.name, token_id)
        if key not in self._special_text:
            self._special_text[key] = await client.detokenize([token_id])
        return self._special_text[key]

    # ---- execution ----------------------------------------------------------------------------------------------
    async def complete(self, plan: CompletionPlan) -> dict:
        """Run every prompt and choice; the OpenAI response body."""
        run = _Run(self, plan)
        try:
            per_job = await gather_or_cancel([run.generate_all(job) for job in plan.jobs])
        finally:
            await run.close()
        choices, completion_tokens = [], 0
        for job, results in zip(plan.jobs, per_job):
            for i, res in enumerate(results):
                completion_tokens += len(res.token_ids)
                choices.append(_choice(plan, job.index * plan.n + i, res))
        return {"id": plan.id, "object": "chat.completion" if plan.chat else "text_completion",
                "created": plan.created, "model": plan.model, "choices": choices,
                "usage": _usage(plan.prompt_tokens, completion_tokens)}

    async def stream(self, plan: CompletionPlan) -> AsyncIterator[dict]:
        """Chunks of the OpenAI stream (without the final ``[DONE]``, which the SSE layer adds)."""
        run = _Run(self, plan)
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(run.pump(job, queue)) for job in plan.jobs]
        total = len(plan.jobs) * plan.n
        finished: set[int] = set()
        completion_tokens = 0
        try:
            if plan.chat:
                for index in range(total):
                    yield _chunk(plan, index, {"role": "assistant", "content": ""}, None)
            done = 0
            while done < total:
                kind, index, item = await queue.get()
                if kind == "error":
                    raise item
                if kind == "done":
                    done += 1
                    if index not in finished:  # an engine stream that ended without a finish reason
                        finished.add(index)
                        yield _chunk(plan, index, _delta(plan, ""), "stop")
                    continue
                chunk: GenerateChunk = item
                completion_tokens += len(chunk.token_ids)
                reason = chunk.finish_reason.value if chunk.finish_reason is not None else None
                if reason is not None:
                    finished.add(index)
                if chunk.text or reason is not None:
                    yield _chunk(plan, index, _delta(plan, chunk.text), reason)
            if plan.include_usage:
                yield {"id": plan.id, "object": _chunk_object(plan), "created": plan.created, "model": plan.model,
                       "choices": [], "usage": _usage(plan.prompt_tokens, completion_tokens)}
        finally:
            for t in pumps:
                t.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*pumps, return_exceptions=True)
                await run.close()


Targets = list[tuple[str, str | None]]  # (context, parent) per choice


class _Run:
    """Leases and contexts of one completion request; :meth:`close` frees them all (shielded)."""

    def __init__(self, service: CompletionService, plan: CompletionPlan) -> None:
        self.service = service
        self.dispatcher = service.dispatcher
        self.plan = plan
        self.leases: list[Lease] = []
        self.contexts: list[tuple[str, EngineClient, str]] = []  # (engine, client it was created through, context)

    async def run(self, job: PromptJob, work: Callable[[EngineClient, Targets], Awaitable[T]], *,
                  restartable: Callable[[], bool] = lambda: True) -> T:
        """Lease an engine, fill the prompt, ``await work(client, targets)``; on the engine's loss restart on
        another one (see the module docstring) while ``restartable()`` and attempts remain."""
        enqueued_at: float | None = None
        for attempt in range(1, self.service.max_attempts + 1):
            lease = await self.dispatcher.acquire(DispatchRequest(
                request_id=f"{self.plan.id}/{job.index}", models=(self.plan.model,),
                prompt_tokens=len(job.token_ids), max_new_tokens=sum(s.max_tokens for s in job.samplings)),
                enqueued_at=enqueued_at)
            enqueued_at = lease.enqueued_at  # a restarted prompt keeps its place in the queue
            self.leases.append(lease)
            try:
                return await run_unless_lost(lease, self._attempt(lease, job, attempt, work),
                                             f"completion {self.plan.id}/{job.index}")
            except EngineUnavailable as e:
                self.dispatcher.engine_failed(lease, e)
                self._abandon(lease)
                if attempt == self.service.max_attempts or not restartable():
                    raise
                self.service.num_restarted += 1
                logger.warning("completion %s/%d lost engine %s (%s); restarting (run %d of %d)", self.plan.id,
                               job.index, lease.engine, e.message, attempt + 1, self.service.max_attempts)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _attempt(self, lease: Lease, job: PromptJob, attempt: int,
                       work: Callable[[EngineClient, Targets], Awaitable[T]]) -> T:
        client = lease.client
        base = f"{self.plan.id}-{job.index}" + (f"-r{attempt}" if attempt > 1 else "")
        self.contexts.append((lease.engine, client, base))
        await client.fill(job.token_ids, base)
        if len(job.samplings) == 1:
            targets: Targets = [(base, None)]
        else:
            targets = [(f"{base}.{i}", base) for i in range(len(job.samplings))]
            self.contexts.extend((lease.engine, client, c) for c, _ in targets)
        return await work(client, targets)

    def _abandon(self, lease: Lease) -> None:
        """Forget the contexts of a run whose engine died (the orphan list frees them if the same engine process
        comes back) and give its lease back."""
        mine = [c for c in self.contexts if c[0] == lease.engine and c[1] is lease.client]
        self.contexts = [c for c in self.contexts if not (c[0] == lease.engine and c[1] is lease.client)]
        for engine, client, ctx in mine:
            self.service.orphans.add(engine, client, ctx)
        lease.release()

    async def generate_all(self, job: PromptJob) -> list[GenerateResult]:
        async def work(client: EngineClient, targets: Targets) -> list[GenerateResult]:
            return await gather_or_cancel([client.generate(s, ctx, parent)
                                           for s, (ctx, parent) in zip(job.samplings, targets)])

        return await self.run(job, work)

    async def pump(self, job: PromptJob, queue: asyncio.Queue) -> None:
        """Stream every choice of ``job`` into ``queue`` as ("chunk", index, chunk) / ("done", index, None);
        a failure is put as ("error", -1, exc)."""
        sent = 0  # tokens of this prompt already handed to the client
        events = 0  # events of this prompt queued for the client: past 0 a restart would repeat them

        async def work(client: EngineClient, targets: Targets) -> None:
            async def one(i: int, sampling: SamplingParams, ctx: str, parent: str | None) -> None:
                nonlocal sent, events
                index = job.index * self.plan.n + i
                async with contextlib.aclosing(client.generate_stream(sampling, ctx, parent)) as chunks:
                    async for chunk in chunks:
                        sent += len(chunk.token_ids)
                        events += 1
                        queue.put_nowait(("chunk", index, chunk))
                events += 1
                queue.put_nowait(("done", index, None))

            await gather_or_cancel([one(i, s, ctx, parent)
                                    for i, (s, (ctx, parent)) in enumerate(zip(job.samplings, targets))])

        try:
            await self.run(job, work, restartable=lambda: events == 0)
        except EngineUnavailable as e:
            if events:
                e = EngineUnavailable(f"the engine serving this stream failed after {sent} token(s) were sent "
                                      f"({e.message}); a stream cannot be resumed elsewhere: send the request again")
            queue.put_nowait(("error", -1, e))
        except Exception as e:
            queue.put_nowait(("error", -1, e))

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            registry = self.dispatcher.registry
            for engine, client, ctx in reversed(self.contexts):  # children before their parent
                try:
                    entry = registry.entry(engine)
                    if entry.client is client and entry.state is EngineState.DEAD:  # a call could hang
                        self.service.orphans.add(engine, client, ctx)
                        continue
                    await client.free_context(ctx)
                except UnknownContext:
                    pass  # never created (cancelled early) or already gone
                except ParrotError as e:
                    logger.warning("freeing context %s failed: %s", ctx, e)
            self.contexts.clear()
            for lease in self.leases:
                lease.release()


async def gather_or_cancel(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Like asyncio.gather, but the first failure (or our cancellation) cancels the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(pending)


# ---- request -> sampling ----------------------------------------------------------------------------------------
def _reject_unsupported(req: _SamplingRequest, flags: dict[str, bool]) -> None:
    flags = {**flags, "logit_bias": bool(req.logit_bias)}
    for name, used in flags.items():
        if used:
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)


def _samplings(req: _SamplingRequest, max_tokens: int, max_n: int) -> tuple[SamplingParams, ...]:
    if req.n > max_n:
        raise InvalidRequestError(f"n must be <= {max_n}, got {req.n}", param="n")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k
    base = SamplingParams(
        max_tokens=max_tokens, min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, seed=req.seed,
        include_stop_str_in_output=req.include_stop_str_in_output)
    # choice i of a seeded request uses seed + i: reproducible, yet the n choices differ
    return tuple(base if req.seed is None or i == 0 else base.replace(seed=req.seed + i) for i in range(req.n))


def _check_ids(ids: list[int], info: ModelInfo) -> list[int]:
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequestError(f"token id(s) {bad[:5]} out of the vocabulary [0, {info.vocab_size})",
                                  param="prompt")
    return list(ids)


def _check_window(info: ModelInfo, prompt_len: int, max_tokens: int, what: str) -> None:
    if prompt_len + max(max_tokens, 1) > info.max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {info.max_model_len} tokens. However, you requested "
            f"{prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the {what}, {max(max_tokens, 0)} in the "
            f"completion). Please reduce the length of the {what} or completion.", param=what)


# ---- response shapes ----------------------------------------------------------------------------------------------
def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice(plan: CompletionPlan, index: int, res: GenerateResult) -> dict:
    if plan.chat:
        return {"index": index, "message": {"role": "assistant", "content": res.text}, "logprobs": None,
                "finish_reason": res.finish_reason.value}
    return {"index": index, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason.value}


def _chunk_object(plan: CompletionPlan) -> str:
    return "chat.completion.chunk" if plan.chat else "text_completion"


def _delta(plan: CompletionPlan, text: str) -> dict | str:
    return {"content": text} if plan.chat else text


def _chunk(plan: CompletionPlan, index: int, delta: dict | str, finish_reason: str | None) -> dict:
    choice: dict[str, Any] = {"index": index}
    if plan.chat:
        choice["delta"] = delta if finish_reason is None or delta != {"content": ""} else {}
    else:
        choice["text"] = delta
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    chunk = {"id": plan.id, "object": _chunk_object(plan), "created": plan.created, "model": plan.model,
             "choices": [choice]}
    if plan.include_usage:
        chunk["usage"] = None
    return chunk
