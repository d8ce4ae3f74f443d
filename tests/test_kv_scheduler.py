"""Block pool and iteration scheduler (no torch): budgets, chunking, eviction, preemption, invariants."""

import pytest

from parrot.common.sampling import SamplingParams
from parrot.engine.runtime.context import OP_TRANSITIONS, Context, IllegalOpTransition, Op, OpKind, OpStatus
from parrot.engine.kv_cache.block_pool import BlockPool, OutOfBlocks
from parrot.engine.scheduler.scheduler import Scheduler, TooLargeForPool
from status_tables import walk_transitions


def test_pool_allocate_release_refcount():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert pool.num_free == 1 and len(set(a)) == 3
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free == 1  # nothing allocated on failure
    pool.incref(a[:2])
    assert pool.num_shared == 2
    pool.release(a)
    assert pool.num_free == 2  # the two shared blocks still have one reference
    pool.release(a[:2])
    assert pool.num_free == 4
    with pytest.raises(AssertionError):
        pool.release([a[0]])


def _fill(ctx_id, n, arrival, first=0):
    """A fill op on a new context of tokens ``first, first + 1, ...`` (equal tokens share prefix-cache blocks)."""
    ctx = Context(ctx_id, None, tokens=list(range(first, first + n)))
    op = Op(OpKind.FILL, ctx, arrival=arrival)
    return op


def _apply(s: Scheduler, plan):
    """Pretend the model ran: the chunks' tokens are computed (through the KV manager, as the engine core does)."""
    for c in plan.chunks:
        s.kv.mark_computed(c.op.ctx, c.num_tokens)


def _computed_context(kv, ctx_id: str, n: int, first: int = 0) -> Context:
    """A context of ``n`` tokens whose KV is all computed."""
    ctx = Context(ctx_id, None, tokens=list(range(first, first + n)))
    assert kv.allocate_slots(ctx, n) is not None
    kv.mark_computed(ctx, n)
    return ctx


def test_chunked_prefill_respects_token_budget():
    pool = BlockPool(100, 16)
    s = Scheduler(pool, max_num_seqs=8, max_batch_tokens=64)
    ops = [_fill(f"c{i}", 100, i, first=1000 * i) for i in range(3)]
    for op in ops:
        s.add(op)
    plan = s.schedule()
    assert plan.num_tokens == 64 and [c.op for c in plan.chunks] == [ops[0]]
    _apply(s, plan)
    plan = s.schedule()
    # op0 continues with its remaining 36 tokens, op1 gets the rest of the budget
    assert [(c.op.ctx.id, c.start, c.num_tokens) for c in plan.chunks] == [("c0", 64, 36), ("c1", 0, 28)]
    assert all(len(c.op.ctx.block_table) * 16 >= c.start + c.num_tokens for c in plan.chunks)


def test_decodes_come_first_and_generate_samples_at_end():
    pool = BlockPool(100, 16)
    s = Scheduler(pool, max_num_seqs=8, max_batch_tokens=32)
    g = Op(OpKind.GENERATE, Context("g", None, tokens=list(range(10))), sampling=SamplingParams(), arrival=5)
    s.add(g)
    plan = s.schedule()
    assert plan.chunks[0].sample and plan.chunks[0].num_tokens == 10
    _apply(s, plan)
    g.ctx.tokens.append(7)  # sampled token, uncomputed
    f = _fill("f", 100, 0)  # older, but arrives now
    s.add(f)
    plan = s.schedule()
    assert plan.chunks[0].op is g and plan.chunks[0].num_tokens == 1 and plan.chunks[0].sample
    assert plan.chunks[1].op is f and plan.chunks[1].num_tokens == 31


