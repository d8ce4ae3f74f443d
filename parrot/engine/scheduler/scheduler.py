"""Iteration-level scheduler: continuous batching with chunked prefill over a paged KV pool. No torch.

Every iteration it builds a :class:`BatchPlan` under two budgets, ``max_batch_tokens`` (tokens pushed through
the model) and ``max_num_seqs`` (running ops):

    plan = [ decode ops (1 token each) | running prefills (chunks) | newly admitted ops (chunks) ]

Order of service: running ops first (decodes before prefill chunks, each group by arrival), then admission
of waiting ops in the local policy's order (:mod:`parrot.engine.scheduler.local_policy`: FCFS, or Preble's
priority groups by cached-token ratio). Admission also respects ``token_cap`` (the global scheduler's placement hint,
see ``EngineClient.set_token_cap``): while anything runs, a waiting op is admitted only if the running ops'
contexts plus its own stay within the cap. KV blocks are allocated for exactly the tokens scheduled. When the pool is
short it first evicts the KV of idle contexts (least recently used), then preempts the most recently
arrived running op (its context's KV is dropped and recomputed later: "recompute" preemption). A waiting op
never preempts a running one. The pool is never over-committed and KV is never shared while writable.

The scheduler chooses *whose* KV to allocate, match, evict or drop; its :class:`KVManager` does it (the one writer
of block tables and computed prefixes) and hands back frozen records. The engine core shares that manager.
"""

from __future__ import annotations

from dataclasses import dataclass

from parrot.engine.context import Context, Op, OpStatus
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.kv_cache.manager import KVManager
from parrot.engine.scheduler.local_policy import LOCAL_POLICIES, admission_order


@dataclass(frozen=True)
class Chunk:
    """Compute tokens [start, start + num_tokens) of ``op.ctx``; sample after it iff ``sample``."""

    op: Op
    start: int
    num_tokens: int
    sample: bool


