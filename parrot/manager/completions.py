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

Chat with tools (:mod:`parrot.manager.tool_calls`): the tools are rendered into the prompt (the template's
``tools`` variable or a system block) and the plan carries the :class:`ToolPlan`, by which the API layer reads
each choice's text as tool calls; a forced call's constraint is already in the sampling. Results stay text.

Logprobs (``sampling["logprobs"] = k``) and echo. A choice's logprobs are one entry per position::

    | prompt tokens (echo only; fill(prompt_logprobs=k)) | generated tokens (generate with logprobs=k) |
      ^ the first is an UnscoredToken: nothing predicts it

Completions list every generated token (a final EOS / stop token too: ``len == echoed prompt + completion
tokens``, the positions an evaluation harness slices by). Chat lists the tokens of the message text: a token is
listed once its first byte is in the text sent (:class:`~parrot.manager.logprob_align.TextAligned`), so a final stop token and the tail of a
cut stop string are left out and the listed tokens' bytes spell the content. Echo with ``max_tokens == 0`` fills
the prompt (with its logprobs) and generates nothing (finish reason ``length``). ``Usage.cached_tokens`` sums
the engines' ``FillResult.num_cached`` (each prompt is filled once, whatever ``n``).

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
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio

from parrot.common.errors import (
    BadSamplingParams,
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    InvalidRequestError,
)
from parrot.common.log_context import set_log_context
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.interface import (EngineClient, FillResult, GenerateChunk, GenerateResult, ModelInfo, OpHint,
                                     ToolHint)
from parrot.manager.completion_types import (
    ChatSpec,
    ChoiceDelta,
    ChoiceResult,
    ChoiceSpec,
    CompletionPlan,
    CompletionResult,
    CompletionSpec,
    Position,
    PromptJob,
    Tokenized,
    TokenizerInfo,
    UnscoredToken,
    Usage,
)
from parrot.manager.chat_template import ChatRenderer
from parrot.manager.dispatcher import Dispatcher, DispatchRequest, Lease
from parrot.manager.failover import Failover, Loss, OrphanContexts
from parrot.manager.logprob_align import aligner, generated_positions
from parrot.manager.metrics import ManagerMetrics
from parrot.manager.recent import RecentRequests
from parrot.manager.tool_calls import ToolChoice
from parrot.manager.tool_context import PausedChats, pause_context
from parrot.manager.tool_predict import Predictors, PromptFeatures

logger = logging.getLogger(__name__)

MAX_PROMPTS = 256
T = TypeVar("T")