def test_preemption_of_youngest_and_recompute():
    pool = BlockPool(4, 16)  # 64 tokens of KV
    s = Scheduler(pool, max_num_seqs=8, max_batch_tokens=256)
    old = Op(OpKind.GENERATE, Context("old", None, tokens=list(range(30))), sampling=SamplingParams(), arrival=0)
    young = Op(OpKind.GENERATE, Context("young", None, tokens=list(range(30))), sampling=SamplingParams(), arrival=1)
    s.add(old)
    s.add(young)
    plan = s.schedule()
    assert {c.op.ctx.id for c in plan.chunks} == {"old", "young"} and pool.num_free == 0
    _apply(s, plan)
    # both sampled: 31 tokens each; old needs slot 31 -> block 2 is enough for both? 2 blocks each = 32 tokens
    for op in (old, young):
        op.ctx.tokens.extend([1, 2, 3])  # now 33 tokens: each needs a 3rd block, none free
    plan = s.schedule()
    assert young in plan.preempted and young.status is OpStatus.WAITING and young.ctx.num_computed == 0
    assert [c.op for c in plan.chunks] == [old]
    assert pool.num_used == 3  # old holds 3 blocks; young's were freed


def test_idle_context_is_evicted_before_preemption():
    pool = BlockPool(4, 16)
    s = Scheduler(pool, max_num_seqs=8, max_batch_tokens=256)
    idle = _computed_context(s.kv, "idle", 32, first=1000)
    s.park(idle)
    op = _fill("new", 60, 0)
    s.add(op)
    plan = s.schedule()
    assert [c.op for c in plan.chunks] == [op] and idle.block_table == () and idle.num_computed == 0


def test_too_large_for_pool_is_reported():
    pool = BlockPool(2, 16)
    s = Scheduler(pool, max_num_seqs=8, max_batch_tokens=256)
    s.add(_fill("big", 40, 0))
    with pytest.raises(TooLargeForPool):
        s.schedule()


def test_uncompute_tail_does_not_write_shared_block():
    pool = BlockPool(8, 16)
    s = Scheduler(pool, max_num_seqs=8, max_batch_tokens=256)
    parent = _computed_context(s.kv, "p", 32)
    blocks = parent.block_table
    child = Context("c", "p", tokens=list(range(32)))
    s.kv.fork(parent, child)
    assert child.block_table == blocks and child.num_computed == 32
    g = Op(OpKind.GENERATE, child, sampling=SamplingParams())
    s.add(g)
    plan = s.schedule()
    c = plan.chunks[0]
    # the shared last block is given up and recomputed into a fresh block
    assert (c.start, c.num_tokens) == (16, 16) and child.block_table[0] == blocks[0]
    assert child.block_table[1] != blocks[1] and pool.refcount(blocks[1]) == 1
    assert parent.block_table == blocks


def test_prefix_cache_reuses_released_blocks_and_evicts_lru():
    from parrot.protocol.block_hashes import chain_hashes

    pool = BlockPool(6, 4)
    toks = list(range(100, 112))  # 3 full blocks
    hashes = chain_hashes(toks, 4)
    a = pool.allocate(3)
    for b, h in zip(a, hashes):
        pool.register(b, h)
    pool.release(a)
    assert pool.num_used == 0 and pool.num_cached == 3 and pool.num_free == 6
    # a context with the same first 2 blocks and a different third
    other = chain_hashes(toks[:8] + [1, 2, 3, 4], 4)
    got = pool.match(other)
    assert got == a[:2] and pool.num_cached == 1 and pool.refcount(a[0]) == 1
    # allocation takes truly free blocks first, then evicts the LRU cached block
    fresh = pool.allocate(4)
    assert a[2] in fresh and pool.num_evicted == 1 and pool.num_cached == 0
    assert pool.match(hashes) == a[:2]  # block 3's entry is gone, the chain stops there


def test_scheduler_matches_cached_prefix_on_admission():
    pool = BlockPool(16, 4)
    s = Scheduler(pool, max_num_seqs=8, max_batch_tokens=256)
    first = _fill("a", 14, 0)
    s.add(first)
    plan = s.schedule()
    _apply(s, plan)  # registers the 3 full blocks in the prefix cache
    s.remove(first)
    s.kv.free(first.ctx)  # context freed: its 3 full blocks stay cached
    second = _fill("b", 14, 1)  # same tokens
    s.add(second)
    plan = s.schedule()
    (c,) = plan.chunks
    assert (c.start, c.num_tokens) == (12, 2) and second.num_cached == 12


