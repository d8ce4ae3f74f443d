"""The KV manager (no torch): the one writer of block tables, computed prefixes and the block pool.

Behaviour of each call (allocate / match / fork / mark computed / uncompute / free / pin), the invariants its
``check`` asserts, read-only context fields, and a source check that no other module writes KV state."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from parrot.engine.runtime.context import Context
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.kv_cache.manager import ContextKV, KVBlocks, KVManager

BS = 4


def _manager(num_blocks: int = 8) -> KVManager:
    return KVManager(BlockPool(num_blocks, BS))


def _computed(kv: KVManager, ctx_id: str, tokens: list[int]) -> Context:
    """A context holding ``tokens``, all computed (full blocks registered in the prefix cache)."""
    ctx = Context(ctx_id, None, tokens=list(tokens))
    assert kv.allocate_slots(ctx, len(tokens)) is not None
    kv.mark_computed(ctx, len(tokens))
    kv.check(ctx)
    return ctx


def test_allocate_slots_hands_out_frozen_new_blocks_or_none_changing_nothing():
    kv = _manager(4)
    ctx = Context("a", None, tokens=list(range(10)))
    got = kv.allocate_slots(ctx, 6)  # 2 blocks
    assert isinstance(got, KVBlocks) and len(got.block_ids) == 2 and ctx.block_table == got.block_ids
    assert kv.allocate_slots(ctx, 8).block_ids == ()  # already covered: nothing new
    more = kv.allocate_slots(ctx, 10)
    assert ctx.block_table == got.block_ids + more.block_ids and ctx.num_computed == 0
    before = ctx.kv_state
    assert kv.allocate_slots(ctx, 32) is None  # 8 blocks > 4: the pool is short
    assert ctx.kv_state == before and kv.pool.num_free == 1  # nothing changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.block_ids = ()  # type: ignore[misc]
    kv.check(ctx)


def test_mark_computed_registers_full_blocks_and_match_prefix_reuses_them():
    kv = _manager(8)
    toks = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = _computed(kv, "a", toks)
    assert a.num_computed == 10 and a.num_registered == 2
    assert all(kv.pool.is_registered(b) for b in a.block_table[:2]) and not kv.pool.is_registered(a.block_table[2])
    b = Context("b", None, tokens=toks[:8] + [1, 2, 3, 4, 5])
    hit = kv.match_prefix(b)
    assert hit.block_ids == a.block_table[:2] and b.block_table == hit.block_ids
    assert (b.num_computed, b.num_registered) == (8, 2) and kv.pool.refcount(a.block_table[0]) == 2
    assert kv.match_prefix(b).block_ids == ()  # nothing more cached
    kv.check(b)
    # not at a block boundary (a partial block computed): no match
    c = Context("c", None, tokens=list(toks))
    kv.allocate_slots(c, 3)
    kv.mark_computed(c, 3)
    assert kv.match_prefix(c).block_ids == () and c.num_computed == 3


def test_fork_shares_only_full_computed_blocks():
    kv = _manager(8)
    parent = _computed(kv, "p", list(range(10)))  # blocks: full, full, partial (2 tokens)
    child = Context("c", "p", tokens=list(parent.tokens))
    kv.fork(parent, child)
    assert child.block_table == parent.block_table[:2] and child.num_computed == 8 and child.num_registered == 2
    assert [kv.pool.refcount(b) for b in parent.block_table] == [2, 2, 1]
    kv.check(child)
    with pytest.raises(AssertionError):
        kv.fork(parent, child)  # the child already holds KV


def test_uncompute_tail_writes_only_a_private_block():
    kv = _manager(8)
    private = Context("a", None, tokens=list(range(6)))
    kv.allocate_slots(private, 6)
    kv.mark_computed(private, 6)
    table = private.block_table
    kv.uncompute_tail(private)  # the partial tail block is private: just recompute the last token into it
    assert private.block_table == table and private.num_computed == 5
    parent = _computed(kv, "p", list(range(50, 58)))  # 2 full registered blocks
    child = Context("c", "p", tokens=list(parent.tokens))
    kv.fork(parent, child)
    kv.uncompute_tail(child)  # the last block is shared and cached: give it up, recompute its 4 tokens
    assert child.block_table == parent.block_table[:1] and (child.num_computed, child.num_registered) == (4, 1)
    assert kv.pool.refcount(parent.block_table[1]) == 1
    for ctx in (private, parent, child):
        kv.check(ctx)


def test_free_keeps_other_holders_blocks_and_caches_registered_ones():
    kv = _manager(8)
    parent = _computed(kv, "p", list(range(10)))
    child = Context("c", "p", tokens=list(parent.tokens))
    kv.fork(parent, child)
    blocks = parent.block_table
    kv.free(parent)
    assert parent.kv_state == ContextKV() and parent.tokens == list(range(10))  # tokens stay: recomputed when used
    assert [kv.pool.refcount(b) for b in blocks] == [1, 1, 0] and kv.pool.num_cached == 0
    kv.free(child)
    assert kv.pool.num_used == 0 and kv.pool.num_cached == 2  # the registered full blocks stay cached
    kv.free(child)  # no KV: nothing to release


def test_pin_prefix_holds_cached_blocks_through_eviction():
    kv = _manager(4)
    toks = list(range(8))
    kv.free(_computed(kv, "a", toks))
    assert kv.pin_prefix(toks) == 2 and kv.pool.capacity == 2
    hog = Context("hog", None, tokens=list(range(1000, 1008)))
    assert kv.allocate_slots(hog, 8) is not None and kv.allocate_slots(hog, 12) is None  # pinned: not evicted
    assert kv.pin_prefix(toks, pinned=False) == 0 and kv.pool.capacity == 4
    assert kv.allocate_slots(hog, 12) is not None  # unpinned: the cached blocks are evictable again
    assert kv.pool.num_evicted == 1 and kv.pin_prefix(toks) == 0  # LRU took the chain's first block: no match
    assert kv.pin_prefix([1, 2]) == 0  # no full block: nothing to pin


def test_check_catches_each_broken_invariant():
    kv = _manager(8)
    ctx = _computed(kv, "a", list(range(6)))
    good = ctx.kv_state
    shared = _computed(kv, "b", list(range(50, 58)))
    broken = {
        "I1": ContextKV(good.block_ids[:1], 6, 1),
        "I2": ContextKV(good.block_ids, 7, 1),
        "I3": ContextKV(good.block_ids, 6, 2),
        "I4": ContextKV(good.block_ids + (7,), 6, 1),
        "I5": ContextKV(shared.block_table, 4, 1),
    }
    for name, record in broken.items():
        # a test may corrupt the state; the source check below keeps parrot/ from it
        ctx._block_ids, ctx._num_computed, ctx._num_registered = dataclasses.astuple(record)
        with pytest.raises(AssertionError, match=name):
            kv.check(ctx)


def test_context_kv_fields_are_read_only():
    ctx = Context("a", None, tokens=[1, 2, 3])
    for name, value in (("block_table", (1,)), ("num_computed", 1), ("num_registered", 1), ("kv_state", ContextKV())):
        with pytest.raises(AttributeError):
            setattr(ctx, name, value)
    assert isinstance(ctx.block_table, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.kv_state.num_computed = 3  # type: ignore[misc]


# ---- ownership: the manager is the only writer ---------------------------------------------------------------------
PARROT = Path(__file__).resolve().parents[1] / "parrot"
MANAGER = PARROT / "engine" / "kv_cache" / "manager.py"
KV_FIELDS = {"_block_ids", "_num_computed", "_num_registered", "block_table", "num_computed", "num_registered"}
POOL_WRITES = {"allocate", "release", "incref", "register", "match", "pin", "unpin"}


def _written_attrs(target: ast.expr):
    """Attributes an assignment target writes into: ``x.a =``, ``x.a[i] = ``, ``x.a, y = ``."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _written_attrs(t)
    elif isinstance(target, ast.Starred):
        yield from _written_attrs(target.value)
    elif isinstance(target, ast.Subscript):
        yield from _written_attrs(target.value)
    elif isinstance(target, ast.Attribute):
        yield target.attr


