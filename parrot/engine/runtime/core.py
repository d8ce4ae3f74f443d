"""EngineCore: the builtin engine's op lifecycle and step logic, without torch, threads or a clock of its own.

The public calls (fill / generate / free_context / set_token_cap / pin_prefix) validate their arguments in the
caller and hand a command to the engine's *owner*, which runs commands only between steps and is the only
writer of contexts, ops and the scheduler. KV state (block tables, computed prefixes, the block pool) changes only
through the scheduler's :class:`~parrot.engine.kv_cache.manager.KVManager`, which the core shares for fork, free,
computed tokens and pins. One owner turn::

    commands                          # ops queued on their contexts, contexts forked / freed, caps set
    plan = core.next_plan()           # the scheduler's batch plan (None: nothing runnable)
    out = runner.execute(plan)        # a StepOutput: a model forward + sampling, or the simulator's synthetic one
    core.apply(out)                   # tokens computed, prefix blocks registered, tokens sampled, ops finished

Two owners exist: :class:`~parrot.engine.runtime.engine_loop.LLMEngine` (a thread, wall clock, the torch ModelRunner) and
:class:`~parrot.sim.sim_engine.SimEngine` (an asyncio task on the virtual clock, a cost model instead of a forward).
An op is QUEUED behind its context's active op, then WAITING / RUNNING in the scheduler, then FINISHED or
FAILED; its result leaves through its callbacks, which settle the caller's future (``concurrent.futures`` or
asyncio: both have done / set_result / set_exception).

Tool calls (LAMPS): ``pause_context`` hands a context over while its tool runs; the scheduler keeps, swaps or
drops its KV (:mod:`parrot.engine.kv_cache.tool_pauses`). The core resumes it -- drops the pause record, and frees
the paused context unless the op is on it -- when an op arrives on it, a context forks from it, or a context's
computed prefix reaches its last full block (``KVManager.covered``, checked after each plan and each applied
step); a pause past its TTL is freed (checked at each command and plan).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from parrot.common.errors import (
    BadSamplingParams,
    ContextExists,
    ContextLengthExceeded,
    EngineError,
    InvalidRequestError,
    ParrotError,
    UnknownContext,
)
from parrot.common.sampling import MAX_LOGPROBS, FinishReason, PositionLogprobs, SamplingParams
from parrot.common.step_cost import StepStats
from parrot.engine.runtime.guided import GrammarCompiler
from parrot.engine.runtime.context import Context, LogprobLabels, Op, OpKind, OpStatus, RawLogprobs
from parrot.protocol.interface import (EngineCapabilities, EngineStatus, FillResult, GenerateChunk, GenerateResult,
                                    OpHint, PauseResult, ToolHint)
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.kv_cache.tool_pauses import EngineToolCosts, pause_ttl
from parrot.engine.kv_cache.prompt_logprobs import (DEFAULT_CAPACITY_BLOCKS, PromptLogprobCache, is_known, match_limit,
                                                    wants_prompt_logprobs)
from parrot.engine.scheduler.scheduler import BatchPlan, Scheduler, TooLargeForPool
from parrot.engine.runtime.stopping import StopChecker

log = logging.getLogger(__name__)

ChunkCallback = Callable[[GenerateChunk], None]
Command = Callable[[], None]


class ResultFuture(Protocol):
    """What the core settles: a ``concurrent.futures.Future`` (engine thread) or an ``asyncio.Future``."""

    def done(self) -> bool: ...

    def set_result(self, result: object) -> None: ...

    def set_exception(self, exception: BaseException) -> None: ...


@dataclass(frozen=True)
class StepOutput:
    """What one iteration produced, for :meth:`EngineCore.apply`."""

    computed: tuple[tuple[Context, int], ...]  # (context, tokens newly computed)
    # contexts whose end was reached this step, with the runner's opaque handle on the last token's hidden state
    # (a tensor in the builtin engine; stored in Context.last_hidden so a later Generate can sample from it)
    last_hidden: tuple[tuple[Context, object], ...]
    sampled: tuple[tuple[Op, int], ...]  # (generate op, new token)
    # (generate op, logprobs of its new token) for the sampled ops whose sampling asks for logprobs
    token_logprobs: tuple[tuple[Op, RawLogprobs], ...] = ()
    # (prompt-logprob fill, position, logprobs of the token there) for the positions computed this step
    prompt_logprobs: tuple[tuple[Op, int, RawLogprobs], ...] = ()


class StepRunner(Protocol):
    """Runs a batch plan: the torch ModelRunner, or the simulator's synthetic runner."""

    num_shared_prefix_rows: int  # decode rows served by the shared-prefix attention path (a metric)

    def execute(self, plan: BatchPlan) -> StepOutput: ...


