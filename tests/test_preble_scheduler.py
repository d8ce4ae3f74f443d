"""The engine scheduler's view of an op's cached tokens (what the Preble local policy ranks waiting ops by) agrees
with what admission takes from the prefix cache, including the prompt-logprob match limit. No torch."""

from __future__ import annotations

from functools import partial

from parrot.engine.runtime.context import Context, Op, OpKind
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.kv_cache.prompt_logprobs import match_limit
from parrot.engine.scheduler.policies import make_engine_policy
from parrot.engine.scheduler.scheduler import Scheduler

BS = 4
PROMPT = list(range(12))  # three full blocks of 4


def _op(ctx_id: str, tokens: list[int], t: float, *, prompt_logprobs: int | None = None) -> Op:
    op = Op(OpKind.FILL, Context(ctx_id, None, tokens=list(tokens)), prompt_logprobs=prompt_logprobs, arrival=t)
    op.ctx.active = op  # started, as the engine core does before the scheduler sees it
    if prompt_logprobs is not None:
        op.prompt_lp = [None] * len(tokens)  # nothing known yet (the core's _start_prompt_logprobs)
    return op


def _warm(sched: Scheduler, tokens: list[int]) -> None:
    """Compute ``tokens`` in a context and free it: their full blocks stay in the prefix cache."""
    warm = _op("warm", tokens, 0.0)
    sched.add(warm)
    plan = sched.schedule()
    sched.kv.mark_computed(warm.ctx, plan.chunks[0].num_tokens)
    sched.remove(warm)
    sched.kv.free(warm.ctx)


def _scheduler(**kw) -> Scheduler:
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=1, max_batch_tokens=64, **kw)
    sched.kv.set_match_limit(partial(match_limit, block_size=BS))  # the engine core's rule
    _warm(sched, PROMPT[:8])  # blocks 0 and 1 cached
    return sched


def test_cached_tokens_is_what_match_prefix_takes_under_the_match_limit():
    sched = _scheduler()
    plain = _op("plain", PROMPT, 1.0)
    assert sched.cached_tokens(plain) == 8
    lp = _op("lp", PROMPT, 1.0, prompt_logprobs=1)  # logprobs of blocks 0-1 unknown: the cache gives nothing
    assert sched.cached_tokens(lp) == 0
    known = _op("known", PROMPT, 1.0, prompt_logprobs=1)
    known.prompt_lp[:8] = ["x"] * 8  # positions 0-7 known, 8 not: block 1 is given back (its last row's logits)
    assert sched.cached_tokens(known) == 4
    for op in (plain, lp, known):  # read-only so far; admission takes exactly that
        before = sched.cached_tokens(op)
        assert sched.kv.prefix_hit_blocks(op.ctx) * BS == before
        taken = sched.kv.match_prefix(op.ctx)
        assert len(taken.block_ids) * BS == before and op.ctx.num_computed == before
        sched.kv.free(op.ctx)


def test_preble_order_does_not_rank_a_prompt_logprob_fill_as_cached():
    sched = _scheduler(policy=make_engine_policy("preble"))
    cold = _op("cold", list(range(100, 112)), 1.0)  # arrived first, nothing cached
    lp = _op("lp", PROMPT, 2.0, prompt_logprobs=1)  # its prefix is cached, but it may not take it
    sched.add(cold)
    sched.add(lp)
    assert [c.op for c in sched.schedule().chunks] == [cold]  # both group 0: FCFS
    sched2 = _scheduler(policy=make_engine_policy("preble"))
    cold2, hot = _op("cold", list(range(100, 112)), 1.0), _op("hot", PROMPT, 2.0)
    sched2.add(cold2)
    sched2.add(hot)
    assert [c.op for c in sched2.schedule().chunks] == [hot]  # a plain fill over the cached prefix goes first
