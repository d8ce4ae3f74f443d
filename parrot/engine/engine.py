"""LLMEngine: the step loop of the builtin engine, on its own thread.

Callers (any thread) enqueue commands; the engine thread is the only writer of contexts, ops, the block pool
and the scheduler. Each loop turn: apply commands -> schedule -> run one forward -> apply results ->
finish ops (results leave through callbacks, which resolve futures / stream queues thread-safely).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

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
from parrot.engine.interface import EngineStatus, FillResult, GenerateResult
from parrot.engine.kv_cache.block_pool import BlockPool, chain_hashes
from parrot.engine.runner import ModelRunner, StepOutput
from parrot.engine.scheduler.scheduler import Scheduler, TooLargeForPool
from parrot.engine.stopping import StopChecker

log = logging.getLogger(__name__)

ChunkCallback = Callable[[list[int], str, FinishReason | None], None]


class LLMEngine:
    def __init__(
        self, *, name: str, model_name: str, runner: ModelRunner, pool: BlockPool, scheduler: Scheduler,
        tokenizer, max_model_len: int,
    ) -> None:
        self.name = name
        self.model_name = model_name
        self.runner = runner
        self.pool = pool
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self.contexts: dict[str, Context] = {}
        self._pins: dict[int, list[int]] = {}  # last chain hash of a pinned prefix -> its pinned blocks
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.num_tokens_computed = 0
        self._status = self._snapshot()

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"parrot-engine-{self.name}", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ---- thread-safe API -------------------------------------------------------------------------------------
    def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None) -> Future:
        fut: Future = Future()
        toks = self._check_tokens(token_ids)

        def cmd() -> None:
            ctx = self._get_or_fork(context_id, parent_context_id)
            op = Op(OpKind.FILL, ctx, new_tokens=toks)
            op.on_done = lambda o, err: self._resolve_fill(fut, o, err)
            self._enqueue(op)

        self._submit(cmd, fut)
        return fut

    def generate(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None,
        on_chunk: ChunkCallback | None = None,
    ) -> Future:
        fut: Future = Future()

        def cmd() -> None:
            ctx = self._get_or_fork(context_id, parent_context_id)
            op = Op(OpKind.GENERATE, ctx, sampling=sampling, on_chunk=on_chunk)
            op.on_done = lambda o, err: self._resolve_generate(fut, o, err)
            self._enqueue(op)

        self._submit(cmd, fut)
        return fut

    def free_context(self, context_id: str) -> Future:
        fut: Future = Future()

        def cmd() -> None:
            ctx = self.contexts.pop(context_id, None)
            if ctx is None:
                raise UnknownContext(f"unknown context {context_id!r}", param="context_id")
            ctx.freed = True
            for op in ([ctx.active] if ctx.active else []) + list(ctx.pending):
                self.scheduler.remove(op)
                op.finish_reason = FinishReason.ABORT
                self._complete(op, EngineError(f"context {context_id!r} was freed") if op.kind is OpKind.FILL else None,
                               start_next=False)
            ctx.pending.clear()
            ctx.active = None
            self.scheduler.forget(ctx)
            Scheduler.drop_kv(self.pool, ctx)
            ctx.last_hidden = None
            self._status = self._snapshot()  # callers read status right after a free
            fut.set_result(None)

        self._submit(cmd, fut)
        return fut

    def set_token_cap(self, max_running_tokens: int | None) -> Future:
        """The global scheduler's cap on running tokens (see Scheduler.token_cap); applied between steps."""
        if max_running_tokens is not None and (not isinstance(max_running_tokens, int) or max_running_tokens < 1):
            raise InvalidRequestError(f"max_running_tokens must be a positive integer or null, got "
                                      f"{max_running_tokens!r}", param="max_running_tokens")
        fut: Future = Future()

        def cmd() -> None:
            self.scheduler.token_cap = max_running_tokens
            self._status = self._snapshot()
            fut.set_result(None)

        self._submit(cmd, fut)
        return fut

    def pin_prefix(self, token_ids: list[int], pinned: bool = True) -> Future:
        """Pin (or unpin) the cached KV of a hot token prefix: its full blocks hold one extra reference, so
        LRU eviction never drops them. Only blocks already cached or in use are pinned (fill the prefix first);
        the result is the number of blocks now pinned for this prefix."""
        fut: Future = Future()
        toks = self._check_tokens(token_ids)

        def cmd() -> None:
            hashes = chain_hashes(toks, self.pool.block_size)
            key = hashes[-1] if hashes else None
            self.pool.unpin(self._pins.pop(key, []) if key is not None else [])
            blocks = self.pool.pin(hashes) if pinned and key is not None else []
            if blocks:
                self._pins[key] = blocks
            self._status = self._snapshot()
            fut.set_result(len(blocks))

        self._submit(cmd, fut)
        return fut

    def status(self) -> EngineStatus:
        return self._status

    # ---- command helpers (engine thread) ---------------------------------------------------------------------
    def _check_tokens(self, token_ids: list[int]) -> list[int]:
        vocab = self.tokenizer.vocab_size
        toks = list(token_ids)
        for t in toks:
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {vocab})", param="token_ids")
        return toks

    def _submit(self, cmd: Callable[[], None], fut: Future) -> None:
        if self._stop.is_set():
            raise EngineError("engine is shut down")

        def guarded() -> None:
            try:
                cmd()
            except ParrotError as e:
                if not fut.done():
                    fut.set_exception(e)
            except Exception as e:  # a bug: report it to the caller, keep the engine alive
                log.exception("engine command failed")
                if not fut.done():
                    fut.set_exception(EngineError(f"internal engine error: {e!r}"))

        self._cmds.put(guarded)

    def _get_or_fork(self, context_id: str, parent_id: str | None) -> Context:
        ctx = self.contexts.get(context_id)
        if ctx is not None:
            if parent_id is not None and parent_id != ctx.parent_id:
                raise ContextExists(
                    f"context {context_id!r} exists with parent {ctx.parent_id!r}, not {parent_id!r}", param="context_id"
                )
            return ctx
        if parent_id is None:
            ctx = Context(context_id, None)
        else:
            parent = self.contexts.get(parent_id)
            if parent is None:
                raise UnknownContext(f"unknown parent context {parent_id!r}", param="parent_context_id")
            ctx = self._fork(context_id, parent)
        self.contexts[context_id] = ctx
        return ctx

    def _fork(self, context_id: str, parent: Context) -> Context:
        """Child shares the parent's full computed blocks (incref); the partial tail is recomputed by the child."""
        bs = self.pool.block_size
        n_share = parent.num_computed // bs
        shared = parent.block_table[:n_share]
        self.pool.incref(shared)
        child = Context(context_id, parent.id, tokens=list(parent.tokens), block_table=list(shared),
                        num_computed=n_share * bs, num_registered=min(n_share, parent.num_registered))
        if child.num_computed == len(child.tokens):
            child.last_hidden = parent.last_hidden
        parent.last_used = time.monotonic()
        return child

    def _enqueue(self, op: Op) -> None:
        ctx = op.ctx
        if ctx.active is None:
            self._start(op)
        else:
            op.status = OpStatus.QUEUED
            ctx.pending.append(op)

    def _start(self, op: Op) -> None:
        ctx = op.ctx
        ctx.active = op
        op.prompt_len = len(ctx.tokens)
        if op.kind is OpKind.FILL:
            if len(ctx.tokens) + len(op.new_tokens) > self.max_model_len:
                raise_err = ContextLengthExceeded(
                    f"context {ctx.id!r} would hold {len(ctx.tokens) + len(op.new_tokens)} tokens; "
                    f"the model's window is {self.max_model_len}", param="token_ids")
                self._complete(op, raise_err)
                return
            op.num_cached = 0
            ctx.tokens.extend(op.new_tokens)
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
            op.decoder = self.tokenizer.incremental_decoder()
            op.stopper = StopChecker(op.sampling)
        self.scheduler.add(op)

    def _complete(self, op: Op, err: BaseException | None, *, start_next: bool = True) -> None:
        op.status = OpStatus.FAILED if err is not None else OpStatus.FINISHED
        ctx = op.ctx
        if ctx.active is op:
            ctx.active = None
        ctx.last_used = time.monotonic()
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

    # ---- the loop --------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                timeout = None if not self.scheduler.has_work() else 0.0
                try:
                    cmd = self._cmds.get(timeout=timeout) if timeout is None else self._cmds.get_nowait()
                    cmd()
                    while True:
                        self._cmds.get_nowait()()
                except queue.Empty:
                    pass
                if self.scheduler.has_work():
                    self._step()
                self._status = self._snapshot()
            except Exception:
                log.exception("engine loop iteration failed; failing running ops")
                self._fail_all(EngineError("internal engine error during a step"))

    def _step(self) -> None:
        try:
            plan = self.scheduler.schedule()
        except TooLargeForPool as e:
            self.scheduler.remove(e.op)
            self._complete(e.op, ContextLengthExceeded(str(e), param="kv_cache"))
            return
        if not plan.chunks:
            return
        out = self.runner.execute(plan)
        self._apply(out)

    def _apply(self, out: StepOutput) -> None:
        self.num_steps += 1
        bs = self.pool.block_size
        for ctx, n in out.computed:
            ctx.num_computed += n
            self.num_tokens_computed += n
            # register newly completed full blocks for the prefix cache
            n_full = ctx.num_computed // bs
            if n_full > ctx.num_registered:
                hashes = ctx.block_hashes(n_full, bs)
                for i in range(ctx.num_registered, n_full):
                    self.pool.register(ctx.block_table[i], hashes[i])
                ctx.num_registered = n_full
        for ctx, h in out.last_hidden:
            ctx.last_hidden = h
        now = time.monotonic()
        for op in list(self.scheduler.running):
            if op.kind is OpKind.FILL and op.ctx.num_uncomputed == 0:
                self.scheduler.remove(op)
                self._complete(op, None)
        for op, tok in out.sampled:
            if op.first_token_time is None:
                op.first_token_time = now
            self._on_token(op, tok)

    def _on_token(self, op: Op, tok: int) -> None:
        ctx = op.ctx
        sp = op.sampling
        op.output_ids.append(tok)
        ctx.tokens.append(tok)
        ctx.last_hidden = None
        is_eos = tok in self.eos_token_ids and not sp.ignore_eos
        is_stop_tok = tok in sp.stop_token_ids
        piece = "" if (is_eos or is_stop_tok) else op.decoder.push(tok)
        emit_text, finish = op.stopper.push(piece, len(op.output_ids))
        n = len(op.output_ids)
        if finish is None and (is_eos or is_stop_tok) and n >= sp.min_tokens:
            finish = FinishReason.STOP
            emit_text += op.stopper.flush()
        if finish is None and (n >= sp.max_tokens or len(ctx.tokens) >= self.max_model_len):
            finish = FinishReason.LENGTH
            emit_text += op.stopper.flush()
        op.output_text = op.stopper.text
        if op.on_chunk is not None:
            try:
                op.on_chunk([tok], emit_text, finish)
            except Exception:
                log.exception("stream callback failed")
        if finish is not None:
            op.finish_reason = finish
            self.scheduler.remove(op)
            self._complete(op, None)

    def _fail_all(self, err: ParrotError) -> None:
        for op in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.remove(op)
            Scheduler.drop_kv(self.pool, op.ctx)
            self._complete(op, err)

    # ---- results ---------------------------------------------------------------------------------------------
    @staticmethod
    def _resolve_fill(fut: Future, op: Op, err: BaseException | None) -> None:
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(FillResult(op.ctx.id, len(op.new_tokens), len(op.ctx.tokens), op.num_cached))

    @staticmethod
    def _resolve_generate(fut: Future, op: Op, err: BaseException | None) -> None:
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
            return
        now = time.monotonic()
        ttft = (op.first_token_time - op.arrival) if op.first_token_time else now - op.arrival
        fut.set_result(GenerateResult(op.ctx.id, tuple(op.output_ids), op.output_text,
                                      op.finish_reason or FinishReason.ABORT, op.prompt_len, ttft, now - op.arrival))

    def _snapshot(self) -> EngineStatus:
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
                   "prefix_cache_hit_blocks": self.pool.num_hit_blocks,
                   "shared_prefix_decode_rows": self.runner.num_shared_prefix_rows,
                   "pinned_blocks": self.pool.num_pinned, "kv_blocks_evicted": self.pool.num_evicted,
                   "token_cap": sch.token_cap},
        )
