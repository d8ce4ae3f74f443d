"""KVManager: the one writer of every context's KV state (block table, computed prefix) and of the block pool.

The scheduler decides *whose* KV to allocate, evict or preempt; the engine core decides when a context is forked,
freed or has computed tokens. Both ask this manager, which alone rebinds a context's ``block_table`` /
``num_computed`` / ``num_registered`` (read-only properties of :class:`~parrot.engine.runtime.context.Context`) and
changes the pool's reference counts. What it hands out is immutable (a block table is a tuple; :class:`KVBlocks`
and the :class:`ContextKV` snapshot are frozen): the scheduler, the runner and the simulator read block ids, never
write them (vLLM v1's ``KVCacheBlocks``).

Layout of one context (``bs`` = 8 here; ``=`` a computed token, ``-`` a token not computed yet)::

    block_ids   [  b7  ][  b2  ][  b9  ][  b4  ][  b1  ]
    tokens      ===========================--------
                |< registered >|
                |<-- full, computed -->|<- private -->|

* registered: the leading ``num_registered`` blocks, offered to the prefix cache;
* full, computed: the ``num_computed // bs`` blocks that may be shared (fork, prefix-cache hit, pin); never
  written again;
* private: the partial tail and the blocks allocated ahead for the next chunk; refcount 1, not registered, the
  only blocks ever written.

Invariants (:meth:`KVManager.check` asserts them):

* I1 every computed token has a slot: ``ceil(num_computed / bs) <= len(block_ids)``;
* I2 ``num_computed <= len(tokens)``;
* I3 the leading ``num_registered <= num_computed // bs`` blocks have been offered to the prefix cache;
* I4 each block of the table holds one reference of the pool (refcount >= 1);
* I5 KV is never shared while writable: a block from index ``num_computed // bs`` on (the partial tail and the
  blocks allocated ahead) has refcount 1 and is not registered in the prefix cache.

Host swap space (a :class:`~parrot.engine.kv_cache.host_store.HostStore`, optional): :meth:`KVManager.swap_out`
plans copies of a context's full computed blocks to host slots (then frees the context's KV), and
:meth:`KVManager.match_prefix` continues the pool's cached run with blocks the host store holds, copied back into
fresh pool blocks. Both only *plan* copies (:meth:`KVManager.take_copies`); the runner performs every swap-out of
a plan, then every swap-in, before the plan's forward, so a block freed by a swap-out and reallocated in the
same plan is copied out before anything writes it, and a swapped-in block counts as computed at once.

No torch: the K/V tensors live in the runner; this module only moves block ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parrot.engine.kv_cache.block_pool import BlockPool, OutOfBlocks
from parrot.protocol.block_hashes import chain_hashes
from parrot.engine.kv_cache.host_store import HostStore

if TYPE_CHECKING:
    from parrot.engine.runtime.context import Context


@dataclass(frozen=True, slots=True)
class ContextKV:
    """A frozen snapshot of a context's KV state (``Context.kv_state``); see the module's layout picture."""

    block_ids: tuple[int, ...] = ()
    num_computed: int = 0  # tokens [0, num_computed) have their K/V in the blocks
    num_registered: int = 0  # leading blocks already offered to the prefix cache


@dataclass(frozen=True, slots=True)
class KVBlocks:
    """Blocks one manager call gave a context (a prefix-cache hit or an allocation), in block-table order."""

    block_ids: tuple[int, ...] = ()


NO_BLOCKS = KVBlocks()


@dataclass(frozen=True, slots=True)
class KVCopies:
    """Copies the runner performs before a plan's forward, in this order: ``swap_out`` (pool block, host slot)
    pairs, then ``swap_in`` (host slot, pool block) pairs."""

    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()


NO_COPIES = KVCopies()

# (context, table index of its first matchable block, length of the cached run from there) -> how many of those
# blocks to take (0..run): the engine core's rule for contexts whose op needs more than KV from the prefix cache
MatchLimit = Callable[["Context", int, int], int]


class KVManager:
    """Owns the block pool and every context's KV state; no other code writes either."""

    def __init__(self, pool: BlockPool, host: HostStore | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.host = host if host is not None and host.num_slots > 0 else None  # swap space (None: no swapping)
        self._pins: dict[int, list[int]] = {}  # last chain hash of a pinned prefix -> its pinned blocks
        self._match_limit: MatchLimit | None = None
        self._swap_out: list[tuple[int, int]] = []  # planned copies, taken with the next plan (take_copies)
        self._swap_in: list[tuple[int, int]] = []
        # chain hash of the last full block of paused contexts -> their ids, oldest pause first: a context whose
        # computed prefix reaches that block continues one of them (the engine then drops that pause); covered()
        self.pause_keys: dict[int, list[str]] = {}
        self._covered: list[tuple[Context, str]] = []

    def set_match_limit(self, limit: MatchLimit | None) -> None:
        """Install the rule :meth:`match_prefix` asks before taking cached blocks (None: take the whole run). The
        engine core installs one for prompt-logprob fills (parrot.engine.kv_cache.prompt_logprobs)."""
        self._match_limit = limit

    # ---- queries (the pool's own: num_free, capacity, blocks_for, ...) ---------------------------------------------
    def blocks_missing(self, ctx: Context, upto: int) -> int:
        """Blocks ``ctx`` still needs for slots [0, upto)."""
        return max(0, self.pool.blocks_for(upto) - len(ctx.block_table))

    # ---- the scheduler's calls ---------------------------------------------------------------------------------
    def allocate_slots(self, ctx: Context, upto: int) -> KVBlocks | None:
        """Give ``ctx`` blocks for token slots [0, upto) (evicting cached blocks LRU-first). Returns the new blocks
        (empty if it had enough), or None if the pool is short: then nothing changed."""
        table = ctx.block_table
        need = -(-upto // self.block_size) - len(table)
        if need <= 0:
            return NO_BLOCKS
        try:
            new = tuple(self.pool.allocate(need))
        except OutOfBlocks:
            return None
        _write(ctx, table + new, ctx.num_computed, ctx.num_registered)
        return KVBlocks(new)

    def match_prefix(self, ctx: Context) -> KVBlocks:
        """Extend ``ctx``'s computed prefix with the longest cached run of its next full token blocks; returns the
        blocks taken (their tokens count as computed). A block the pool does not cache but the host store holds
        is copied back into a fresh pool block (a planned swap-in; the run stops where the pool has no block
        left for it). Only at a block boundary with nothing allocated ahead, so matched blocks extend the table
        directly; the installed match limit (:meth:`set_match_limit`) may take fewer."""
        n = self.prefix_hit_blocks(ctx)
        if not n:
            return NO_BLOCKS
        table, bs, pool = ctx.block_table, self.block_size, self.pool
        hashes = ctx.block_hashes(len(table) + n, bs)[len(table):]
        hit: list[int] = []
        for h in hashes:
            got = pool.match([h])
            if not got:
                slot = self.host.take(h) if self.host is not None else None
                if slot is None:
                    break
                try:
                    got = pool.allocate(1)
                except OutOfBlocks:
                    break
                self._swap_in.append((slot, got[0]))
                pool.register(got[0], h)
            hit += got
        table += tuple(hit)
        _write(ctx, table, len(table) * bs, len(table))
        self._note_covered(ctx, hashes[:len(hit)])
        return KVBlocks(tuple(hit))

    def prefix_hit_blocks(self, ctx: Context) -> int:
        """How many blocks :meth:`match_prefix` would take for ``ctx`` now (the run of its next full blocks the
        pool caches or the host store holds, cut by the match limit); changes nothing. The scheduler's local policy
        reads it to rank waiting ops."""
        table, bs = ctx.block_table, self.block_size
        have = len(table)
        if ctx.num_computed != have * bs or len(ctx.tokens) // bs <= have:
            return 0
        hashes = ctx.block_hashes(len(ctx.tokens) // bs, bs)[have:]
        run = self.pool.cached_run(hashes)
        if self.host is not None:
            while run < len(hashes) and (hashes[run] in self.host or self.pool.cached_run(hashes[run:run + 1])):
                run += 1
        if run and self._match_limit is not None:
            run = max(0, min(run, self._match_limit(ctx, have, run)))
        return run

    def uncompute_tail(self, ctx: Context) -> None:
        """Make the last computed token of a context uncomputed again (it must be re-run for its logits); the
        context holds no blocks ahead of its computed tokens (a fully computed context, or one whose new tokens
        are not scheduled yet).

        If its block is shared or cached, the context gives the block up (recomputing up to ``block_size`` tokens
        into a fresh block) instead of writing into KV another context reads (I5)."""
        table, bs = ctx.block_table, self.block_size
        last = table[-1]
        if self.pool.refcount(last) == 1 and not self.pool.is_registered(last):
            n = ctx.num_computed - 1
            _write(ctx, table, n, min(ctx.num_registered, n // bs))
        else:
            self.pool.release([last])
            table = table[:-1]
            _write(ctx, table, len(table) * bs, min(ctx.num_registered, len(table)))

    def free(self, ctx: Context) -> None:
        """Drop ``ctx``'s KV (eviction, preemption, a freed context): its references go back to the pool; it keeps
        its tokens and is recomputed when next used. Shared blocks stay with their other holders."""
        self.pool.release(ctx.block_table)
        _write(ctx, (), 0, 0)

    # ---- tool pauses (swap space) ------------------------------------------------------------------------------
    def swap_out(self, ctx: Context) -> int:
        """Plan copies of ``ctx``'s full computed blocks to the host store (blocks it already holds are only
        touched), then drop ``ctx``'s KV (:meth:`free`). Returns the blocks the store holds for ``ctx`` (the
        leading run: it stops at the first block the store has no room for)."""
        if self.host is None:
            self.free(ctx)
            return 0
        n_full = ctx.num_computed // self.block_size
        hashes = ctx.block_hashes(n_full, self.block_size)
        stored = 0
        for b, h in zip(ctx.block_table[:n_full], hashes):
            got = self.host.put(h)
            if got is None:
                break
            slot, copy = got
            if copy:
                self._swap_out.append((b, slot))
            stored += 1
        self.free(ctx)
        return stored

    def host_room(self, ctx: Context) -> bool:
        """Whether the host store could take all of ``ctx``'s full computed blocks now."""
        if self.host is None:
            return False
        n_full = ctx.num_computed // self.block_size
        missing = sum(1 for h in ctx.block_hashes(n_full, self.block_size) if h not in self.host)
        return missing <= self.host.num_available

    def take_copies(self) -> KVCopies:
        """The copies planned since the last call (for the plan about to run); swap-in sources stay locked until
        :meth:`copies_done`."""
        if not self._swap_out and not self._swap_in:
            return NO_COPIES
        out = KVCopies(tuple(self._swap_out), tuple(self._swap_in))
        self._swap_out.clear()
        self._swap_in.clear()
        return out

    def copies_done(self) -> None:
        """The runner performed the copies of the last plan."""
        if self.host is not None:
            self.host.unlock_all()

    def covered(self) -> list[tuple[Context, str]]:
        """(context, paused context id) for each context whose computed prefix reached a paused context's last
        full block since the last call (a resume by prefix match); clears the list."""
        out, self._covered = self._covered, []
        return out

    def _note_covered(self, ctx: Context, hashes: Sequence[int]) -> None:
        if self.pause_keys:
            for h in hashes:
                pid = next((p for p in self.pause_keys.get(h, ()) if p != ctx.id), None)
                if pid is not None:
                    self._covered.append((ctx, pid))

    # ---- the engine core's calls -------------------------------------------------------------------------------
    def fork(self, parent: Context, child: Context) -> None:
        """Give ``child`` (a new context holding a copy of the parent's tokens, no KV yet) the parent's full
        computed blocks; the partial tail is recomputed by the child, so shared blocks are never written again."""
        if child.block_table:
            raise AssertionError(f"fork into context {child.id!r}, which already holds KV")
        n_share = parent.num_computed // self.block_size
        shared = parent.block_table[:n_share]
        self.pool.incref(shared)
        _write(child, shared, n_share * self.block_size, min(n_share, parent.num_registered))

    def mark_computed(self, ctx: Context, n: int) -> None:
        """Tokens [num_computed, num_computed + n) were computed into their slots; newly full blocks are offered to
        the prefix cache (registered under their chain hash)."""
        computed = ctx.num_computed + n
        n_full = computed // self.block_size
        registered = ctx.num_registered
        if n_full > registered:
            hashes = ctx.block_hashes(n_full, self.block_size)
            for i in range(registered, n_full):
                self.pool.register(ctx.block_table[i], hashes[i])
            self._note_covered(ctx, hashes[registered:n_full])
            registered = n_full
        _write(ctx, ctx.block_table, computed, registered)

    def pin_prefix(self, tokens: Sequence[int], pinned: bool = True) -> int:
        """Pin (or unpin) the cached KV of a token prefix: its full blocks hold one extra reference, so LRU eviction
        never drops them. Only blocks already cached or in use are pinned; returns how many are pinned now."""
        hashes = chain_hashes(tokens, self.block_size)
        if not hashes:
            return 0
        key = hashes[-1]
        self.pool.unpin(self._pins.pop(key, []))
        blocks = self.pool.pin(hashes) if pinned else []
        if blocks:
            self._pins[key] = blocks
        return len(blocks)

    # ---- checks ------------------------------------------------------------------------------------------------
    def check(self, ctx: Context) -> None:
        """Assert the module's invariants I1-I5 on ``ctx`` (tests and debugging; O(blocks))."""
        kv, bs, pool = ctx.kv_state, self.block_size, self.pool
        table = kv.block_ids
        assert pool.blocks_for(kv.num_computed) <= len(table), f"I1: {ctx.id}: computed tokens without a slot"
        assert kv.num_computed <= len(ctx.tokens), f"I2: {ctx.id}: more computed than tokens"
        assert kv.num_registered <= kv.num_computed // bs, f"I3: {ctx.id}: registered a block not fully computed"
        assert all(pool.refcount(b) >= 1 for b in table), f"I4: {ctx.id}: a block without its reference"
        for b in table[kv.num_computed // bs:]:
            assert pool.refcount(b) == 1 and not pool.is_registered(b), f"I5: {ctx.id}: writable block {b} shared"


def _write(ctx: Context, block_ids: tuple[int, ...], num_computed: int, num_registered: int) -> None:
    """The one place a context's KV state changes (tests/test_kv_manager.py checks no other module writes it)."""
    ctx._block_ids, ctx._num_computed, ctx._num_registered = block_ids, num_computed, num_registered