def _is_pool(expr: ast.expr) -> bool:
    name = expr.attr if isinstance(expr, ast.Attribute) else expr.id if isinstance(expr, ast.Name) else ""
    return "pool" in name.lower()


def kv_writes(source: str) -> list[str]:
    """Places in ``source`` that write a context's KV fields or call a mutating method of a block pool."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        found += [f"{node.lineno}: .{a} =" for t in targets for a in _written_attrs(t) if a in KV_FIELDS]
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr in KV_FIELDS:
            found.append(f"{node.lineno}: .{f.value.attr}.{f.attr}()")  # e.g. ctx.block_table.append(b)
        if isinstance(f, ast.Attribute) and f.attr in POOL_WRITES and _is_pool(f.value):
            found.append(f"{node.lineno}: pool.{f.attr}()")
        if isinstance(f, ast.Name) and f.id == "setattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in KV_FIELDS:
            found.append(f"{node.lineno}: setattr(.., {node.args[1].value!r})")
    return found


def test_the_check_sees_every_kind_of_write():
    src = ("ctx.num_computed = 0\nctx.num_computed += 1\nctx.block_table[0] = 3\na, ctx.num_registered = 1, 2\n"
           "ctx.block_table.append(4)\nself.pool.release(t)\npool.allocate(2)\nsetattr(ctx, 'num_computed', 1)\n"
           "ctx._num_computed = 0\nx = ctx.num_computed\nfoo.release(t)\n")
    assert sorted(int(w.split(":")[0]) for w in kv_writes(src)) == list(range(1, 10))  # not lines 10, 11


def test_only_the_kv_manager_writes_kv_state():
    offenders = []
    for path in sorted(PARROT.rglob("*.py")):
        if path == MANAGER:
            continue
        offenders += [f"{path.relative_to(PARROT.parent)}:{w}" for w in kv_writes(path.read_text())]
    assert not offenders, "KV state written outside parrot/engine/kv_cache/manager.py:\n" + "\n".join(offenders)
    assert kv_writes(MANAGER.read_text())  # the manager itself does write (the check is not vacuous)


def test_scheduler_kv_accounting_and_dag_import_no_torch():
    code = ("import sys\n"
            "import parrot.engine.scheduler.scheduler, parrot.engine.kv_cache.manager, parrot.engine.runtime.core\n"
            "import parrot.engine.runtime.decode_groups, parrot.manager.graph\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PARROT.parent)
