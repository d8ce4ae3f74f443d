"""The chain hash of a KV block: how an engine names the blocks of its prefix cache, and how the manager's
prefix-aware placement (Preble's E2 tree, parrot.manager.policies.e2) names the same blocks when it reads an
engine's eviction notices. Both sides must compute it identically, so it lives in the contract.

Block ``b`` of a token sequence hashes ``(hash of block b-1, its block_size tokens)``; the chain starts at 0.
Only full blocks have a hash.
"""

from __future__ import annotations

from collections.abc import Sequence


def chain_hashes(tokens: Sequence[int], block_size: int, start_block: int = 0, prev: int | None = None) -> list[int]:
    """Chain hashes of the full blocks of ``tokens`` from ``start_block`` on (``prev`` = hash of the block before)."""
    out = []
    h = prev if prev is not None else 0  # not None: hash(None) differs between processes before Python 3.12
    for b in range(start_block, len(tokens) // block_size):
        h = hash((h, tuple(tokens[b * block_size : (b + 1) * block_size])))
        out.append(h)
    return out
