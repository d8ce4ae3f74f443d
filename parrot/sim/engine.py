"""The simulated engine: the builtin engine's contexts, scheduler and KV block pool, with a cost model for time.

It implements :class:`EngineClient` on an asyncio loop (normally the virtual loop of :mod:`parrot.sim.vloop`).
Everything but the forward pass is the real engine code: :class:`Context` / :class:`Op` (the fork tree),
:class:`Scheduler` (continuous batching, chunked prefill, prefix-cache match, preemption, token cap) and
:class:`BlockPool` (ref-counted paged KV, prefix cache with LRU eviction). Each iteration::

    plan = scheduler.schedule()          # the real batch plan
    await asyncio.sleep(cost(plan))      # the cost model instead of a forward (virtual seconds)
    apply(plan)                          # tokens counted as computed; blocks registered; sampling synthetic

Tokens are counted, not computed: a generated token is always ``GEN_TOKEN`` (text ``" tok"``); the output
length is ``max_tokens`` with ``ignore_eos``, else drawn from a seeded distribution (then EOS). Calls that
arrive while an iteration "runs" take effect at once (a free drops KV; the chunk's result is discarded).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

from parrot.common.errors import (
    ContextExists,
    ContextLengthExceeded,
    EngineError,
    InvalidRequestError,
    ParrotError,
    UnknownContext,
)
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.context import Context, Op, OpKind, OpStatus
from parrot.engine.interface import (
    EngineClient,
    EngineStatus,
    FillResult,
    GenerateChunk,
    GenerateResult,
    ModelInfo,
)
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.scheduler.scheduler import BatchPlan, Scheduler, TooLargeForPool
from parrot.engine.stopping import StopChecker
from parrot.sim.cost_model import CostModel
from parrot.sim.tokenizer import BOS, EOS, GEN_TEXT, GEN_TOKEN, OutputLengths, WordTokenizer

__all__ = ["BOS", "EOS", "GEN_TEXT", "GEN_TOKEN", "OutputLengths", "SimEngine", "WordTokenizer"]


_HAS_HIDDEN = object()  # marker in Context.last_hidden: "the last token's logits are available"


class SimEngine(EngineClient):
    def __init__(self, name: str, cost: CostModel, *, model_name: str = "sim-llm", seed: int = 0,
                 output_lengths: OutputLengths = OutputLengths(), vocab_size: int = 32000,
                 enable_prefix_cache: bool = True, shared_prefix_attention: bool = True,
                 clock: Callable[[], float] | None = None) -> None:
        self.name = name
        self.cost = cost
        self.model_name = model_name
        self.pool = BlockPool(-(-cost.kv_cache_tokens // cost.block_size), cost.block_size,
                              enable_prefix_cache=enable_prefix_cache)
        self.scheduler = Scheduler(self.pool, cost.max_num_seqs, cost.max_batch_tokens)
        self.tokenizer = WordTokenizer(vocab_size)
        self.max_model_len = cost.max_model_len
        self.contexts: dict[str, Context] = {}
        self.output_lengths = output_lengths
        self._rng = random.Random(f"{seed}:{name}")
        self._clock = clock
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._targets: dict[int, int] = {}  # id(op) -> generated length at which it ends
        # Shared-prefix attention (paper §7, the builtin engine's kernel): decode rows forked from one parent
        # read the parent's shared KV once per iteration. context id -> (parent id, tokens shared at fork)
        self.shared_prefix_attention = shared_prefix_attention
        self._forked: dict[str, tuple[str, int]] = {}
        self.num_steps = 0
        self.num_tokens_computed = 0
        self.busy_s = 0.0  # virtual seconds spent in iterations
        self._info = ModelInfo(name=model_name, max_model_len=cost.max_model_len, vocab_size=vocab_size,
                               bos_token_id=BOS, eos_token_ids=(EOS,), chat_template=None, add_bos=True)

    # ---- loop ----------------------------------------------------------------------------------------------
    def now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def _kick(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"sim-engine-{self.name}")
        assert self._wake is not None
        self._wake.set()

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                plan = self.scheduler.schedule()
            except TooLargeForPool as e:
                self.scheduler.remove(e.op)
                self._complete(e.op, ContextLengthExceeded(str(e), param="kv_cache"))
                continue
            if not plan.chunks:  # waiting work that cannot be admitted: wait for a change
                self._wake.clear()
                await self._wake.wait()
                continue
            dt = self.iteration_cost(plan)
            self.busy_s += dt
            await asyncio.sleep(dt)
            self._apply(plan)

    def iteration_cost(self, plan: BatchPlan) -> float:
        p = a = d = c = sample_only = 0
        groups: dict[str, list[int]] = {}  # parent id -> shared tokens of its decoding children
        for ch in plan.chunks:
            if ch.num_tokens == 0:
                sample_only += ch.sample  # logits from the stored last hidden state: no forward pass
                continue
            if ch.num_tokens == 1 and ch.sample and ch.start == len(ch.op.ctx.tokens) - 1:
                d += 1
                c += ch.start + 1
                fork = self._forked.get(ch.op.ctx.id) if self.shared_prefix_attention else None
                if fork is not None and ch.op.ctx.num_computed >= fork[1]:
                    groups.setdefault(fork[0], []).append(fork[1])
            else:
                p += ch.num_tokens
                a += ch.num_tokens * (ch.start + ch.num_tokens / 2)
        for shared in groups.values():  # the common prefix is read once for the whole group
            if len(shared) > 1:
                c -= sum(shared) - min(shared)
        if p == 0 and d == 0:  # nothing to compute: only the sampling of stored hidden states (no base cost)
            return self.cost.decode_seq_s * sample_only
        return self.cost.iteration_s(p, a, d + sample_only, c)

    def _apply(self, plan: BatchPlan) -> None:
        self.num_steps += 1
        bs = self.pool.block_size
        now = self.now()
        live = [ch for ch in plan.chunks if ch.op.status is OpStatus.RUNNING and not ch.op.ctx.freed]
        for ch in live:
            ctx = ch.op.ctx
            if ch.num_tokens:
                ctx.num_computed += ch.num_tokens
                self.num_tokens_computed += ch.num_tokens
                n_full = ctx.num_computed // bs
                if n_full > ctx.num_registered:
                    hashes = ctx.block_hashes(n_full, bs)
                    for i in range(ctx.num_registered, n_full):
                        self.pool.register(ctx.block_table[i], hashes[i])
                    ctx.num_registered = n_full
            if ctx.num_computed == len(ctx.tokens):
                ctx.last_hidden = _HAS_HIDDEN
        for ch in live:
            op = ch.op
            if op.kind is OpKind.FILL and op.status is OpStatus.RUNNING and op.ctx.num_uncomputed == 0:
                self.scheduler.remove(op)
                self._complete(op, None)
        for ch in live:
            if ch.sample and ch.op.status is OpStatus.RUNNING:
                if ch.op.first_token_time is None:
                    ch.op.first_token_time = now
                self._on_token(ch.op)

    def _on_token(self, op: Op) -> None:
        ctx, sp = op.ctx, op.sampling
        assert sp is not None
        n = len(op.output_ids) + 1
        eos = n >= self._targets[id(op)] and not sp.ignore_eos and n < sp.max_tokens
        tok = EOS if eos else GEN_TOKEN
        op.output_ids.append(tok)
        ctx.tokens.append(tok)
        ctx.last_hidden = None
        finish = None
        emit = ""
        if not eos:
            if op.stopper is not None:
                emit, finish = op.stopper.push(GEN_TEXT, n)
            else:
                emit = GEN_TEXT
                op.output_text += GEN_TEXT
        elif n >= sp.min_tokens:
            finish = FinishReason.STOP
        if finish is None and (n >= sp.max_tokens or len(ctx.tokens) >= self.max_model_len):
            finish = FinishReason.LENGTH
        if op.stopper is not None:
            if finish is not None:
                emit += op.stopper.flush()
            op.output_text = op.stopper.text
        if op.on_chunk is not None:
            op.on_chunk([tok], emit, finish)
        if finish is not None:
            op.finish_reason = finish
            self.scheduler.remove(op)
            self._complete(op, None)

    # ---- op lifecycle (mirrors LLMEngine) -------------------------------------------------------------------
    def _get_or_fork(self, context_id: str, parent_id: str | None) -> Context:
        ctx = self.contexts.get(context_id)
        if ctx is not None:
            if parent_id is not None and parent_id != ctx.parent_id:
                raise ContextExists(f"context {context_id!r} exists with parent {ctx.parent_id!r}, not "
                                    f"{parent_id!r}", param="context_id")
            return ctx
        if parent_id is None:
            ctx = Context(context_id, None, last_used=self.now())
        else:
            parent = self.contexts.get(parent_id)
            if parent is None:
                raise UnknownContext(f"unknown parent context {parent_id!r}", param="parent_context_id")
            bs = self.pool.block_size
            n_share = parent.num_computed // bs
            shared = parent.block_table[:n_share]
            self.pool.incref(shared)  # fork: the child references the parent's full computed blocks
            ctx = Context(context_id, parent.id, tokens=list(parent.tokens), block_table=list(shared),
                          num_computed=n_share * bs, num_registered=min(n_share, parent.num_registered),
                          last_used=self.now())
            if ctx.num_computed == len(ctx.tokens):
                ctx.last_hidden = parent.last_hidden
            if n_share:
                self._forked[context_id] = (parent.id, n_share * bs)
            parent.last_used = self.now()
        self.contexts[context_id] = ctx
        return ctx

    def _enqueue(self, op: Op) -> None:
        op.arrival = self.now()  # virtual arrival: the scheduler's FCFS key
        if op.ctx.active is None:
            self._start(op)
        else:
            op.status = OpStatus.QUEUED
            op.ctx.pending.append(op)
        self._kick()

    def _start(self, op: Op) -> None:
        ctx = op.ctx
        ctx.active = op
        op.prompt_len = len(ctx.tokens)
        if op.kind is OpKind.FILL:
            if len(ctx.tokens) + len(op.new_tokens) > self.max_model_len:
                self._complete(op, ContextLengthExceeded(
                    f"context {ctx.id!r} would hold {len(ctx.tokens) + len(op.new_tokens)} tokens; the model's "
                    f"window is {self.max_model_len}", param="token_ids"))
                return
            ctx.tokens.extend(op.new_tokens)
            if ctx.num_uncomputed == 0:
                self._complete(op, None)
                return
        else:
            if not ctx.tokens:
                self._complete(op, InvalidRequestError(f"context {ctx.id!r} is empty: fill it before generating",
                                                       param="context_id"))
                return
            if len(ctx.tokens) >= self.max_model_len:
                self._complete(op, ContextLengthExceeded(
                    f"context {ctx.id!r} already holds {len(ctx.tokens)} tokens = the model's window",
                    param="context_id"))
                return
            sp = op.sampling
            assert sp is not None
            self._targets[id(op)] = sp.max_tokens if sp.ignore_eos else max(
                1, sp.min_tokens, min(sp.max_tokens, self.output_lengths.draw(self._rng)))
            op.stopper = StopChecker(sp) if sp.stop else None
        self.scheduler.add(op)

    def _complete(self, op: Op, err: BaseException | None, *, start_next: bool = True) -> None:
        op.status = OpStatus.FAILED if err is not None else OpStatus.FINISHED
        self._targets.pop(id(op), None)
        ctx = op.ctx
        if ctx.active is op:
            ctx.active = None
        ctx.last_used = self.now()
        if op.on_done is not None:
            op.on_done(op, err)
        if start_next and not ctx.freed:
            while ctx.active is None and ctx.pending:
                self._start(ctx.pending.popleft())
            if ctx.active is None:
                self.scheduler.park(ctx)

    def _submit(self, kind: OpKind, ctx: Context, **kw) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        op = Op(kind, ctx, **kw)
        now = self.now

        def done(o: Op, err: BaseException | None) -> None:
            if fut.done():
                return
            if err is not None:
                fut.set_exception(err)
            elif o.kind is OpKind.FILL:
                fut.set_result(FillResult(o.ctx.id, len(o.new_tokens), len(o.ctx.tokens), o.num_cached))
            else:
                t = now()
                ttft = (o.first_token_time if o.first_token_time is not None else t) - o.arrival
                fut.set_result(GenerateResult(o.ctx.id, tuple(o.output_ids), o.output_text,
                                              o.finish_reason or FinishReason.ABORT, o.prompt_len, ttft,
                                              t - o.arrival))

        op.on_done = done
        self._enqueue(op)
        return fut

    # ---- EngineClient ----------------------------------------------------------------------------------------
    async def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None) -> FillResult:
        toks = list(token_ids)
        for t in toks:
            if not isinstance(t, int) or not 0 <= t < self.tokenizer.vocab_size:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary", param="token_ids")
        ctx = self._get_or_fork(context_id, parent_context_id)
        return await self._submit(OpKind.FILL, ctx, new_tokens=toks)

    async def generate(self, sampling: SamplingParams, context_id: str,
                       parent_context_id: str | None = None) -> GenerateResult:
        ctx = self._get_or_fork(context_id, parent_context_id)
        return await self._submit(OpKind.GENERATE, ctx, sampling=sampling)

    async def generate_stream(self, sampling: SamplingParams, context_id: str,
                              parent_context_id: str | None = None) -> AsyncIterator[GenerateChunk]:
        q: asyncio.Queue[GenerateChunk] = asyncio.Queue()
        ctx = self._get_or_fork(context_id, parent_context_id)
        fut = self._submit(OpKind.GENERATE, ctx, sampling=sampling,
                           on_chunk=lambda ids, text, fin: q.put_nowait(GenerateChunk(tuple(ids), text, fin)))
        while True:
            if q.empty() and fut.done():
                res = fut.result()  # raises the typed error of a failed generate
                yield GenerateChunk((), "", res.finish_reason)  # aborted without a final token
                return
            getter = asyncio.ensure_future(q.get())
            await asyncio.wait({getter, fut}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            chunk = getter.result()
            yield chunk
            if chunk.finish_reason is not None:
                return

    async def free_context(self, context_id: str) -> None:
        ctx = self.contexts.pop(context_id, None)
        if ctx is None:
            raise UnknownContext(f"unknown context {context_id!r}", param="context_id")
        ctx.freed = True
        self._forked.pop(context_id, None)
        for op in ([ctx.active] if ctx.active else []) + list(ctx.pending):
            self.scheduler.remove(op)
            op.finish_reason = FinishReason.ABORT
            self._complete(op, EngineError(f"context {context_id!r} was freed") if op.kind is OpKind.FILL
                           else None, start_next=False)
        ctx.pending.clear()
        ctx.active = None
        self.scheduler.forget(ctx)
        Scheduler.drop_kv(self.pool, ctx)
        ctx.last_hidden = None
        if self._wake is not None:
            self._wake.set()  # freed blocks may admit waiting work

    async def set_token_cap(self, max_running_tokens: int | None) -> bool:
        if max_running_tokens is not None and (not isinstance(max_running_tokens, int) or max_running_tokens < 1):
            raise InvalidRequestError(f"max_running_tokens must be a positive integer or null, got "
                                      f"{max_running_tokens!r}", param="max_running_tokens")
        self.scheduler.token_cap = max_running_tokens
        if self._wake is not None:
            self._wake.set()
        return True

    async def status(self) -> EngineStatus:
        sch = self.scheduler
        return EngineStatus(
            name=self.name, model=self.model_name, max_model_len=self.max_model_len,
            num_running=len(sch.running), num_waiting=len(sch.waiting),
            running_tokens=sum(len(o.ctx.tokens) for o in sch.running),
            waiting_tokens=sum(len(o.ctx.tokens) for o in sch.waiting),
            kv_blocks_total=self.pool.num_blocks, kv_blocks_used=self.pool.num_used,
            kv_blocks_shared=self.pool.num_shared, kv_blocks_cached=self.pool.num_cached,
            block_size=self.pool.block_size, num_contexts=len(self.contexts), num_preempted_total=sch.num_preemptions,
            extra={"steps": self.num_steps, "tokens_computed": self.num_tokens_computed, "busy_s": self.busy_s,
                   "prefix_cache_hit_blocks": self.pool.num_hit_blocks, "token_cap": sch.token_cap,
                   "cost_model": self.cost.name})

    async def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    async def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    async def model_info(self) -> ModelInfo:
        return self._info

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, ParrotError):
                pass
            self._task = None
