"""Iteration-level scheduler: continuous batching with chunked prefill over a paged KV pool. No torch.

Every iteration it builds a :class:`BatchPlan` under two budgets, ``max_batch_tokens`` (tokens pushed through
the model) and ``max_num_seqs`` (running ops):

    plan = [ decode ops (1 token each) | running prefills (chunks) | newly admitted ops (chunks) ]

(``chunked_prefill=False`` instead gives vLLM's scheduler before chunked prefill, for the simulator's 2023 baselines:
while prompts wait and fit, an iteration is whole prompts only and the decodes wait; :meth:`Scheduler._prefill_step`.)

Ops with a per-token target (``OpHint.tpot_s``, latency work) come first in each group after the decodes, and
while one is in the iteration the prompt chunks of the others (throughput work sharing the engine) are limited to
the step budget's allowance, learned from measured step times (:mod:`parrot.engine.scheduler.step_budget`):

    plan = [ decodes | target ops' prefills + admissions | the rest's prefills + admissions <= allowance ]

Order of service: running ops first (decodes before prefill chunks, each group by :func:`service_key`), then
admission of waiting ops in the engine policy's order (:mod:`parrot.engine.scheduler.policies`: FCFS, Preble's
priority groups, LAMPS' ranking, ...; the policy reads the scheduler through a read-only :class:`SchedulerView`).
Admission also respects ``token_cap`` (the global scheduler's placement hint, see ``EngineClient.set_token_cap``):
while anything runs, a waiting op is admitted only if the running ops' contexts plus its own stay within the cap.
KV blocks are allocated for exactly the tokens scheduled. When the pool is short it first evicts the KV of idle contexts (least recently used), then preempts the most recently
arrived running op (its context's KV is dropped and recomputed later: "recompute" preemption). A waiting op
never preempts a running one. The pool is never over-committed and KV is never shared while writable.

The scheduler chooses *whose* KV to allocate, match, evict or drop; its :class:`KVManager` does it (the one writer
of block tables and computed prefixes) and hands back frozen records. The engine core shares that manager.

Tool calls (LAMPS / INFERCEPT; :mod:`parrot.engine.scheduler.tool_handling`): a context paused while its tool
runs is held here (:meth:`Scheduler.pause`, a :class:`~parrot.engine.kv_cache.tool_pauses.PauseTable`) with the
handling the engine policy picks (when the op before the pause was queued, or at the pause; a swap without a host
store becomes a discard). Under KV pressure, after the idle contexts, preserved pauses are demoted (to swap if the
host store has room, else discard) before the KV of waiting ops and before any running op is preempted. A plan
carries the host<->pool copies planned since the previous one (``BatchPlan.copies``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from parrot.engine.runtime.context import Context, Op, OpStatus
from parrot.protocol.interface import ToolHint
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.kv_cache.host_store import HostStore
from parrot.engine.kv_cache.manager import NO_COPIES, KVCopies, KVManager
from parrot.engine.kv_cache.tool_pauses import PausedContext, PauseTable
from parrot.engine.scheduler.policies.base import EnginePolicy
from parrot.engine.scheduler.policies.fcfs import FcfsPreserve
from parrot.engine.scheduler.step_budget import MIN_TOKENS, StepBudget
from parrot.engine.scheduler.tool_handling import FixedCosts, Handling, ToolCosts

DEFAULT_OUTPUT_TOKENS = 64  # a generate's predicted output before the engine has seen any finish
# ToolCosts before the engine core installs its measured ones (a small model on one CPU core)
DEFAULT_COSTS = FixedCosts(fwd_per_token_s=1e-3, swap_per_token_s=2e-6, decode_step_s=0.03)


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
    copies: KVCopies = NO_COPIES  # host<->pool block copies the runner performs before the forward

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class TooLargeForPool(Exception):
    """An op needs more KV blocks than the whole pool has; it can never run."""

    def __init__(self, op: Op, needed: int, total: int) -> None:
        super().__init__(f"context of {len(op.ctx.tokens)} tokens needs {needed} KV blocks; the pool has {total}")
        self.op = op


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_batch_tokens: int, *,
                 policy: EnginePolicy | None = None, host: HostStore | None = None,
                 chunked_prefill: bool = True) -> None:
        """``policy``: the admission order and the handling of paused contexts, this scheduler's own (None: FCFS,
        every pause preserved: ``fcfs``); ``host``: the swap space (None: no swapping; swap choices become
        discard); ``chunked_prefill=False``: the 2023 scheduler of vLLM (the Parrot paper's baselines), see
        :meth:`_prefill_step`."""
        self.policy: EnginePolicy = policy if policy is not None else FcfsPreserve("fcfs")
        self.view = SchedulerView(self)  # what the policy reads
        self.kv = KVManager(pool, host)
        self.pauses = PauseTable()
        self.costs: ToolCosts = DEFAULT_COSTS  # the engine core installs its measured ones
        self.mean_output_tokens: float = DEFAULT_OUTPUT_TOKENS  # the core keeps it current (finished generates)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: list[Op] = []  # kept sorted by service_key: (priority, arrival, seq_no)
        self.running: list[Op] = []
        self.idle_contexts: dict[str, Context] = {}  # contexts holding KV with no op (eviction candidates)
        self.num_preemptions = 0
        self.token_cap: int | None = None  # max tokens in running ops' contexts when admitting (None = no cap)
        self.chunked_prefill = chunked_prefill
        # tokens ops without a per-token target may add to an iteration carrying ops with one (step_budget.py)
        self.step_budget = StepBudget(max_batch_tokens, min_tokens=min(MIN_TOKENS, max_batch_tokens))
        self._planned_target: float | None = None  # the strictest target in the last plan (observe_step)

    # ---- queue management (called by the engine loop) -----------------------------------------------------
    def add(self, op: Op) -> None:
        op.set_status(OpStatus.WAITING)
        self.idle_contexts.pop(op.ctx.id, None)
        if op.hint is not None and op.hint.tool is not None and op.handling is None:
            op.handling = self.policy.handling_when_queued(op, self.view)
        self.waiting.append(op)
        self.waiting.sort(key=service_key)

    def remove(self, op: Op) -> None:
        """Take a finished/aborted op out of the queues (its context stays; see :meth:`park`)."""
        if op in self.running:
            self.running.remove(op)
        elif op in self.waiting:
            self.waiting.remove(op)
        self.policy.forget(op)

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
        demote preserved pauses (latest deadline first), then drop the KV of contexts whose op is still waiting
        (youngest first; they recompute when admitted)."""
        for ctx in sorted(self.idle_contexts.values(), key=lambda c: c.last_used):
            if self.kv.pool.num_free >= need_blocks:
                return
            self.kv.free(ctx)
            del self.idle_contexts[ctx.id]
        for p in self.pauses.preserved():
            if self.kv.pool.num_free >= need_blocks:
                return
            self._demote(p)
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
        self.waiting.sort(key=service_key)

    # ---- planning ------------------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        """Build the next iteration. Raises TooLargeForPool for an op that can never fit (caller fails it)."""
        self._planned_target = None
        if not self.chunked_prefill and (plan := self._prefill_step()) is not None:
            return plan
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        preempted: list[Op] = []

        # decodes first, then the prompt chunks of ops with a per-token target (their admissions too), then the
        # rest's, within the step budget's allowance while an op with a target is in the iteration
        decodes = [o for o in self.running if o.ctx.num_uncomputed <= 1]
        prefills = sorted((o for o in self.running if o.ctx.num_uncomputed > 1), key=service_key)
        targeted = [o for o in prefills if tpot_target(o) is not None]
        for op in sorted(decodes, key=service_key) + targeted:
            budget -= self._plan_running(op, budget, chunks, preempted)
        admitted: list[Op] = []
        blocked, order = False, None
        if any(tpot_target(o) is not None for o in self.waiting):  # their admissions come before the rest's chunks
            order = self._order(budget)
            blocked, budget = self._admit_in_order([o for o in order if tpot_target(o) is not None], budget, chunks,
                                                   preempted, admitted)
        targets = [t for t in (tpot_target(c.op) for c in chunks) if t is not None]
        self._planned_target = min(targets) if targets else None
        rest = budget if self._planned_target is None else min(budget, self.step_budget.allowance)
        for op in prefills:
            if op not in targeted:
                rest -= self._plan_running(op, rest, chunks, preempted)
        if not blocked:
            order = self._order(rest) if order is None else order
            self._admit_in_order([o for o in order if tpot_target(o) is None], rest, chunks, preempted, admitted)
        if admitted or self.waiting:
            self.policy.after_admission(admitted, self.waiting)
        # an op planned early in this iteration may have been preempted by an older one later on
        planned = tuple(c for c in chunks if c.op.status is OpStatus.RUNNING and c.op in self.running)
        # copies wait for a plan that runs (an empty plan is not executed)
        return BatchPlan(planned, tuple(preempted), self.kv.take_copies() if planned else NO_COPIES)

    def _order(self, budget: int) -> list[Op]:
        """The engine policy's admission order of the waiting ops, if any can be admitted with ``budget``."""
        if self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            return self.policy.order(self.view)
        return []

    def _plan_running(self, op: Op, budget: int, chunks: list[Chunk], preempted: list[Op]) -> int:
        """Plan running ``op``'s next chunk within ``budget`` (appended to ``chunks``); the tokens it takes."""
        if op not in self.running:  # preempted earlier in this iteration
            return 0
        chunk = self._plan_op(op, budget, may_preempt=True, preempted=preempted)
        if chunk is None:
            return 0
        chunks.append(chunk)
        return chunk.num_tokens

    def _admit_in_order(self, order: Sequence[Op], budget: int, chunks: list[Chunk], preempted: list[Op],
                        admitted: list[Op]) -> tuple[bool, int]:
        """Admit waiting ops of ``order`` (the policy's) while ``budget`` lasts; (whether one had to wait -- FCFS:
        the ops behind it wait too --, the budget left)."""
        running_tokens = sum(len(o.ctx.tokens) for o in self.running)
        for op in order:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return False, budget
            if op in preempted:  # do not re-admit in the same iteration it was preempted
                return True, budget
            chunk = self._admit(op, budget, running_tokens, preempted)
            if chunk is None:
                return True, budget  # FCFS: the head waits (cap or memory), and the ops behind it
            admitted.append(op)
            running_tokens += len(op.ctx.tokens)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return False, budget

    def observe_step(self, seconds: float) -> None:
        """The last planned iteration ran in ``seconds`` (measured by the engine core): the step budget learns
        from it if it carried an op with a per-token target."""
        if self._planned_target is not None:
            self.step_budget.observe(seconds, self._planned_target)

    def _prefill_step(self) -> BatchPlan | None:
        """Without chunked prefill (vLLM before 2024, the Parrot paper's baselines): while prompts wait and can be
        admitted, an iteration prefills whole prompts only, as many as fit in ``max_batch_tokens``, and the running
        decodes wait for it; None when nothing can be admitted (then :meth:`schedule` plans the decodes as ever).
        A prompt longer than the budget is admitted alone and chunked, as the chunked scheduler would."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return None
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        preempted: list[Op] = []
        admitted: list[Op] = []
        running_tokens = sum(len(o.ctx.tokens) for o in self.running)
        for op in self.policy.order(self.view):
            if len(self.running) >= self.max_num_seqs:
                break
            if chunks and len(op.ctx.tokens) - self.cached_tokens(op) > budget:
                break  # the whole prompt, or the next iteration
            chunk = self._admit(op, budget, running_tokens, preempted)
            if chunk is None:
                break
            admitted.append(op)
            running_tokens += len(op.ctx.tokens)
            chunks.append(chunk)
            budget -= chunk.num_tokens
            if budget <= 0:
                break
        if not chunks:  # nothing admitted: schedule() plans this iteration (and the policy's bookkeeping)
            return None
        self.policy.after_admission(admitted, self.waiting)
        return BatchPlan(tuple(chunks), (), self.kv.take_copies())

    def _admit(self, op: Op, budget: int, running_tokens: int, preempted: list[Op]) -> Chunk | None:
        """Move waiting ``op`` to running with up to ``budget`` tokens of it planned in this iteration; None if it
        must wait: the placement's token cap (``running_tokens``: the running ops' contexts) or memory. Raises
        TooLargeForPool for an op the whole pool cannot hold."""
        if self.token_cap is not None and self.running and running_tokens + len(op.ctx.tokens) > self.token_cap:
            return None  # under the placement's cap: it waits for running ops to finish
        needed = self.kv.pool.blocks_for(len(op.ctx.tokens) + 1)
        if needed > self.kv.pool.capacity:
            raise TooLargeForPool(op, needed, self.kv.pool.capacity)
        chunk = self._plan_op(op, budget, may_preempt=False, preempted=preempted)
        if chunk is None:
            return None
        self.waiting.remove(op)
        op.set_status(OpStatus.RUNNING)
        self.running.append(op)
        return chunk

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
            # Preempt the youngest running op of the lowest priority; older (or more urgent) work is never
            # preempted for younger work, so if ``op`` itself is the last in service order it gives up its own KV
            # and waits.
            others = [o for o in self.running if o is not op]
            youngest = max(others, key=service_key, default=None)
            if youngest is None or service_key(youngest) < service_key(op):
                if op in self.running:
                    self._preempt(op)
                    preempted.append(op)
                return None
            self._preempt(youngest)
            preempted.append(youngest)
        reaches_end = ctx.num_computed + n == len(ctx.tokens)
        return Chunk(op, ctx.num_computed, n, sample=op.is_generate and reaches_end)

    # ---- tool pauses -------------------------------------------------------------------------------------------
    def _allowed(self) -> tuple[Handling, ...]:
        return tuple(Handling) if self.kv.host is not None else (Handling.PRESERVE, Handling.DISCARD)

    def _running_tokens(self, exclude: Context | None = None) -> int:
        return sum(len(o.ctx.tokens) for o in self.running if o.ctx is not exclude)

    def pause(self, ctx: Context, tool: ToolHint, *, now: float, ttl_s: float,
              predicted: Handling | None = None) -> PausedContext:
        """Hold ``ctx`` (no active op) while ``tool`` runs, with the policy's handling (``predicted``: the one its
        last generate was queued with); one this engine cannot do (swap without a host store) becomes discard. Its
        KV is kept, swapped out (copies planned) or dropped."""
        self.idle_contexts.pop(ctx.id, None)
        handling = self.policy.handling_at_pause(ctx, tool, predicted, self.view)
        if handling not in self._allowed():
            handling = Handling.DISCARD
        n_tokens, bs = len(ctx.tokens), self.kv.block_size
        if handling is Handling.PRESERVE:
            n_blocks = len(ctx.block_table)
        elif handling is Handling.SWAP:
            n_blocks = self.kv.swap_out(ctx)
        else:
            n_blocks = len(ctx.block_table)
            self.kv.free(ctx)
        n_full = n_tokens // bs
        key = ctx.block_hashes(n_full, bs)[-1] if n_full else None
        p = PausedContext(ctx, tool, handling, now, now + ttl_s, n_tokens, n_blocks, key)
        self.pauses.add(p)
        if key is not None:
            self.kv.pause_keys.setdefault(key, []).append(ctx.id)
        return p

    def unpause(self, context_id: str, now: float, *, reason: str) -> PausedContext | None:
        """Drop the pause record of ``context_id`` (``reason``: "resumed", "expired" or "freed"); its context is the
        caller's to keep or free. None if it is not paused."""
        p = self.pauses.pop(context_id, now, resumed=reason == "resumed")
        if p is None:
            return None
        ids = self.kv.pause_keys.get(p.key) if p.key is not None else None
        if ids is not None and context_id in ids:
            ids.remove(context_id)
            if not ids:
                del self.kv.pause_keys[p.key]
        if reason == "expired":
            self.pauses.num_expired += 1
        return p

    def _demote(self, p: PausedContext) -> None:
        """KV pressure: a preserved pause gives up its blocks (swap if the host store has room, else discard)."""
        if self.kv.host_room(p.ctx):
            p.num_blocks = self.kv.swap_out(p.ctx)
            p.handling = Handling.SWAP
        else:
            p.num_blocks = len(p.ctx.block_table)
            self.kv.free(p.ctx)
            p.handling = Handling.DISCARD
        self.pauses.num_demoted += 1