class CompletionService:
    def __init__(self, dispatcher: Dispatcher, *, max_n: int = 16, renderer: ChatRenderer | None = None,
                 max_attempts: int = 3, recent: RecentRequests | None = None,
                 metrics: ManagerMetrics | None = None, predictors: Predictors | None = None) -> None:
        """``max_attempts``: runs of a prompt in all when its engine dies under it (1 = no restart); ``recent``:
        where each prompt is recorded with its timings when it ends (the manager's, for the web view);
        ``predictors``: output lengths and tool durations (the manager's, shared with the graph executor)."""
        self.failover = Failover(dispatcher, max_attempts=max_attempts)  # raises ValueError for max_attempts < 1
        self.recent = recent or RecentRequests()
        self.metrics = metrics or ManagerMetrics()  # the manager's: requests, TTFT / TPOT / end-to-end
        self.predictors = predictors or Predictors()
        self.paused_chats = PausedChats()  # chat contexts paused for a tool call, until their follow-up is filled
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
        if spec.choices.max_tokens == 0 and not spec.echo:
            raise BadSamplingParams("max_tokens must be >= 1 (0 only with echo: the prompt scored, nothing generated)",
                                    param="max_tokens")
        jobs = []
        for i, p in enumerate(spec.prompts):
            ids = await self._encode(client, info, p) if isinstance(p, str) else _check_ids(p, info, "prompt")
            max_tokens = _max_tokens(spec.choices, info, len(ids), "prompt")
            echo_text = None
            if spec.echo:
                echo_text = p if isinstance(p, str) else await client.detokenize(ids)
            jobs.append(PromptJob(i, ids, _samplings(spec.choices, max_tokens, self.max_n), echo_text))
        return CompletionPlan(False, f"cmpl-{secrets.token_hex(12)}", int(time.time()), spec.model,
                              spec.choices.n, jobs, generate=spec.choices.max_tokens != 0)

    async def plan_chat(self, spec: ChatSpec) -> CompletionPlan:
        client, info = self._tokenizer_for(spec.model)
        tools = spec.tools.shown if spec.tools is not None else []
        ids = await self._encode(client, info, await self._render(client, info, spec.messages, tools=tools))
        max_tokens = _max_tokens(spec.choices, info, len(ids), "messages")
        if max_tokens == 0:
            raise BadSamplingParams("max_tokens must be >= 1", param="max_tokens")
        return CompletionPlan(True, f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), spec.model,
                              spec.choices.n, [PromptJob(0, ids, _samplings(spec.choices, max_tokens, self.max_n))],
                              tools=spec.tools)

    # ---- tokenizer endpoints ------------------------------------------------------------------------------------
    async def tokenize(self, model: str | None, *, prompt: str | None = None,
                       messages: Sequence[Mapping[str, Any]] | None = None, add_special_tokens: bool = True,
                       add_generation_prompt: bool = True) -> Tokenized:
        """Token ids of ``prompt``, or of ``messages`` rendered with the chat template, as the completion and
        chat paths count them (``add_special_tokens``: BOS when the model adds one). One of the two is given."""
        client, info = self._tokenizer_for(self._model_or_only(model))
        if messages is not None:
            text = await self._render(client, info, messages, add_generation_prompt=add_generation_prompt)
        else:
            assert prompt is not None
            text = prompt
        ids = await self._encode(client, info, text, add_bos=add_special_tokens, allow_empty=True)
        return Tokenized(ids, info.max_model_len)

    async def detokenize(self, model: str | None, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; ids outside the vocabulary are a 400 naming ``tokens``."""
        client, info = self._tokenizer_for(self._model_or_only(model))
        return await client.detokenize(_check_ids(token_ids, info, "tokens"))

    async def tokenizer_info(self, model: str | None) -> TokenizerInfo:
        client, info = self._tokenizer_for(self._model_or_only(model))
        bos = await self._token_text(client, info, info.bos_token_id) if info.bos_token_id is not None else None
        eos_id = info.eos_token_ids[0] if info.eos_token_ids else None
        eos = await self._token_text(client, info, eos_id) if eos_id is not None else None
        return TokenizerInfo(info.name, bos, eos, info.chat_template, info.max_model_len, info.add_bos)

    def _model_or_only(self, model: str | None) -> str:
        """``model``, or the one served model when not named (several served: 400 naming ``model``)."""
        if model is not None:
            return model
        names = sorted({i.name for i in self.dispatcher.registry.model_infos()})
        if len(names) > 1:
            raise InvalidRequestError(f"name the model: this server serves {names}", param="model")
        if not names:
            raise EngineUnavailable("no live engine")
        return names[0]

    def _tokenizer_for(self, model: str) -> tuple[EngineClient, ModelInfo]:
        entry = self.dispatcher.registry.candidates((model,))[0]  # engines of one model share a tokenizer
        assert entry.info is not None
        return entry.client, entry.info

    async def _render(self, client: EngineClient, info: ModelInfo, messages: Sequence[Mapping[str, Any]], *,
                      add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] = ()) -> str:
        bos = await self._token_text(client, info, info.bos_token_id)
        eos = await self._token_text(client, info, info.eos_token_ids[0] if info.eos_token_ids else None)
        return self.renderer.render(info.chat_template, messages, bos_token=bos, eos_token=eos,
                                    add_generation_prompt=add_generation_prompt, tools=tools)

    async def _encode(self, client: EngineClient, info: ModelInfo, text: str, *, add_bos: bool = True,
                      allow_empty: bool = False) -> list[int]:
        ids = await client.tokenize(text)
        if add_bos and info.add_bos and info.bos_token_id is not None and (not ids or ids[0] != info.bos_token_id):
            ids = [info.bos_token_id, *ids]
        if not ids and not allow_empty:
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
        except BaseException as e:
            run.timer.done(e)
            raise
        else:
            run.timer.done(None)
        finally:
            await run.close()
        choices = [res for results in per_job for res in results]
        return CompletionResult(choices, Usage(plan.prompt_tokens, sum(len(r.token_ids) for r in choices),
                                               run.cached_tokens))

    async def stream(self, plan: CompletionPlan) -> AsyncIterator[ChoiceDelta | Usage]:
        """Deltas as the engines produce them (choices interleaved), then one :class:`Usage`. Every choice
        ends with a delta carrying a finish reason. Raises the first failure (typed) after the deltas sent."""
        run = _Run(self, plan)
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(run.pump(job, queue)) for job in plan.jobs]
        aligners = [aligner(plan) for _ in range(plan.num_choices)]
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
                        yield ChoiceDelta(index, "", FinishReason.STOP, aligners[index].push((), "", final=True))
                    continue
                if kind == "echo":
                    text, positions = item
                    reason = None if plan.generate else FinishReason.LENGTH
                    if reason is not None:
                        finished.add(index)
                    yield ChoiceDelta(index, text, reason, positions)
                    continue
                chunk: GenerateChunk = item
                completion_tokens += len(chunk.token_ids)
                final = chunk.finish_reason is not None
                run.timer.chunk(index, len(chunk.token_ids), final)
                if final:
                    finished.add(index)
                positions = aligners[index].push(generated_positions(plan, chunk.token_ids, chunk.logprobs),
                                                 chunk.text, final=final)
                if chunk.text or final or positions:
                    yield ChoiceDelta(index, chunk.text, chunk.finish_reason, positions)
            yield Usage(plan.prompt_tokens, completion_tokens, run.cached_tokens)
        except BaseException as e:  # a failure, or the client went away (GeneratorExit)
            run.timer.done(e)
            raise
        else:
            run.timer.done(None)
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
        self.fills: dict[int, FillResult] = {}  # job index -> the fill of its latest run
        self.timer = service.metrics.timer("chat" if plan.chat else "completions")
        self.pauses: dict[str, ToolHint] = {}  # context -> the tool call it waits for (paused at close, not freed)
        self.arrived = service.paused_chats.now()  # when it reached the service (a follow-up: its tool's end)

    def features(self, job: PromptJob, sampling: SamplingParams) -> PromptFeatures:
        """The output-length predictor's view of one choice: the prompt's size and head (a chat's system prompt,
        a completion's few-shot head identify the application), max_tokens and the tools offered."""
        plan = self.plan
        head = hashlib.blake2b(str(job.token_ids[:32]).encode(), digest_size=8).hexdigest()
        tools = tuple(t.name for t in plan.tools.tools) if plan.tools is not None else ()
        return PromptFeatures(plan.model, len(job.token_ids), sampling.max_tokens,
                              f"{'chat' if plan.chat else 'completion'}:{head}", tools)

    def hint(self, features: PromptFeatures) -> OpHint:
        """The generate's predictions; a forced call (tool_choice naming a function) names its tool."""
        tools, predictors = self.plan.tools, self.service.predictors
        tool = None
        if tools is not None and tools.choice is ToolChoice.NAMED and tools.name is not None:
            tool = ToolHint(tools.name, predictors.tool_durations.predict(tools.name))
        return OpHint(predictors.output_length.predict(features), tool)

    def generated(self, ctx: str, features: PromptFeatures, tokens: int, text: str,
                  finish: FinishReason | None, *, single: bool) -> None:
        """A choice generated into ``ctx`` ended: the predictor learns its length; a chat answer of one choice
        (``single``) that ends in tool calls (finish reason ``tool_calls``) marks ``ctx`` to be paused."""
        self.service.predictors.output_length.observe(features, tokens)
        tools = self.plan.tools
        if not (self.plan.chat and single and tools is not None and finish is FinishReason.STOP):
            return
        calls = tools.parse(text).calls
        if calls:
            name = calls[0].name
            self.pauses[ctx] = ToolHint(name, self.service.predictors.tool_durations.predict(name))

    @property
    def cached_tokens(self) -> int:
        return sum(f.num_cached for f in self.fills.values())

    async def run(self, job: PromptJob, work: Callable[[EngineClient, Targets, FillResult], Awaitable[T]], *,
                  restartable: Callable[[], bool] = lambda: True) -> T:
        """Lease an engine, fill the prompt, ``await work(client, targets, fill)``; on the engine's loss restart
        on another one (see the module docstring) while ``restartable()`` and attempts remain. Without
        generation (echo, max_tokens 0) ``targets`` is empty."""
        plan = self.plan
        set_log_context(request_id=plan.id)  # runs in a task of its own (gather_or_cancel / a pump): its records
        # prompt logprobs only when they are echoed; passed only then (engines without them never see the keyword)
        fill_kwargs = {"prompt_logprobs": plan.logprobs} if plan.echo and plan.logprobs is not None else {}

        async def attempt(lease: Lease, n: int) -> T:
            self.leases.append(lease)  # held until close: the contexts live on
            self.service.recent.dispatched(span, lease.engine)
            client = lease.client
            base = f"{plan.id}-{job.index}" + (f"-r{n}" if n > 1 else "")
            self.contexts.append((lease.engine, client, base))
            # the prompt's fill carries the (first) choice's predictions: an engine ranking by memory over time
            # admits the request as a whole segment
            first = self.hint(self.features(job, job.samplings[0])) if plan.generate and job.samplings else None
            fill = await client.fill(job.token_ids, base, **fill_kwargs, **({"hint": first} if first else {}))
            self.fills[job.index] = fill
            if plan.chat and len(self.service.paused_chats):  # a follow-up to a tool call: its KV is taken now
                await self.service.paused_chats.release(job.token_ids, self.service.orphans,
                                                        self.service.predictors.tool_durations, self.arrived)
            if not plan.generate:
                targets: Targets = []
            elif len(job.samplings) == 1:
                targets = [(base, None)]
            else:
                targets = [(f"{base}.{i}", base) for i in range(len(job.samplings))]
                self.contexts.extend((lease.engine, client, c) for c, _ in targets)
            return await work(client, targets, fill)

        request = DispatchRequest(request_id=f"{plan.id}/{job.index}", models=(plan.model,),
                                  prompt_tokens=len(job.token_ids), prompt_token_ids=tuple(job.token_ids),
                                  max_new_tokens=sum(s.max_tokens for s in job.samplings) if plan.generate else 0)
        with self.service.recent.span(request.request_id, plan.model, prompt_tokens=len(job.token_ids)) as span:
            return await self.service.failover.run(request, attempt, what=f"completion {plan.id}/{job.index}",
                                                   restartable=restartable, on_lost=self._abandon)

    def _abandon(self, loss: Loss) -> None:
        """Forget the contexts of a run whose engine died: the orphan list frees them if the same engine
        process comes back."""
        lease = loss.lease
        mine = [c for c in self.contexts if c[0] == lease.engine and c[1] is lease.client]
        self.contexts = [c for c in self.contexts if not (c[0] == lease.engine and c[1] is lease.client)]
        for engine, client, ctx in mine:
            self.service.orphans.add(engine, client, ctx)

    async def _echo(self, job: PromptJob, fill: FillResult, client: EngineClient) -> tuple[str, tuple[Position, ...]]:
        """The echoed prompt of ``job``: its text and, with logprobs, its positions; ("", ()) without echo."""
        if job.echo_text is None:
            return "", ()
        if self.plan.logprobs is None:
            return job.echo_text, ()
        scored = fill.prompt_logprobs
        if len(scored) != len(job.token_ids) or any(p is None for p in scored[1:]):
            raise EngineError(f"the engine returned {len(scored)} prompt logprobs for {len(job.token_ids)} tokens")
        first = scored[0]
        if first is None:  # nothing predicts a context's first token: its text only
            first = UnscoredToken(job.token_ids[0], await client.detokenize(job.token_ids[:1]))
        return job.echo_text, (first, *(p for p in scored[1:] if p is not None))

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
                [client.generate(s, ctx, parent, hint=self.hint(f))
                 for s, f, (ctx, parent) in zip(job.samplings, features, targets)])
            out = []
            for res, f, (ctx, _) in zip(results, features, targets):
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
                                                                      hint=self.hint(features))) as chunks:
                    async for chunk in chunks:
                        sent += len(chunk.token_ids)
                        tokens += len(chunk.token_ids)
                        parts.append(chunk.text)
                        finish = chunk.finish_reason or finish
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
                                           orphans=self.service.orphans, predictors=self.service.predictors):
                        self.service.paused_chats.add(engine, client, ctx, self.plan.jobs[0].token_ids, tool.name)
                else:
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
    if prompt_len + (max(max_tokens, 1) if choices.max_tokens != 0 else 0) > info.max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {info.max_model_len} tokens. However, you requested "
            f"{prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the {what}, {max(max_tokens, 0)} in the "
            f"completion). Please reduce the length of the {what} or completion.", param=what)
    return max_tokens


def _samplings(choices: ChoiceSpec, max_tokens: int, max_n: int) -> tuple[SamplingParams, ...]:
    if choices.n > max_n:
        raise InvalidRequestError(f"n must be <= {max_n}, got {choices.n}", param="n")
    # max_tokens 0 (echo only) never generates: the other fields are still validated
    base = SamplingParams.from_dict({**choices.sampling, "max_tokens": max(max_tokens, 1)})
    # choice i of a seeded request uses seed + i: reproducible, yet the n choices differ
    return tuple(base if base.seed is None or i == 0 else base.replace(seed=base.seed + i)
                 for i in range(choices.n))


def _check_ids(ids: Sequence[int], info: ModelInfo, param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequestError(f"token id(s) {bad[:5]} out of the vocabulary [0, {info.vocab_size})",
                                  param=param)
    return list(ids)
