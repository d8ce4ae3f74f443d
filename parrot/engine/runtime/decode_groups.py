"""Shared-prefix decode groups (no torch): which decode rows of an iteration read a common KV prefix once.

Rows whose block tables start with the same P >= ``min_shared_blocks`` full blocks (forks of one context, or
prefix-cache hits on the same blocks), all wholly before each row's new token, form a group; the runner's
shared-prefix attention reads those P blocks once for the whole group, and the simulator's cost model counts
them once. Both call :func:`shared_prefix_groups`, so they apply the same rule::

    row 1:  [b7][b2][b9][b4]      b7 b2 b9 shared by rows 1-3: one group with P = 3
    row 2:  [b7][b2][b9][b11]
    row 3:  [b7][b2][b9][b5][b6]
    row 4:  [b3][b8]              plain
"""

from __future__ import annotations

from parrot.engine.scheduler.scheduler import Chunk


def min_shared_blocks(min_shared_tokens: int, block_size: int) -> int:
    """Whole blocks a shared prefix needs before a group is worth forming (at least one)."""
    return max(1, -(-min_shared_tokens // block_size))


def shared_prefix_groups(decodes: list[Chunk], block_size: int,
                         min_blocks: int) -> tuple[list[Chunk], list[tuple[int, list[Chunk]]]]:
    """Split one-token decode chunks into plain rows (in their given order, rows too short to share first) and
    groups ``(P, members)`` of >= 2 rows sharing their first P >= ``min_blocks`` blocks."""
    plain: list[Chunk] = []
    by_first: dict[int, list[Chunk]] = {}
    for c in decodes:
        if c.start // block_size >= min_blocks:
            by_first.setdefault(c.op.ctx.block_table[0], []).append(c)
        else:
            plain.append(c)
    groups: list[tuple[int, list[Chunk]]] = []
    for members in by_first.values():
        if len(members) >= 2:
            common = _common_blocks(members, block_size)
            if common >= min_blocks:
                groups.append((common, members))
                continue
        plain.extend(members)
    return plain, groups


def _common_blocks(members: list[Chunk], block_size: int) -> int:
    """Leading block ids common to all members, limited to blocks wholly before each one's new token."""
    common = min(c.start // block_size for c in members)
    head = members[0].op.ctx.block_table
    for c in members[1:]:
        common = _common_prefix(head, c.op.ctx.block_table, common)
    return common


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit`` (binary search over C-speed slice
    compares: prefix equality is monotone in the length)."""
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