def test_op_status_moves_only_along_the_transition_table():
    S = OpStatus
    used = {  # every change the scheduler and the engine core make
        (S.QUEUED, S.WAITING),  # started: into the waiting queue
        (S.WAITING, S.RUNNING), (S.RUNNING, S.WAITING),  # admitted; preempted
        (S.QUEUED, S.FINISHED), (S.QUEUED, S.FAILED),  # an empty fill; a failed start or a freed context
        (S.WAITING, S.FINISHED), (S.WAITING, S.FAILED),  # a freed context (generate aborts); too large, failed step
        (S.RUNNING, S.FINISHED), (S.RUNNING, S.FAILED),
    }
    assert {(a, b) for a, nexts in OP_TRANSITIONS.items() for b in nexts} == used
    n = walk_transitions(OP_TRANSITIONS, S.QUEUED, lambda: _fill("x", 1, 0), Op.set_status, IllegalOpTransition)
    assert n == len(used)


def test_without_chunked_prefill_whole_prompts_go_first_and_decodes_wait():
    """vLLM's 2023 scheduler (the paper's baselines): an iteration admits whole prompts only, as many as fit,
    and the running decodes wait for it; with nothing to admit, the decodes run."""
    pool = BlockPool(100, 16)
    s = Scheduler(pool, max_num_seqs=8, max_batch_tokens=64, chunked_prefill=False)
    g = Op(OpKind.GENERATE, Context("g", None, tokens=list(range(10))), sampling=SamplingParams(), arrival=0)
    s.add(g)
    _apply(s, s.schedule())
    g.ctx.tokens.append(7)  # g now decodes
    a, b, c = _fill("a", 30, 1, first=100), _fill("b", 30, 2, first=200), _fill("c", 30, 3, first=300)
    for op in (a, b, c):
        s.add(op)
    plan = s.schedule()
    # a and b fit whole (60 of 64 tokens); c does not and waits; g's decode waits for the prefills
    assert [(ch.op.ctx.id, ch.start, ch.num_tokens) for ch in plan.chunks] == [("a", 0, 30), ("b", 0, 30)]
    _apply(s, plan)
    plan = s.schedule()
    assert [(ch.op.ctx.id, ch.num_tokens) for ch in plan.chunks] == [("c", 30)]
    _apply(s, plan)
    s.remove(a), s.remove(b), s.remove(c)
    plan = s.schedule()  # nothing waits: the decode runs
    assert [(ch.op.ctx.id, ch.num_tokens) for ch in plan.chunks] == [("g", 1)]


def test_without_chunked_prefill_a_prompt_longer_than_the_budget_goes_alone():
    pool = BlockPool(100, 16)
    s = Scheduler(pool, max_num_seqs=8, max_batch_tokens=64, chunked_prefill=False)
    big, small = _fill("big", 100, 0, first=0), _fill("small", 10, 1, first=500)
    s.add(big), s.add(small)
    plan = s.schedule()
    assert [(ch.op.ctx.id, ch.num_tokens) for ch in plan.chunks] == [("big", 64)]
    _apply(s, plan)
    plan = s.schedule()  # small is admitted whole; big's remaining chunk runs in the decode/prefill path next
    assert [(ch.op.ctx.id, ch.num_tokens) for ch in plan.chunks] == [("small", 10)]
    _apply(s, plan)
    s.remove(small)  # a fill whose prompt is computed completes (the engine core removes it)
    plan = s.schedule()
    assert [(ch.op.ctx.id, ch.start, ch.num_tokens) for ch in plan.chunks] == [("big", 64, 36)]


def test_chunked_prefill_is_the_default():
    assert Scheduler(BlockPool(4, 16), max_num_seqs=1, max_batch_tokens=16).chunked_prefill is True