class EngineCore(abc.ABC):
    """The engine state machine. Subclasses supply the owner: how a command reaches it and the future type."""

    def __init__(self, *, name: str, model_name: str, runner: StepRunner, pool: BlockPool, scheduler: Scheduler,
                 tokenizer, max_model_len: int, clock: Callable[[], float], cached_status: bool,
                 numerics: dict | None = None, computes_logits: bool = True,
                 tool_pause_ttl_s: float | None = None) -> None:
        """``cached_status``: callers run on other threads than the owner, so :meth:`status` answers the snapshot
        the owner takes after each turn and each status-changing command; otherwise it snapshots on call.
        ``numerics``: how the runner computes (NumericsPlan.to_dict()), reported in status and model info.
        ``pool`` must be the one ``scheduler`` plans over (its KV manager's). ``computes_logits``: False for a runner
        without logits (the simulator's): then a request for logprobs raises BadSamplingParams naming the field.
        ``tool_pause_ttl_s``: how long a paused context waits to be resumed (None: from its tool's expected
        duration, see :func:`~parrot.engine.kv_cache.tool_pauses.pause_ttl`). The runner may report
        ``kv_bytes_per_token``, ``copy_bytes_per_s`` (measured) and ``default_copy_bytes_per_s`` for swap costs."""
        if scheduler.kv.pool is not pool:
            raise ValueError("pool: the scheduler plans over another block pool")
        self.name = name
        self.numerics = dict(numerics or {})
        self.computes_logits = computes_logits
        self.model_name = model_name
        self.runner = runner
        self.pool = pool
        self.scheduler = scheduler
        self.kv = scheduler.kv  # the one writer of KV state, shared with the scheduler
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.clock = clock  # op arrival (FCFS order), context LRU, first-token and latency times
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self.contexts: dict[str, Context] = {}
        # prompt logprobs of computed blocks, so prompt-logprob fills keep the prefix cache (kv_cache.prompt_logprobs)
        self.prompt_lp_cache = PromptLogprobCache(
            pool.block_size, capacity_blocks=DEFAULT_CAPACITY_BLOCKS if pool.enable_prefix_cache else 0)
        self.kv.set_match_limit(partial(match_limit, block_size=pool.block_size))
        self._labels = LogprobLabels(tokenizer)  # runner ids + floats -> records with each token's text
        self.grammars = GrammarCompiler(tokenizer)  # constrained generation: compiled once per constraint
        self.num_steps = 0
        self.num_tokens_computed = 0
        # prefix-cache hit rate (metrics): prompt tokens of finished fills, and those served from the prefix cache
        self.num_fill_tokens = 0
        self.num_fill_cached_tokens = 0
        # iteration time vs batch (reported in status for the global scheduler's cost-aware placement): each
        # plan's batch counts and start time, recorded when the plan is applied
        self.step_stats = StepStats()
        self._plan_started: tuple[float, int, int, int] | None = None
        self.tool_pause_ttl_s = tool_pause_ttl_s
        self.scheduler.costs = EngineToolCosts(
            self.step_stats, lambda: (len(scheduler.running), sum(len(o.ctx.tokens) for o in scheduler.running)),
            int(getattr(runner, "kv_bytes_per_token", 0)) or 1, lambda: getattr(runner, "copy_bytes_per_s", None),
            float(getattr(runner, "default_copy_bytes_per_s", 0.0)) or 1e9)
        self.num_generates_finished = 0
        self.num_ops_aborted = 0  # ops stopped by a free of their context (their caller went away)
        self._cached_status = cached_status
        # what placement may count on (parrot.protocol.interface.EngineCapabilities): fixed once the engine is built
        self._capabilities = EngineCapabilities(
            shared_prefix_attention=bool(getattr(runner, "shared_prefix_attention", False)), fork=True,
            prefix_cache=pool.enable_prefix_cache, kv_tokens=pool.num_blocks * pool.block_size).to_wire()
        self._status = self.snapshot()

    # ---- the owner ---------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _new_future(self) -> ResultFuture:
        """A future of the kind the owner's callers wait on."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the owner; calls made afterwards raise EngineError."""

    @abc.abstractmethod
    def _submit(self, cmd: Command) -> None:
        """Have the owner run ``cmd`` between steps (it never raises: errors settle the command's future).
        Raises EngineError if the engine is shut down."""

    # ---- public API (any caller of the owner) ----------------------------------------------------------------
    def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None, *,
             prompt_logprobs: int | None = None, hint: OpHint | None = None) -> ResultFuture:
        """See EngineClient.fill; raises BadSamplingParams for a ``prompt_logprobs`` outside [0, MAX_LOGPROBS]."""
        toks = self.check_tokens(token_ids)
        if prompt_logprobs is not None:
            if isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int) \
                    or not 0 <= prompt_logprobs <= MAX_LOGPROBS:
                raise BadSamplingParams(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got "
                                        f"{prompt_logprobs!r}", param="prompt_logprobs")
            self._check_logits("prompt_logprobs")

        def cmd(fut: ResultFuture) -> None:
            ctx = self._get_or_fork(context_id, parent_context_id)
            self._enqueue(self._new_op(fut, OpKind.FILL, ctx, new_tokens=toks, prompt_logprobs=prompt_logprobs,
                                       hint=hint))

        return self._command(cmd)

    def generate(self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None,
                 on_chunk: ChunkCallback | None = None, *, hint: OpHint | None = None) -> ResultFuture:
        if sampling.logprobs is not None:
            self._check_logits("logprobs")
        if sampling.constraint is not None:
            self._check_logits("constraint")

        def cmd(fut: ResultFuture) -> None:
            ctx = self._get_or_fork(context_id, parent_context_id)
            self._enqueue(self._new_op(fut, OpKind.GENERATE, ctx, sampling=sampling, on_chunk=on_chunk, hint=hint))

        return self._command(cmd)

    def free_context(self, context_id: str) -> ResultFuture:
        def cmd(fut: ResultFuture) -> None:
            ctx = self.contexts.pop(context_id, None)
            if ctx is None:
                raise UnknownContext(f"unknown context {context_id!r}", param="context_id")
            self.scheduler.unpause(context_id, self.clock(), reason="freed")
            ctx.freed = True
            for op in ([ctx.active] if ctx.active else []) + list(ctx.pending):
                self.scheduler.remove(op)
                self.num_ops_aborted += 1
                op.finish_reason = FinishReason.ABORT
                self._complete(op, EngineError(f"context {context_id!r} was freed") if op.kind is OpKind.FILL else None,
                               start_next=False)
            ctx.pending.clear()
            ctx.active = None
            self.scheduler.forget(ctx)
            self.kv.free(ctx)
            ctx.last_hidden = None
            self.refresh_status()  # callers read status right after a free
            _settle(fut, None)

        return self._command(cmd)

    def pause_context(self, context_id: str, tool: ToolHint) -> ResultFuture:
        """See EngineClient.pause_context: the engine owns ``context_id`` from now on. A repeated pause answers the
        first one's record; a context with queued or running ops cannot be paused (InvalidRequestError)."""
        def cmd(fut: ResultFuture) -> None:
            ctx = self.contexts.get(context_id)
            if ctx is None:
                raise UnknownContext(f"unknown context {context_id!r}", param="context_id")
            p = self.scheduler.pauses.get(context_id)
            if p is None:
                if ctx.active is not None or ctx.pending:
                    raise InvalidRequestError(f"context {context_id!r} has ops queued or running; pause it after "
                                              "they finish", param="context_id")
                p = self.scheduler.pause(ctx, tool, now=self.clock(), ttl_s=pause_ttl(tool, self.tool_pause_ttl_s),
                                         predicted=ctx.tool_handling)
                ctx.tool_handling = None
                self.refresh_status()
            _settle(fut, PauseResult(context_id, p.handling.value, p.num_tokens, p.num_blocks))

        return self._command(cmd)

    def set_token_cap(self, max_running_tokens: int | None) -> ResultFuture:
        """The global scheduler's cap on running tokens (see Scheduler.token_cap); applied between steps."""
        if max_running_tokens is not None and (not isinstance(max_running_tokens, int) or max_running_tokens < 1):
            raise InvalidRequestError(f"max_running_tokens must be a positive integer or null, got "
                                      f"{max_running_tokens!r}", param="max_running_tokens")

        def cmd(fut: ResultFuture) -> None:
            self.scheduler.token_cap = max_running_tokens
            self.refresh_status()
            _settle(fut, None)

        return self._command(cmd)

    def pin_prefix(self, token_ids: list[int], pinned: bool = True) -> ResultFuture:
        """Pin (or unpin) the cached KV of a hot token prefix: its full blocks hold one extra reference, so
        LRU eviction never drops them. Only blocks already cached or in use are pinned (fill the prefix first);
        the result is the number of blocks now pinned for this prefix."""
        toks = self.check_tokens(token_ids)

        def cmd(fut: ResultFuture) -> None:
            n = self.kv.pin_prefix(toks, pinned)
            self.refresh_status()
            _settle(fut, n)

        return self._command(cmd)

    def status(self) -> EngineStatus:
        return self._status if self._cached_status else self.snapshot()

    # ---- commands (owner) ----------------------------------------------------------------------------------------
    def _command(self, body: Callable[[ResultFuture], None]) -> ResultFuture:
        fut = self._new_future()

        def guarded() -> None:
            try:
                self.expire_pauses()
                body(fut)
            except ParrotError as e:
                if not fut.done():
                    fut.set_exception(e)
            except Exception as e:  # a bug: report it to the caller, keep the engine alive
                log.exception("engine command failed")
                if not fut.done():
                    fut.set_exception(EngineError(f"internal engine error: {e!r}"))

        self._submit(guarded)
        return fut

    def _check_logits(self, param: str) -> None:
        if not self.computes_logits:
            raise BadSamplingParams(f"engine {self.name!r} computes no logits (a simulated engine): {param} is not "
                                    "available", param=param)

    def check_tokens(self, token_ids: list[int]) -> list[int]:
        """``token_ids`` as a list; InvalidRequestError (400, param token_ids) for an id outside the vocabulary."""
        vocab = self.tokenizer.vocab_size
        toks = list(token_ids)
        for t in toks:
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {vocab})", param="token_ids")
        return toks

    def _new_op(self, fut: ResultFuture, kind: OpKind, ctx: Context, **kw) -> Op:
        op = Op(kind, ctx, arrival=self.clock(), **kw)
        if kind is OpKind.FILL:
            ctx.turn_arrival = op.arrival
        else:
            op.turn_arrival, ctx.turn_arrival = ctx.turn_arrival, None
        op.on_done = lambda o, err: self._resolve(fut, o, err)
        return op

    def _get_or_fork(self, context_id: str, parent_id: str | None) -> Context:
        ctx = self.contexts.get(context_id)
        if ctx is not None:
            if parent_id is not None and parent_id != ctx.parent_id:
                raise ContextExists(
                    f"context {context_id!r} exists with parent {ctx.parent_id!r}, not {parent_id!r}", param="context_id"
                )
            self._resume(context_id, free=False)  # an op on a paused context: it is the caller's again
            return ctx
        if parent_id is None:
            ctx = Context(context_id, None, last_used=self.clock())
        else:
            parent = self.contexts.get(parent_id)
            if parent is None:
                raise UnknownContext(f"unknown parent context {parent_id!r}", param="parent_context_id")
            ctx = self._fork(context_id, parent)
            self._resume(parent_id, free=True)  # a fork of a paused context continues it
        self.contexts[context_id] = ctx
        return ctx

    # ---- tool pauses (owner) -------------------------------------------------------------------------------------
    def _resume(self, context_id: str, *, free: bool) -> None:
        """Drop the pause of ``context_id`` if it is paused; ``free``: also free the paused context (it was the
        engine's since the pause; its shared and cached blocks stay with their other holders)."""
        if self.scheduler.unpause(context_id, self.clock(), reason="resumed") is None or not free:
            return
        self._drop_paused(context_id)

    def _drop_paused(self, context_id: str) -> None:
        ctx = self.contexts.pop(context_id, None)
        if ctx is not None:
            ctx.freed = True
            self.scheduler.forget(ctx)
            self.kv.free(ctx)
            ctx.last_hidden = None

    def _resume_covered(self) -> None:
        for ctx, paused_id in self.kv.covered():
            if paused_id != ctx.id and self.scheduler.pauses.get(paused_id) is not None:
                self._resume(paused_id, free=True)

    def expire_pauses(self) -> int:
        """Owner: free the paused contexts whose TTL has passed; returns how many."""
        pauses = self.scheduler.pauses
        if not len(pauses):
            return 0
        now = self.clock()
        expired = pauses.expired(now)
        for p in expired:
            log.info("paused context %s (tool %r) expired after %.1f s", p.ctx.id, p.tool.name, now - p.started)
            self.scheduler.unpause(p.ctx.id, now, reason="expired")
            self._drop_paused(p.ctx.id)
        return len(expired)

    def _fork(self, context_id: str, parent: Context) -> Context:
        """Child shares the parent's full computed blocks (incref); the partial tail is recomputed by the child."""
        now = self.clock()
        child = Context(context_id, parent.id, tokens=list(parent.tokens), last_used=now,
                        turn_arrival=parent.turn_arrival)
        self.kv.fork(parent, child)
        if child.num_computed == len(child.tokens):
            child.last_hidden = parent.last_hidden
        parent.last_used = now
        return child

    def _enqueue(self, op: Op) -> None:
        ctx = op.ctx
        if ctx.active is None:
            self._start(op)
        else:
            ctx.pending.append(op)  # QUEUED (a new op's status) behind the active op

    def _start(self, op: Op) -> None:
        ctx = op.ctx
        ctx.active = op
        op.prompt_len = len(ctx.tokens)
        if op.kind is OpKind.FILL:
            if len(ctx.tokens) + len(op.new_tokens) > self.max_model_len:
                self._complete(op, ContextLengthExceeded(
                    f"context {ctx.id!r} would hold {len(ctx.tokens) + len(op.new_tokens)} tokens; "
                    f"the model's window is {self.max_model_len}", param="token_ids"))
                return
            op.num_cached = 0
            ctx.tokens.extend(op.new_tokens)
            if op.new_tokens:
                ctx.last_hidden = None  # it was the previous last token's
            if op.prompt_logprobs is not None:
                self._start_prompt_logprobs(op)
            if ctx.num_uncomputed == 0:  # nothing to compute (empty fill)
                self._complete(op, None)
                return
        else:
            if not ctx.tokens:
                self._complete(op, InvalidRequestError(f"context {ctx.id!r} is empty: fill it before generating",
                                                       param="context_id"))
                return
            if len(ctx.tokens) >= self.max_model_len:
                self._complete(op, ContextLengthExceeded(
                    f"context {ctx.id!r} already holds {len(ctx.tokens)} tokens = the model's window", param="context_id"))
                return
            op.decoder = self.tokenizer.incremental_decoder(
                skip_special_tokens=op.sampling.skip_special_tokens)
            op.stopper = StopChecker(op.sampling) if op.sampling.stop else None  # None: the text is the pieces
            if op.sampling.constraint is not None:
                try:
                    op.guide = self.grammars.guide(op.sampling.constraint)
                except BadSamplingParams as e:
                    self._complete(op, e)
                    return
        self.scheduler.add(op)

    def _start_prompt_logprobs(self, op: Op) -> None:
        """A prompt-logprob fill: take what the cache knows; if the context was computed up to the fill, recompute
        its last token (the logits there predict the first filled token), unless the cache knows that one."""
        ctx, start = op.ctx, op.prompt_len
        op.prompt_lp = [None] * len(op.new_tokens)
        self.prompt_lp_cache.serve(op)
        if (op.new_tokens and start >= 1 and not is_known(op, start) and ctx.num_computed == start
                and len(ctx.block_table) == self.pool.blocks_for(start)):
            self.kv.uncompute_tail(ctx)

    def _complete(self, op: Op, err: BaseException | None, *, start_next: bool = True) -> None:
        op.set_status(OpStatus.FAILED if err is not None else OpStatus.FINISHED)
        ctx = op.ctx
        if ctx.active is op:
            ctx.active = None
        ctx.last_used = self.clock()
        if op.on_done is not None:
            try:
                op.on_done(op, err)
            except Exception:
                log.exception("op completion callback failed")
        if start_next and not ctx.freed:
            while ctx.active is None and ctx.pending:
                self._start(ctx.pending.popleft())
            if ctx.active is None:
                self.scheduler.park(ctx)

    # ---- steps (owner) ---------------------------------------------------------------------------------------
    def step(self) -> None:
        """One iteration, run synchronously by the runner."""
        plan = self.next_plan()
        if plan is not None:
            self.apply(self.runner.execute(plan))

    def next_plan(self) -> BatchPlan | None:
        """The scheduler's plan for the next iteration; None if nothing can run now (no work, or waiting work
        that cannot be admitted until a command changes something). An op whose context needs more KV than the
        whole pool fails here with ContextLengthExceeded."""
        self.expire_pauses()
        while True:
            try:
                plan = self.scheduler.schedule()
            except TooLargeForPool as e:
                self.scheduler.remove(e.op)
                self._complete(e.op, ContextLengthExceeded(str(e), param="kv_cache"))
                continue
            self._resume_covered()
            if not plan.chunks:
                return None
            rows, ctx_tokens, prefill = plan_counts(plan)
            # an iteration that only samples stored hidden states runs no forward pass: not a step to learn from
            self._plan_started = (self.clock(), rows, ctx_tokens, prefill) if ctx_tokens or prefill else None
            return plan

    def apply(self, out: StepOutput) -> None:
        """Account an executed plan: computed tokens (registering newly full blocks in the prefix cache), stored
        hidden states, finished fills, sampled tokens."""
        self.num_steps += 1
        if self._plan_started is not None:
            t0, rows, ctx_tokens, prefill = self._plan_started
            self._plan_started = None
            seconds = self.clock() - t0
            self.step_stats.add(rows, ctx_tokens, prefill, seconds)
            self.scheduler.observe_step(seconds)
        self.kv.copies_done()
        for ctx, n in out.computed:
            self.kv.mark_computed(ctx, n)
            self.num_tokens_computed += n
        self._resume_covered()
        for ctx, h in out.last_hidden:
            ctx.last_hidden = h
        for op, pos, raw in out.prompt_logprobs:
            op.prompt_lp[pos - op.prompt_len] = raw
        now = self.clock()
        for op in list(self.scheduler.running):
            if op.kind is OpKind.FILL and op.ctx.num_uncomputed == 0:
                self.scheduler.remove(op)
                if wants_prompt_logprobs(op):
                    self.prompt_lp_cache.store(op)
                self.num_fill_tokens += len(op.new_tokens)
                self.num_fill_cached_tokens += min(op.num_cached, len(op.new_tokens))
                self._complete(op, None)
        token_lps = {id(op): raw for op, raw in out.token_logprobs}
        for op, tok in out.sampled:
            if op.first_token_time is None:
                op.first_token_time = now
            self._on_token(op, tok, token_lps.get(id(op)))

    def _on_token(self, op: Op, tok: int, raw: RawLogprobs | None = None) -> None:
        ctx = op.ctx
        sp = op.sampling
        op.output_ids.append(tok)
        ctx.tokens.append(tok)
        ctx.last_hidden = None
        guide = op.guide
        if guide is not None:
            guide.consume(tok)
        # under a constraint EOS is the grammar's end, even with ignore_eos
        is_eos = tok in self.eos_token_ids and (not sp.ignore_eos or guide is not None)
        is_stop_tok = tok in sp.stop_token_ids
        piece = "" if (is_eos or is_stop_tok) else op.decoder.push(tok)
        n = len(op.output_ids)
        stopper = op.stopper
        if stopper is None:  # no stop strings: nothing is held back
            emit_text, finish = piece, None
            op.output_text += piece
        else:
            emit_text, finish = stopper.push(piece, n)
        if finish is None and (is_eos or is_stop_tok) and n >= sp.min_tokens:
            finish = FinishReason.STOP
        if finish is None and guide is not None and guide.complete:
            finish = FinishReason.STOP
        if finish is None and (n >= sp.max_tokens or len(ctx.tokens) >= self.max_model_len):
            finish = FinishReason.LENGTH
        if stopper is not None:
            if finish is not None:
                emit_text += stopper.flush()  # held-back text that did not become a stop string
            op.output_text = stopper.text
        lps: tuple[PositionLogprobs, ...] = ()
        if sp.logprobs is not None:
            if raw is None:
                raise AssertionError(f"op {op.seq_no}: the runner computed no logprobs for a token that asked")
            lps = (self._labels.position(raw),)
            op.logprobs.extend(lps)
        if op.on_chunk is not None:
            try:
                op.on_chunk(GenerateChunk((tok,), emit_text, finish, lps))
            except Exception:
                log.exception("stream callback failed")
        if finish is not None:
            op.finish_reason = finish
            self.scheduler.remove(op)
            self._learn_output(op)
            self._complete(op, None)

    def _learn_output(self, op: Op) -> None:
        """A finished generate: its length feeds the mean output length (LAMPS' fallback prediction); its
        predicted tool handling waits on the context for the pause."""
        self.num_generates_finished += 1
        w = max(0.01, 1.0 / self.num_generates_finished)  # a running mean, then an EMA over ~100 generates
        sch = self.scheduler
        sch.mean_output_tokens += w * (len(op.output_ids) - sch.mean_output_tokens)
        op.ctx.tool_handling = op.handling

    def fail_all(self, err: ParrotError) -> None:
        """Fail every scheduled op (after an internal error in a step) and drop their contexts' KV."""
        for op in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.remove(op)
            self.kv.free(op.ctx)
            self._complete(op, err)

    # ---- results -----------------------------------------------------------------------------------------------
    def _resolve(self, fut: ResultFuture, op: Op, err: BaseException | None) -> None:
        try:
            self._settle_op(fut, op, err)
        except Exception as e:  # a bug building the result: the caller gets an error, never a hang
            log.exception("building the result of op %d failed", op.seq_no)
            if not fut.done():
                fut.set_exception(EngineError(f"internal engine error: {e!r}"))

    def _settle_op(self, fut: ResultFuture, op: Op, err: BaseException | None) -> None:
        if fut.done():  # the caller gave up (a cancelled wait)
            return
        if err is not None:
            fut.set_exception(err)
        elif op.kind is OpKind.FILL:
            prompt_lps: tuple[PositionLogprobs | None, ...] = ()
            if op.prompt_logprobs is not None:
                missing = [op.prompt_len + i for i, r in enumerate(op.prompt_lp) if r is None and op.prompt_len + i]
                if missing:  # a bug: the walk of kv_cache.prompt_logprobs skipped logits somewhere
                    fut.set_exception(EngineError(f"internal engine error: no prompt logprobs at positions "
                                                  f"{missing[:8]} of context {op.ctx.id!r}"))
                    return
                prompt_lps = tuple(None if r is None else self._labels.position(r) for r in op.prompt_lp)
            fut.set_result(FillResult(op.ctx.id, len(op.new_tokens), len(op.ctx.tokens), op.num_cached, prompt_lps))
        else:
            now = self.clock()
            ttft = (op.first_token_time - op.arrival) if op.first_token_time else now - op.arrival
            fut.set_result(GenerateResult(op.ctx.id, tuple(op.output_ids), op.output_text,
                                          op.finish_reason or FinishReason.ABORT, op.prompt_len, ttft,
                                          now - op.arrival, tuple(op.logprobs),
                                          None if op.guide is None else op.guide.complete))

    def refresh_status(self) -> None:
        """Owner: take the snapshot :meth:`status` answers (with ``cached_status``)."""
        if self._cached_status:
            self._status = self.snapshot()

    def _host_status(self) -> dict:
        """The swap space: blocks held / slots, blocks ever copied in, served back, evicted."""
        host = self.kv.host
        if host is None:
            return {"blocks": 0, "capacity": 0}
        return {"blocks": host.num_used, "capacity": host.num_slots, "stored": host.num_stored,
                "hits": host.num_hits, "evicted": host.num_evicted}

    def snapshot(self) -> EngineStatus:
        sch = self.scheduler
        return EngineStatus(
            name=self.name, model=self.model_name, max_model_len=self.max_model_len,
            num_running=len(sch.running), num_waiting=len(sch.waiting),
            running_tokens=sum(len(o.ctx.tokens) for o in sch.running),
            waiting_tokens=sum(len(o.ctx.tokens) for o in sch.waiting),
            kv_blocks_total=self.pool.num_blocks, kv_blocks_used=self.pool.num_used,
            kv_blocks_shared=self.pool.num_shared, kv_blocks_cached=self.pool.num_cached, block_size=self.pool.block_size,
            num_contexts=len(self.contexts), num_preempted_total=sch.num_preemptions,
            extra={"steps": self.num_steps, "tokens_computed": self.num_tokens_computed,
                   "ops_aborted": self.num_ops_aborted,
                   "prefix_cache_hit_blocks": self.pool.num_hit_blocks,
                   "prefix_cache_query_tokens": self.num_fill_tokens,
                   "prefix_cache_hit_tokens": self.num_fill_cached_tokens,
                   "prompt_logprob_cache_hits": self.prompt_lp_cache.num_hit_positions,
                   "shared_prefix_decode_rows": self.runner.num_shared_prefix_rows,
                   "pinned_blocks": self.pool.num_pinned, "kv_blocks_evicted": self.pool.num_evicted,
                   # eviction notices for the global scheduler's prefix tree (Preble §4.3; parrot.manager.policies.e2)
                   "kv_evicted": {"seq": self.pool.num_evicted, "hashes": list(self.pool.evicted_log)},
                   "token_cap": sch.token_cap, "step_stats": self.step_stats.to_wire(),
                   "step_budget": sch.step_budget.to_wire(),
                   "engine_policy": sch.policy.name,
                   "tool_pauses": sch.pauses.to_wire(), "host_store": self._host_status(),
                   "capabilities": dict(self._capabilities),
                   **({"numerics": self.numerics} if self.numerics else {})},
        )


def plan_counts(plan: BatchPlan) -> tuple[int, int, int]:
    """(decode rows, context tokens those rows read, prefill tokens) of a plan: the features of
    :class:`~parrot.common.step_cost.StepStats`. A decode row computes the last token of its context and samples
    after it; a chunk of no tokens only samples from a stored hidden state (a row without a forward of its own)."""
    rows = ctx_tokens = prefill = 0
    for ch in plan.chunks:
        if ch.num_tokens == 0:
            rows += ch.sample
        elif ch.num_tokens == 1 and ch.sample and ch.start == len(ch.op.ctx.tokens) - 1:
            rows += 1
            ctx_tokens += ch.start + 1
        else:
            prefill += ch.num_tokens
    return rows, ctx_tokens, prefill


def _settle(fut: ResultFuture, value: object) -> None:
    if not fut.done():  # the caller may have cancelled its wait
        fut.set_result(value)
