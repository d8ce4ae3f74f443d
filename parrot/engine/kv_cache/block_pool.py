"""A fixed pool of KV blocks with reference counts and a prefix cache (no torch; tensors live in the runner).

A block holds the K/V of ``block_size`` consecutive tokens of one context, for every layer:

    KV tensors (per layer):  k_cache[num_blocks, block_size, n_kv_heads, head_dim]   (v_cache alike)
    block table of a context: [b7, b2, b9]  ->  token t lives in block table[t // bs], row t % bs

Block states:

    free ──allocate──► in use (ref >= 1) ──release to 0──► free            (block without a hash)
                          │  register(hash) when full       └──────────► cached (ref 0, LRU, evictable)
                          ◄──────────────── match(hash) ──────────────────┘

A *full, computed* block can be registered under a chain hash ``h_i = hash(h_{i-1}, tokens of block i)``, so
equal hashes mean equal token prefixes. When its last reference goes, a registered block is kept as *cached*
(its K/V stays valid) instead of freed; a later context whose prefix hashes match takes it back (prefix cache).
Cached blocks are evicted least-recently-released first when allocation needs room, so eviction never touches a
block a context references. Only full blocks are shared or cached, and they are never written again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


EVICTION_LOG_LEN = 512  # chain hashes of the latest evicted blocks kept for the engine's eviction notices


class OutOfBlocks(Exception):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are available than requested (nothing changes)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._hash_of: dict[int, int] = {}  # block -> chain hash (registered blocks)
        self._block_of: dict[int, int] = {}  # chain hash -> block
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref-0 registered blocks, LRU first
        self.num_evicted = 0
        self.evicted_log: deque[int] = deque(maxlen=EVICTION_LOG_LEN)  # latest evicted chain hashes, oldest first
        self.num_hit_blocks = 0
        self.num_pinned = 0  # blocks held by pins: never available to contexts while pinned

    @property
    def capacity(self) -> int:
        """Blocks contexts can ever get (all but the pinned ones)."""
        return self.num_blocks - self.num_pinned

    def pin(self, hashes: Sequence[int]) -> list[int]:
        """Hold an extra reference on the cached/used blocks of this chain (see match); returns them."""
        blocks = self.match(hashes)
        self.num_pinned += len(blocks)
        return blocks

    def unpin(self, blocks: Sequence[int]) -> None:
        self.num_pinned -= len(blocks)
        self.release(blocks)

    # ---- queries -----------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free + evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one context."""
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_shared(self) -> int:
        """Blocks referenced by more than one block table."""
        return sum(1 for r in self._ref if r > 1)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- mutations ---------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (refcount 1), evicting cached blocks LRU-first if the free list is short.
        Raises OutOfBlocks, changing nothing, if fewer than ``n`` are available."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached.popitem(last=False)
                h = self._hash_of.pop(b)
                del self._block_of[h]
                self.evicted_log.append(h)
                self.num_evicted += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def incref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._ref[b] <= 0:
                raise AssertionError(f"incref of unreferenced block {b}")
            self._ref[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference of each block; at zero a registered block becomes cached, others free."""
        for b in blocks:
            r = self._ref[b] - 1
            if r < 0:
                raise AssertionError(f"double free of block {b}")
            self._ref[b] = r
            if r == 0:
                if b in self._hash_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    # ---- prefix cache ------------------------------------------------------------------------------------
    def register(self, block: int, chain_hash: int) -> None:
        """Record that ``block`` (full, computed, referenced) holds the prefix ending in ``chain_hash``.
        A hash already held by another block keeps its first block (the new one stays unregistered)."""
        if not self.enable_prefix_cache or block in self._hash_of or chain_hash in self._block_of:
            return
        self._hash_of[block] = chain_hash
        self._block_of[chain_hash] = block

    def cached_run(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a chain from the start) :meth:`match` would take now; changes nothing."""
        if not self.enable_prefix_cache:
            return 0
        n = 0
        for h in hashes:
            if h not in self._block_of:
                break
            n += 1
        return n

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Take a reference on the blocks of the longest cached run of ``hashes`` (a chain from the start)."""
        out: list[int] = []
        if not self.enable_prefix_cache:
            return out
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1
            out.append(b)
        self.num_hit_blocks += len(out)
        return out