class SchedulerView:
    """The read-only :class:`~parrot.engine.scheduler.policies.base.EngineView` of a scheduler its policy reads."""

    __slots__ = ("_s",)

    def __init__(self, scheduler: Scheduler) -> None:
        self._s = scheduler

    @property
    def waiting(self) -> Sequence[Op]:
        return tuple(self._s.waiting)

    @property
    def running(self) -> Sequence[Op]:
        return tuple(self._s.running)

    @property
    def costs(self) -> ToolCosts:
        return self._s.costs

    @property
    def mean_output_tokens(self) -> float:
        return self._s.mean_output_tokens

    @property
    def allowed_handlings(self) -> tuple[Handling, ...]:
        return self._s._allowed()

    def cached_tokens(self, op: Op) -> int:
        return self._s.cached_tokens(op)

    def running_tokens(self, exclude: Context | None = None) -> int:
        return self._s._running_tokens(exclude)

    def expected_tool_s(self, tool: ToolHint) -> float:
        return self._s.pauses.expected_s(tool)


def tpot_target(op: Op) -> float | None:
    """``op``'s per-output-token target (``OpHint.tpot_s``), or None."""
    return op.hint.tpot_s if op.hint is not None else None


def service_key(op: Op) -> tuple[int, float, int]:
    """The order of service: the request's priority (``OpHint.priority``, vLLM's: lower first; 0 without a hint),
    then FCFS (``Op.sort_key``). Waiting ops are kept in this order, running ops are planned in it, and the last in
    it is preempted first. With every priority 0 it is plain FCFS; the engine policy may admit in another order."""
    return (op.hint.priority if op.hint is not None else 0, *op.sort_key)
