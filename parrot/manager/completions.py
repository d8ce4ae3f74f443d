"""Request-centric completions over the engine abstraction (what the OpenAI-compatible API runs; no Semantic
Variables).

The API layer turns an HTTP request into a plain :class:`CompletionSpec` / :class:`ChatSpec`; the service
makes it a :class:`CompletionPlan` (validated, tokenized, sampling resolved) before any engine work, so bad
input is a 4xx before a stream starts. Results are typed (:class:`CompletionResult`, or :class:`ChoiceDelta`
events then one :class:`Usage`); the API layer shapes them into OpenAI JSON. Execution per prompt: take a
lease from the dispatcher (the same policy that places DAG requests), ``fill`` the prompt once into a base
context and, for ``n > 1``, ``generate`` each choice in a child context forked from it (``parent_context_id``;
the prompt KV is shared, not copied)::

    base: | prompt |            n == 1: generate into base
            ├── base.0: | prompt | choice 0 ...
            └── base.1: | prompt | choice 1 ...

Choice ``j`` of prompt ``i`` has index ``i * n + j`` in results and events.

Failover (:class:`~parrot.manager.failover.Failover`, the executor's loop too): when the prompt's engine
becomes unreachable (a call fails with ``EngineUnavailable``, or the registry declares it dead while a call
hangs), the engine is marked dead and the prompt restarts from its fill on another engine (contexts named
``base-r2``, ...), up to ``max_attempts`` runs in all. A streamed prompt restarts only while none of its
events has been queued for the client; after that the stream ends with an ``engine_unavailable`` error saying
how many tokens were sent (a stream cannot be resumed elsewhere).

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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from parrot.common.errors import ContextLengthExceeded, EngineUnavailable, InvalidRequestError
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.interface import EngineClient, GenerateChunk, GenerateResult, ModelInfo
from parrot.manager.chat_template import ChatRenderer
from parrot.manager.dispatcher import Dispatcher, DispatchRequest, Lease
from parrot.manager.failover import Failover, Loss, OrphanContexts

logger = logging.getLogger(__name__)

MAX_PROMPTS = 256
T = TypeVar("T")


# ---- what comes in ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceSpec:
    """How many choices each prompt gets and how they sample."""

    n: int = 1
    max_tokens: int | None = None  # per choice; None: up to the model's context window
    # SamplingParams fields except max_tokens; validated when planned (BadSamplingParams)
    sampling: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CompletionSpec:
    model: str
    prompts: Sequence[str | Sequence[int]]  # each a text or token ids
    choices: ChoiceSpec = field(default_factory=ChoiceSpec)


@dataclass(frozen=True)
class ChatSpec:
    model: str
    messages: Sequence[Mapping[str, str]]  # {"role", "content"[, "name"]}, as chat templates take them
    choices: ChoiceSpec = field(default_factory=ChoiceSpec)


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

    @property
    def prompt_tokens(self) -> int:
        return sum(len(j.token_ids) for j in self.jobs)

    @property
    def num_choices(self) -> int:
        return len(self.jobs) * self.n


# ---- what goes out ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class CompletionResult:
    choices: list[GenerateResult]  # by choice index
    usage: Usage


@dataclass(frozen=True)
class ChoiceDelta:
    """New text of one choice; the choice's last delta carries its finish reason."""

    index: int
    text: str
    finish_reason: FinishReason | None