@dataclass(frozen=True)
class BatchPlan:
    chunks: tuple[Chunk, ...]
    preempted: tuple[Op, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class TooLargeForPool(Exception):
    """An op needs more KV blocks than the whole pool has; it can never run."""

    def __init__(self, op: Op, needed: int, total: int) -> None:
        super().__init__(f"context of {len(op.ctx.tokens)} tokens needs {needed} KV blocks; the pool has {total}")
        self.op = op


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_batch_tokens: int, *, local_policy: str = "fcfs",
                 priority_groups: int = 10) -> None:
        if local_policy not in LOCAL_POLICIES:
            raise ValueError(f"local_policy must be one of {LOCAL_POLICIES}, got {local_policy!r}")
        if priority_groups < 1:
            raise ValueError(f"priority_groups must be >= 1, got {priority_groups!r}")
        self.local_policy = local_policy
        self.priority_groups = priority_groups
        self.kv = KVManager(pool)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: list[Op] = []  # kept sorted by (arrival, seq_no)
        self.running: list[Op] = []
        self.idle_contexts: dict[str, Context] = {}  # contexts holding KV with no op (eviction candidates)
        self.num_preemptions = 0
        self.token_cap: int | None = None  # max tokens in running ops' contexts when admitting (None = no cap)

    # ---- queue management (called by the engine loop) -----------------------------------------------------
    def add(self, op: Op) -> None:
        op.set_status(OpStatus.WAITING)
        self.idle_contexts.pop(op.ctx.id, None)
        self.waiting.append(op)
        self.waiting.sort(key=lambda o: o.sort_key)

    def remove(self, op: Op) -> None:
        """Take a finished/aborted op out of the queues (its context stays; see :meth:`park`)."""
        if op in self.running:
            self.running.remove(op)
        elif op in self.waiting:
            self.waiting.remove(op)

    def park(self, ctx: Context) -> None:
        """A context without an active op: its KV may be evicted under pressure."""
        if ctx.block_table and not ctx.freed:
            self.idle_contexts[ctx.id] = ctx

    def forget(self, ctx: Context) -> None:
        self.idle_contexts.pop(ctx.id, None)

    def cached_tokens(self, op: Op) -> int:
        """Tokens of ``op``'s context with KV now: computed, plus the cached blocks admission would take for it
        (what ``KVManager.match_prefix`` takes, match limit included: a prompt-logprob fill may take fewer)."""
        return op.ctx.num_computed + self.kv.block_size * self.kv.prefix_hit_blocks(op.ctx)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _evict(self, need_blocks: int, keep: Context) -> None:
        """Free blocks without touching running ops: drop the KV of idle contexts (least recently used first),
        then of contexts whose op is still waiting (youngest first; they recompute when admitted)."""
        for ctx in sorted(self.idle_contexts.values(), key=lambda c: c.last_used):
            if self.kv.pool.num_free >= need_blocks:
                return
            self.kv.free(ctx)
            del self.idle_contexts[ctx.id]
        for op in reversed(self.waiting):
            if self.kv.pool.num_free >= need_blocks:
                return
            if op.ctx is not keep and op.ctx.block_table:
                self.kv.free(op.ctx)

    def _preempt(self, victim: Op) -> None:
        self.running.remove(victim)
        self.kv.free(victim.ctx)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        victim.set_status(OpStatus.WAITING)
        self.waiting.append(victim)
        self.waiting.sort(key=lambda o: o.sort_key)

    # ---- planning ------------------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        """Build the next iteration. Raises TooLargeForPool for an op that can never fit (caller fails it)."""
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        preempted: list[Op] = []

        decodes = [o for o in self.running if o.ctx.num_uncomputed <= 1]
        prefills = [o for o in self.running if o.ctx.num_uncomputed > 1]
        for op in sorted(decodes, key=lambda o: o.sort_key) + sorted(prefills, key=lambda o: o.sort_key):
            if op not in self.running:  # preempted earlier in this loop
                continue
            chunk = self._plan_op(op, budget, may_preempt=True, preempted=preempted)
            if chunk is None:
                continue
            chunks.append(chunk)
            budget -= chunk.num_tokens

        running_tokens = sum(len(o.ctx.tokens) for o in self.running)
        order = admission_order(self.waiting, self.local_policy, self.priority_groups, self.cached_tokens) \
            if self.waiting and budget > 0 and len(self.running) < self.max_num_seqs else []
        for op in order:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if op in preempted:  # do not re-admit in the same iteration it was preempted
                break
            if self.token_cap is not None and self.running and running_tokens + len(op.ctx.tokens) > self.token_cap:
                break  # FCFS under the placement's cap: the head waits for running ops to finish
            needed = self.kv.pool.blocks_for(len(op.ctx.tokens) + 1)
            if needed > self.kv.pool.capacity:
                raise TooLargeForPool(op, needed, self.kv.pool.capacity)
            chunk = self._plan_op(op, budget, may_preempt=False, preempted=preempted)
            if chunk is None:
                break  # FCFS: the head waits for memory
            self.waiting.remove(op)
            op.set_status(OpStatus.RUNNING)
            self.running.append(op)
            running_tokens += len(op.ctx.tokens)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        # an op planned early in this iteration may have been preempted by an older one later on
        planned = tuple(c for c in chunks if c.op.status is OpStatus.RUNNING and c.op in self.running)
        return BatchPlan(planned, tuple(preempted))

    def _plan_op(self, op: Op, budget: int, *, may_preempt: bool, preempted: list[Op]) -> Chunk | None:
        ctx = op.ctx
        hit = self.kv.match_prefix(ctx)  # cached KV for the context's next full blocks, if any
        if hit.block_ids:
            op.num_cached += len(hit.block_ids) * self.kv.block_size
        if op.is_generate and ctx.num_uncomputed == 0:
            if ctx.last_hidden is not None:
                return Chunk(op, ctx.num_computed, 0, sample=True)  # sample from the stored hidden state
            self.kv.uncompute_tail(ctx)
        remaining = ctx.num_uncomputed
        if remaining == 0:  # a FILL served entirely by the prefix cache: admit it; it completes this step
            return Chunk(op, ctx.num_computed, 0, sample=False)
        n = min(remaining, budget)
        if n <= 0:
            return None
        while self.kv.allocate_slots(ctx, ctx.num_computed + n) is None:
            need = self.kv.blocks_missing(ctx, ctx.num_computed + n)
            self._evict(need, keep=ctx)
            if self.kv.pool.num_free >= need:
                continue
            if not may_preempt:
                return None
            # Preempt the youngest running op; older work is never preempted for younger work, so if ``op``
            # itself is the youngest it gives up its own KV and waits.
            others = [o for o in self.running if o is not op]
            youngest = max(others, key=lambda o: o.sort_key, default=None)
            if youngest is None or youngest.sort_key < op.sort_key:
                if op in self.running:
                    self._preempt(op)
                    preempted.append(op)
                return None
            self._preempt(youngest)
            preempted.append(youngest)
        reaches_end = ctx.num_computed + n == len(ctx.tokens)
        return Chunk(op, ctx.num_computed, n, sample=op.is_generate and reaches_end)
