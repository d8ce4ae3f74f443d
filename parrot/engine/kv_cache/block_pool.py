"""A fixed pool of KV blocks with reference counts (no torch; the tensors live in the runner).

A block holds the K/V of ``block_size`` consecutive tokens of one context, for every layer:

    KV tensors (per layer):  k_cache[num_blocks, block_size, n_kv_heads, head_dim]   (v_cache alike)
    block table of a context: [b7, b2, b9]  ->  token t lives in block table[t // bs], row t % bs

Invariants: a block is either free (refcount 0, in the free list) or referenced by >= 1 block tables.
Only *full* blocks are ever shared between contexts (a fork shares the parent's full blocks and recomputes
the partial tail), so a shared block is never written again: no copy-on-write is needed.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(Exception):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than requested (nothing is allocated)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    # ---- queries -----------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_shared(self) -> int:
        """Blocks referenced by more than one block table (saved copies = sum(ref - 1))."""
        return sum(1 for r in self._ref if r > 1)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- mutations ---------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount 1). Raises OutOfBlocks, allocating nothing, if not enough are free."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref[b] <= 0:
                raise AssertionError(f"incref of free block {b}")
            self._ref[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference of each block; blocks reaching zero return to the free list."""
        for b in blocks:
            r = self._ref[b] - 1
            if r < 0:
                raise AssertionError(f"double free of block {b}")
            self._ref[b] = r
            if r == 0:
                self._free.append(b)
