"""The host swap store's accounting (slots by chain hash, LRU, locks) and the KV manager's swap planning. No torch."""

from __future__ import annotations

from parrot.engine.runtime.context import Context
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.kv_cache.host_store import HostStore
from parrot.engine.kv_cache.manager import KVManager


def test_put_take_and_lru_eviction():
    h = HostStore(2)
    assert h.put(10) == (0, True) and h.put(11) == (1, True)
    assert h.put(12) is None  # both slots wait for their copies
    h.unlock_all()
    assert h.put(10) == (0, False)  # already held: no copy, touched (11 is now least recently used)
    h.unlock_all()
    assert h.put(12) == (1, True) and 11 not in h and h.num_evicted == 1
    h.unlock_all()
    assert h.take(12) == 1 and h.take(99) is None and h.num_hits == 1
    assert h.num_used == 2 and h.num_available == 1  # slot 1 is locked by the planned swap-in


def test_locked_slots_are_not_reused_until_the_copy_ran():
    h = HostStore(1)
    h.put(1)
    h.unlock_all()
    assert h.take(1) == 0
    assert h.put(2) is None  # the only slot is the source of a planned swap-in
    h.unlock_all()
    assert h.put(2) == (0, True) and 1 not in h


def test_zero_slots_means_no_swapping():
    kv = KVManager(BlockPool(8, 4), HostStore(0))
    assert kv.host is None


def _computed(kv: KVManager, ctx_id: str, tokens: list[int]) -> Context:
    ctx = Context(ctx_id, None, tokens=list(tokens))
    assert kv.allocate_slots(ctx, len(tokens)) is not None
    kv.mark_computed(ctx, len(tokens))
    return ctx


def test_swap_out_then_match_plans_copies_and_counts_blocks_computed():
    pool = BlockPool(8, 4)
    kv = KVManager(pool, HostStore(8))
    toks = list(range(10))  # 2 full blocks + 2 tokens
    ctx = _computed(kv, "a", toks)
    table = ctx.block_table
    assert kv.swap_out(ctx) == 2
    assert ctx.block_table == () and pool.num_used == 0
    copies = kv.take_copies()
    assert copies.swap_out == ((table[0], 0), (table[1], 1)) and copies.swap_in == ()
    kv.copies_done()
    # the pool forgets the blocks (evicted by other work): a context with that prefix is served from the host
    filler = Context("f", None, tokens=list(range(100, 132)))
    assert kv.allocate_slots(filler, 32) is not None
    kv.free(filler)
    assert pool.cached_run(ctx.block_hashes(2, 4)) == 0
    b = Context("b", None, tokens=toks + [42, 43])
    assert kv.prefix_hit_blocks(b) == 2
    hit = kv.match_prefix(b)
    assert len(hit.block_ids) == 2 and b.num_computed == 8
    assert kv.take_copies().swap_in == ((0, hit.block_ids[0]), (1, hit.block_ids[1]))
    kv.copies_done()
    kv.check(b)


def test_swap_out_stops_when_the_store_is_full():
    kv = KVManager(BlockPool(8, 4), HostStore(1))
    ctx = _computed(kv, "a", list(range(12)))
    assert kv.swap_out(ctx) == 1 and len(kv.take_copies().swap_out) == 1  # the head, never evicted for its tail


def test_a_match_reaching_a_paused_key_is_reported_once():
    kv = KVManager(BlockPool(8, 4))
    toks = list(range(8))
    a = _computed(kv, "a", toks)
    kv.pause_keys[a.block_hashes(2, 4)[-1]] = ["a"]
    b = Context("b", None, tokens=toks + [1, 2, 3])
    kv.match_prefix(b)
    assert [(c.id, pid) for c, pid in kv.covered()] == [("b", "a")]
    assert kv.covered() == []
