"""The engine policies' wait-queue orders (parrot.engine.scheduler.policies): FCFS and Preble's priority groups."""

from __future__ import annotations

import pytest

from parrot.engine.runtime.context import Context, Op, OpKind
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.scheduler.policies import EnginePolicyConfig, make_engine_policy
from parrot.engine.scheduler.policies.preble import preble_order, priority_group
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.engine.settings import EngineSettings


def test_priority_group_is_the_cached_ratio_in_P_steps():
    assert priority_group(63, 100, 10) == 6  # the paper's example
    assert priority_group(100, 100, 10) == 10
    assert priority_group(0, 100, 10) == 0
    assert priority_group(0, 0, 10) == 10


def test_proportional_quotas_highest_first_fcfs_inside():
    # (name, cached of 10 tokens), P = 3: groups by floor(3 * cached / 10)
    ops = [("h1", 0), ("a", 10), ("b", 10), ("e", 7), ("c", 10), ("h2", 1), ("d", 10), ("f", 7), ("g", 10)]
    cached = dict(ops)
    order = preble_order([n for n, _ in ops], 3, cached.__getitem__, lambda _: 10)
    # round 1: 4 from g3 (a b c d), 3 from g2 (e f), none in g1, 1 from g0 (h1); round 2: g (g3), h2 (g0)
    assert order == ["a", "b", "c", "d", "e", "f", "h1", "g", "h2"]


def test_quotas_serve_every_group_in_proportion():
    ops = [(f"hi{i}", 10) for i in range(100)] + [(f"lo{i}", 0) for i in range(100)]
    cached = dict(ops)
    order = preble_order([n for n, _ in ops], 9, cached.__getitem__, lambda _: 10)
    first = order[:55]  # five rounds of 10 from group 9 and 1 from group 0
    assert sum(n.startswith("hi") for n in first) == 50 and sum(n.startswith("lo") for n in first) == 5


def _op(ctx_id: str, tokens: list[int], t: float) -> Op:
    return Op(OpKind.FILL, Context(ctx_id, None, tokens=list(tokens)), arrival=t)


def test_scheduler_admits_cached_prompts_first_under_preble():
    pool = BlockPool(64, 4)
    sched = Scheduler(pool, max_num_seqs=1, max_batch_tokens=64, policy=make_engine_policy("preble"))
    # cache the KV of prompt P (two full blocks) by running and finishing a context over it
    warm = _op("warm", list(range(8)), 0.0)
    sched.add(warm)
    plan = sched.schedule()
    sched.kv.mark_computed(warm.ctx, plan.chunks[0].num_tokens)
    sched.remove(warm)
    sched.kv.free(warm.ctx)
    cold = _op("cold", list(range(100, 108)), 1.0)  # arrived first, nothing cached
    hot = _op("hot", list(range(8)), 2.0)  # arrived later, fully cached
    sched.add(cold)
    sched.add(hot)
    assert sched.cached_tokens(hot) == 8 and sched.cached_tokens(cold) == 0
    plan = sched.schedule()
    assert [c.op for c in plan.chunks] == [hot]
    fcfs = Scheduler(BlockPool(64, 4), max_num_seqs=1, max_batch_tokens=64)
    a, b = _op("a", list(range(100, 108)), 1.0), _op("b", list(range(8)), 2.0)
    fcfs.add(a)
    fcfs.add(b)
    assert [c.op for c in fcfs.schedule().chunks] == [a]


def test_settings_and_validation():
    assert EngineSettings().engine_policy == "lamps"  # the builtin engine's default (LAMPS)
    assert EngineSettings(engine_policy="preble").engine_policy == "preble"
    with pytest.raises(ValueError, match="engine_policy"):
        EngineSettings(engine_policy="lifo")
    with pytest.raises(ValueError, match="priority_groups"):
        make_engine_policy("preble", EnginePolicyConfig(priority_groups=0))
    assert Scheduler(BlockPool(4, 4), 1, 16).policy.name == "fcfs"  # the scheduler's own default
