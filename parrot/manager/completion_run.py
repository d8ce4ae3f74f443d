"""Running one planned completion (:class:`CompletionRun`): the leases, contexts and attempts behind a
:class:`~parrot.manager.completion_types.CompletionPlan`, for a whole result or a stream of events.

Execution per prompt: take a lease from the dispatcher (the same policy that places DAG requests), ``fill`` the
prompt once into a base context and, for ``n > 1``, ``generate`` each choice in a child context forked from it
(``parent_context_id``; the prompt KV is shared, not copied)::

    base: | prompt |            n == 1: generate into base
            ├── base.0: | prompt | choice 0 ...
            └── base.1: | prompt | choice 1 ...

Failover (:class:`~parrot.manager.failover.Failover`, the executor's loop too): when the prompt's engine
becomes unreachable (a call fails with ``EngineUnavailable``, or the registry declares it dead while a call
hangs), the engine is marked dead and the prompt restarts from its fill on another engine (contexts named
``base-r2``, ...), up to ``max_attempts`` runs in all. A streamed prompt restarts only while none of its
events has been queued for the client; after that the stream ends with an ``engine_unavailable`` error saying
how many tokens were sent (a stream cannot be resumed elsewhere).

Predictions and tool calls (LAMPS; :mod:`parrot.manager.tool_predict`): every generate carries an ``OpHint`` with
its predicted output length (learned online from the lengths this service and the graph executor observe); a
forced call (``tool_choice`` naming a function) also names the tool. A chat answer of one choice whose finish
reason is ``tool_calls`` has its context handed to ``engine.pause_context`` (tool: the first call) instead of
freed: the follow-up request carrying the tool's result renders the same prompt head plus the call, and the
engine's prefix match resumes the paused context's KV (its ``cached_tokens``); once that fill is done the paused
context is freed (:class:`~parrot.manager.tool_context.PausedChats`).

Every context is freed and every lease released when the response ends, fails or the client disconnects
(cleanup runs shielded from cancellation); contexts left on a dead engine are freed if that same engine
process comes back (:class:`~parrot.manager.failover.OrphanContexts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

from parrot.common.errors import EngineError, EngineUnavailable
from parrot.common.log_context import set_log_context
from parrot.common.sampling import FinishReason, PositionLogprobs, SamplingParams
from parrot.protocol.interface import EngineClient, FillResult, GenerateResult, OpHint, ToolHint
from parrot.manager.completion_types import ChoiceResult, CompletionPlan, Position, PromptJob, UnscoredToken
from parrot.manager.dispatcher import Dispatcher, DispatchRequest, Lease
from parrot.manager.failover import Failover, Loss, OrphanContexts
from parrot.manager.logprob_align import aligner, generated_positions
from parrot.manager.metrics import ManagerMetrics
from parrot.manager.recent import RecentRequests
from parrot.manager.tool_calls import ToolChoice
from parrot.manager.tool_context import PausedChats, pause_context
from parrot.manager.tool_predict import Predictors, PromptFeatures

T = TypeVar("T")
Targets = list[tuple[str, str | None]]  # (context, parent) per choice


class CompletionRun:
    """Leases and contexts of one completion request; :meth:`close` frees them all (shielded). The service's
    parts it runs with are passed in: the dispatcher, the failover loop, the recent-requests view, the metrics,
    the predictors, the paused tool-call chats and the orphan contexts."""

    def __init__(self, plan: CompletionPlan, *, dispatcher: Dispatcher, failover: Failover, recent: RecentRequests,
                 metrics: ManagerMetrics, predictors: Predictors, paused_chats: PausedChats,
                 orphans: OrphanContexts) -> None:
        self.dispatcher = dispatcher
        self.failover = failover
        self.recent = recent
        self.predictors = predictors
        self.paused_chats = paused_chats
        self.orphans = orphans
        self.plan = plan
        self.leases: list[Lease] = []
        self.contexts: list[tuple[str, EngineClient, str]] = []  # (engine, client it was created through, context)
        self.fills: dict[int, FillResult] = {}  # job index -> the fill of its latest run
        # job index -> prompt tokens an external server's cache served at generate time (its fill is only
        # bookkeeping): the least over the job's choices, as if its prompt were prefilled once (the first choice)
        self.served_cached: dict[int, int] = {}
        self.timer = metrics.timer("chat" if plan.chat else "completions")
        self.pauses: dict[str, ToolHint] = {}  # context -> the tool call it waits for (paused at close, not freed)
        self.arrived = paused_chats.now()  # when it reached the service (a follow-up: its tool's end)
        self.leased: dict[int, Lease] = {}  # job index -> the lease of its current attempt (its hints' target)

    def features(self, job: PromptJob, sampling: SamplingParams) -> PromptFeatures:
        """The output-length predictor's view of one choice: the prompt's size and head (a chat's system prompt,
        a completion's few-shot head identify the application), max_tokens and the tools offered."""
        plan = self.plan
        head = hashlib.blake2b(str(job.token_ids[:32]).encode(), digest_size=8).hexdigest()
        tools = tuple(t.name for t in plan.tools.tools) if plan.tools is not None else ()
        return PromptFeatures(plan.model, len(job.token_ids), sampling.max_tokens,
                              f"{'chat' if plan.chat else 'completion'}:{head}", tools)

    def hint(self, job: PromptJob, features: PromptFeatures) -> OpHint:
        """The generate's predictions; a forced call (tool_choice naming a function) names its tool; the per-token
        target of ``job``'s lease (Lease.targeted)."""
        tools, predictors = self.plan.tools, self.predictors
        tool = None
        if tools is not None and tools.choice is ToolChoice.NAMED and tools.name is not None:
            tool = ToolHint(tools.name, predictors.tool_durations.predict(tools.name))
        hint = OpHint(predictors.output_length.predict(features), tool, self.plan.options.priority)
        lease = self.leased.get(job.index)
        return lease.targeted(hint) if lease is not None else hint

    def generated(self, ctx: str, features: PromptFeatures, tokens: int, text: str,
                  finish: FinishReason | None, *, single: bool) -> None:
        """A choice generated into ``ctx`` ended: the predictor learns its length; a chat answer of one choice
        (``single``) that ends in tool calls (finish reason ``tool_calls``) marks ``ctx`` to be paused."""
        self.predictors.output_length.observe(features, tokens)
        tools = self.plan.tools
        if not (self.plan.chat and single and tools is not None and finish is FinishReason.STOP):
            return
        calls = tools.parse(text).calls
        if calls:
            name = calls[0].name
            self.pauses[ctx] = ToolHint(name, self.predictors.tool_durations.predict(name))

    @property
    def cached_tokens(self) -> int:
        return sum(f.num_cached for f in self.fills.values()) + sum(self.served_cached.values())

    def served(self, job: PromptJob, cached: int | None) -> None:
        """A choice of ``job`` reported what its engine's cache served of the prompt at generate time."""
        if cached is not None:
            self.served_cached[job.index] = min(cached, self.served_cached.get(job.index, cached))

    def prompt_logprobs(self) -> list[tuple[PositionLogprobs | None, ...]] | None:
        """Per prompt, its tokens' logprobs with ``plan.options.prompt_logprobs`` alternatives (None: not asked)."""
        k = self.plan.options.prompt_logprobs
        if k is None:
            return None
        out = []
        for job in self.plan.jobs:
            scored = self.fills[job.index].prompt_logprobs
            if len(scored) != len(job.token_ids):
                raise EngineError(f"the engine returned {len(scored)} prompt logprobs for {len(job.token_ids)} "
                                  "tokens")
            out.append(tuple(_top(p, k) for p in scored))
        return out

    async def run(self, job: PromptJob, work: Callable[[EngineClient, Targets, FillResult], Awaitable[T]], *,
                  restartable: Callable[[], bool] = lambda: True) -> T:
        """Lease an engine, fill the prompt, ``await work(client, targets, fill)``; on the engine's loss restart
        on another one (see the module docstring) while ``restartable()`` and attempts remain. Without
        generation (echo, max_tokens 0) ``targets`` is empty."""
        plan = self.plan
        set_log_context(request_id=plan.id)  # runs in a task of its own (gather_or_cancel / a pump): its records
        # prompt logprobs only when they are echoed or asked (vLLM's prompt_logprobs), the more alternatives of the
        # two; passed only then (engines without them never see the keyword)
        asked = [k for k in (plan.logprobs if plan.echo else None, plan.options.prompt_logprobs) if k is not None]
        fill_kwargs = {"prompt_logprobs": max(asked)} if asked else {}

        async def attempt(lease: Lease, n: int) -> T:
            self.leases.append(lease)  # held until close: the contexts live on
            self.leased[job.index] = lease
            self.recent.dispatched(span, lease.engine)
            client = lease.client
            base = f"{plan.key}-{job.index}" + (f"-r{n}" if n > 1 else "")
            self.contexts.append((lease.engine, client, base))
            # the prompt's fill carries the (first) choice's predictions: an engine ranking by memory over time
            # admits the request as a whole segment
            first = self.hint(job, self.features(job, job.samplings[0])) if plan.generate and job.samplings else None
            fill = await client.fill(job.token_ids, base, **fill_kwargs, **({"hint": first} if first else {}))
            self.fills[job.index] = fill
            if plan.chat and len(self.paused_chats):  # a follow-up to a tool call: its KV is taken now
                await self.paused_chats.release(job.token_ids, self.orphans, self.predictors.tool_durations,
                                                self.arrived)
            if not plan.generate:
                targets: Targets = []
            elif len(job.samplings) == 1:
                targets = [(base, None)]
            else:
                targets = [(f"{base}.{i}", base) for i in range(len(job.samplings))]
                self.contexts.extend((lease.engine, client, c) for c, _ in targets)
            return await work(client, targets, fill)

        request = DispatchRequest(request_id=f"{plan.key}/{job.index}", models=(plan.model,),
                                  prompt_tokens=len(job.token_ids), prompt_token_ids=tuple(job.token_ids),
                                  max_new_tokens=sum(s.max_tokens for s in job.samplings) if plan.generate else 0,
                                  priority=plan.options.priority)
        with self.recent.span(request.request_id, plan.model, prompt_tokens=len(job.token_ids)) as span:
            return await self.failover.run(request, attempt, what=f"completion {plan.id}/{job.index}",
                                           restartable=restartable, on_lost=self._abandon)

    def _abandon(self, loss: Loss) -> None:
        """Forget the contexts of a run whose engine died: the orphan list frees them if the same engine
        process comes back."""
        lease = loss.lease
        mine = [c for c in self.contexts if c[0] == lease.engine and c[1] is lease.client]
        self.contexts = [c for c in self.contexts if not (c[0] == lease.engine and c[1] is lease.client)]
        for engine, client, ctx in mine:
            self.orphans.add(engine, client, ctx)

    async def _echo(self, job: PromptJob, fill: FillResult, client: EngineClient) -> tuple[str, tuple[Position, ...]]:
        """The echoed prompt of ``job``: its text and, with logprobs, its positions; ("", ()) without echo."""
        if job.echo_text is None:
            return "", ()
        if self.plan.logprobs is None:
            return job.echo_text, ()
        scored = fill.prompt_logprobs
        if len(scored) != len(job.token_ids) or any(p is None for p in scored[1:]):
            raise EngineError(f"the engine returned {len(scored)} prompt logprobs for {len(job.token_ids)} tokens")
        first = _top(scored[0], self.plan.logprobs)
        if first is None:  # nothing predicts a context's first token: its text only
            first = UnscoredToken(job.token_ids[0], await client.detokenize(job.token_ids[:1]))
        return job.echo_text, (first, *(_top(p, self.plan.logprobs) for p in scored[1:] if p is not None))

    async def generate_all(self, job: PromptJob) -> list[ChoiceResult]:
        plan = self.plan

        async def work(client: EngineClient, targets: Targets, fill: FillResult) -> list[ChoiceResult]:
            echo_text, echo_positions = await self._echo(job, fill, client)
            with_logprobs = plan.logprobs is not None
            if not plan.generate:
                return [ChoiceResult(echo_text, FinishReason.LENGTH, (), echo_positions if with_logprobs else None)
                        for _ in job.samplings]
            called = time.monotonic()
            features = [self.features(job, s) for s in job.samplings]
            results: list[GenerateResult] = await gather_or_cancel(
                [client.generate(s, ctx, parent, hint=self.hint(job, f))
                 for s, f, (ctx, parent) in zip(job.samplings, features, targets)])
            out = []
            for res, f, (ctx, _) in zip(results, features, targets):
                self.served(job, res.cached_prompt_tokens)
                self.generated(ctx, f, len(res.token_ids), res.text, res.finish_reason, single=len(targets) == 1)
                self.timer.result(res, called)
                positions = aligner(plan).push(generated_positions(plan, res.token_ids, res.logprobs), res.text,
                                                final=True)
                out.append(ChoiceResult(echo_text + res.text, res.finish_reason, res.token_ids,
                                        echo_positions + positions if with_logprobs else None))
            return out

        return await self.run(job, work)

    async def pump(self, job: PromptJob, queue: asyncio.Queue) -> None:
        """Stream every choice of ``job`` into ``queue`` as ("echo", index, (text, positions)) when echoing,
        ("chunk", index, chunk)..., ("done", index, None); a failure is put as ("error", -1, exc)."""
        sent = 0  # tokens of this prompt already handed to the client
        events = 0  # events of this prompt queued for the client: past 0 a restart would repeat them

        async def work(client: EngineClient, targets: Targets, fill: FillResult) -> None:
            nonlocal events
            echo = await self._echo(job, fill, client)
            indexes = [job.index * self.plan.n + i for i in range(len(job.samplings))]
            if job.echo_text is not None:
                for index in indexes:
                    events += 1
                    queue.put_nowait(("echo", index, echo))
            if not self.plan.generate:
                for index in indexes:
                    queue.put_nowait(("done", index, None))
                return

            async def one(index: int, sampling: SamplingParams, ctx: str, parent: str | None) -> None:
                nonlocal sent, events
                features = self.features(job, sampling)
                tokens, parts, finish = 0, [], None
                async with contextlib.aclosing(client.generate_stream(sampling, ctx, parent,
                                                                      hint=self.hint(job, features))) as chunks:
                    async for chunk in chunks:
                        sent += len(chunk.token_ids)
                        tokens += len(chunk.token_ids)
                        parts.append(chunk.text)
                        finish = chunk.finish_reason or finish
                        self.served(job, chunk.cached_prompt_tokens)
                        events += 1
                        queue.put_nowait(("chunk", index, chunk))
                self.generated(ctx, features, tokens, "".join(parts), finish, single=len(targets) == 1)
                events += 1
                queue.put_nowait(("done", index, None))

            await gather_or_cancel([one(index, s, ctx, parent)
                                    for index, s, (ctx, parent) in zip(indexes, job.samplings, targets)])

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
                tool = self.pauses.get(ctx)
                if tool is not None:
                    if await pause_context(client, engine, ctx, tool, registry=self.dispatcher.registry,
                                           orphans=self.orphans, predictors=self.predictors):
                        self.paused_chats.add(engine, client, ctx, self.plan.jobs[0].token_ids, tool.name)
                else:
                    await self.orphans.free(engine, ctx, client)
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


def _top(p: PositionLogprobs | None, k: int | None) -> PositionLogprobs | None:
    """``p`` with its ``k`` most likely alternatives (a fill computes the most any consumer asked for)."""
    if p is None or k is None or len(p.top) <= k:
        return p
    return dataclasses.replace(p, top=p.top[:k])