class CompletionService:
    def __init__(self, dispatcher: Dispatcher, *, max_n: int = 16, renderer: ChatRenderer | None = None,
                 max_attempts: int = 3) -> None:
        """``max_attempts``: runs of a prompt in all when its engine dies under it (1 = no restart)."""
        self.failover = Failover(dispatcher, max_attempts=max_attempts)  # raises ValueError for max_attempts < 1
        self.dispatcher = dispatcher
        self.max_n = max_n
        self.renderer = renderer or ChatRenderer()
        self.orphans = OrphanContexts(dispatcher.registry)  # contexts left on dead engines
        self._special_text: dict[tuple[str, int], str] = {}  # (model, token id) -> text

    @property
    def num_restarted(self) -> int:
        """Prompts restarted on another engine after theirs died."""
        return self.failover.num_restarts

    # ---- planning (all validation happens here) ---------------------------------------------------------------
    async def plan_completion(self, spec: CompletionSpec) -> CompletionPlan:
        client, info = self._tokenizer_for(spec.model)
        if len(spec.prompts) > MAX_PROMPTS:
            raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(spec.prompts)}",
                                      param="prompt")
        jobs = []
        for i, p in enumerate(spec.prompts):
            ids = await self._encode(client, info, p) if isinstance(p, str) else _check_ids(p, info)
            max_tokens = _max_tokens(spec.choices, info, len(ids), "prompt")
            jobs.append(PromptJob(i, ids, _samplings(spec.choices, max_tokens, self.max_n)))
        return CompletionPlan(False, f"cmpl-{secrets.token_hex(12)}", int(time.time()), spec.model,
                              spec.choices.n, jobs)

    async def plan_chat(self, spec: ChatSpec) -> CompletionPlan:
        client, info = self._tokenizer_for(spec.model)
        bos = await self._token_text(client, info, info.bos_token_id)
        eos = await self._token_text(client, info, info.eos_token_ids[0] if info.eos_token_ids else None)
        text = self.renderer.render(info.chat_template, spec.messages, bos_token=bos, eos_token=eos)
        ids = await self._encode(client, info, text)
        max_tokens = _max_tokens(spec.choices, info, len(ids), "messages")
        return CompletionPlan(True, f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), spec.model,
                              spec.choices.n, [PromptJob(0, ids, _samplings(spec.choices, max_tokens, self.max_n))])

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
    async def complete(self, plan: CompletionPlan) -> CompletionResult:
        """Run every prompt and choice."""
        run = _Run(self, plan)
        try:
            per_job = await gather_or_cancel([run.generate_all(job) for job in plan.jobs])
        finally:
            await run.close()
        choices = [res for results in per_job for res in results]
        return CompletionResult(choices, Usage(plan.prompt_tokens, sum(len(r.token_ids) for r in choices)))

    async def stream(self, plan: CompletionPlan) -> AsyncIterator[ChoiceDelta | Usage]:
        """Deltas as the engines produce them (choices interleaved), then one :class:`Usage`. Every choice
        ends with a delta carrying a finish reason. Raises the first failure (typed) after the deltas sent."""
        run = _Run(self, plan)
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(run.pump(job, queue)) for job in plan.jobs]
        finished: set[int] = set()
        completion_tokens = 0
        try:
            done = 0
            while done < plan.num_choices:
                kind, index, item = await queue.get()
                if kind == "error":
                    raise item
                if kind == "done":
                    done += 1
                    if index not in finished:  # an engine stream that ended without a finish reason
                        finished.add(index)
                        yield ChoiceDelta(index, "", FinishReason.STOP)
                    continue
                chunk: GenerateChunk = item
                completion_tokens += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    finished.add(index)
                if chunk.text or chunk.finish_reason is not None:
                    yield ChoiceDelta(index, chunk.text, chunk.finish_reason)
            yield Usage(plan.prompt_tokens, completion_tokens)
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

        async def attempt(lease: Lease, n: int) -> T:
            self.leases.append(lease)  # held until close: the contexts live on
            client = lease.client
            base = f"{self.plan.id}-{job.index}" + (f"-r{n}" if n > 1 else "")
            self.contexts.append((lease.engine, client, base))
            await client.fill(job.token_ids, base)
            if len(job.samplings) == 1:
                targets: Targets = [(base, None)]
            else:
                targets = [(f"{base}.{i}", base) for i in range(len(job.samplings))]
                self.contexts.extend((lease.engine, client, c) for c, _ in targets)
            return await work(client, targets)

        request = DispatchRequest(request_id=f"{self.plan.id}/{job.index}", models=(self.plan.model,),
                                  prompt_tokens=len(job.token_ids),
                                  max_new_tokens=sum(s.max_tokens for s in job.samplings))
        return await self.service.failover.run(request, attempt, what=f"completion {self.plan.id}/{job.index}",
                                               restartable=restartable, on_lost=self._abandon)

    def _abandon(self, loss: Loss) -> None:
        """Forget the contexts of a run whose engine died: the orphan list frees them if the same engine
        process comes back."""
        lease = loss.lease
        mine = [c for c in self.contexts if c[0] == lease.engine and c[1] is lease.client]
        self.contexts = [c for c in self.contexts if not (c[0] == lease.engine and c[1] is lease.client)]
        for engine, client, ctx in mine:
            self.service.orphans.add(engine, client, ctx)

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
            for engine, client, ctx in reversed(self.contexts):  # children before their parent
                await self.service.orphans.free(engine, ctx, client)
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


# ---- spec -> sampling -------------------------------------------------------------------------------------------
def _max_tokens(choices: ChoiceSpec, info: ModelInfo, prompt_len: int, what: str) -> int:
    """Tokens each choice may generate: as asked, or up to the context window; either must fit in it."""
    max_tokens = choices.max_tokens if choices.max_tokens is not None else info.max_model_len - prompt_len
    if prompt_len + max(max_tokens, 1) > info.max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {info.max_model_len} tokens. However, you requested "
            f"{prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the {what}, {max(max_tokens, 0)} in the "
            f"completion). Please reduce the length of the {what} or completion.", param=what)
    return max_tokens


def _samplings(choices: ChoiceSpec, max_tokens: int, max_n: int) -> tuple[SamplingParams, ...]:
    if choices.n > max_n:
        raise InvalidRequestError(f"n must be <= {max_n}, got {choices.n}", param="n")
    base = SamplingParams.from_dict({**choices.sampling, "max_tokens": max_tokens})
    # choice i of a seeded request uses seed + i: reproducible, yet the n choices differ
    return tuple(base if base.seed is None or i == 0 else base.replace(seed=base.seed + i)
                 for i in range(choices.n))


def _check_ids(ids: Sequence[int], info: ModelInfo) -> list[int]:
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequestError(f"token id(s) {bad[:5]} out of the vocabulary [0, {info.vocab_size})",
                                  param="prompt")
    return list(ids)
