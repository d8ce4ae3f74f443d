"""Contexts (the fork tree) and the operations queued on them. No torch.

A context is a token sequence plus the KV blocks that hold its computed prefix:

    tokens:       t0 t1 ... t(n-1)                       (every token, the inherited prefix included)
    block_table:  [b7      ][b2      ][b9   ]            (covers tokens [0, num_computed))
                   shared with parent   own (partial)

A child created from a parent copies the parent's token list and references (incref) the parent's *full,
computed* blocks; the partial tail is recomputed by the child, so shared blocks are never written again.
Freeing a parent only drops its references: children keep theirs. A context whose KV was dropped (preempted
or evicted) keeps its tokens and is recomputed when next used.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.kv_cache.block_pool import chain_hashes


class OpKind(enum.Enum):
    FILL = "fill"
    GENERATE = "generate"


class OpStatus(enum.Enum):
    QUEUED = "queued"  # behind another op of the same context
    WAITING = "waiting"  # in the scheduler's waiting queue (no KV allocated for it yet)
    RUNNING = "running"  # admitted: its context holds KV and it is computed/decoded each iteration
    FINISHED = "finished"
    FAILED = "failed"


_op_seq = itertools.count()


@dataclass(eq=False)
class Context:
    id: str
    parent_id: str | None
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    # Opaque to the scheduler: the runner stores the final hidden state of the last computed token here, so a
    # Generate on a fully computed context can sample without recomputing anything. Valid while
    # num_computed == len(tokens) (it depends only on the tokens, so it survives eviction).
    last_hidden: Any = None
    active: "Op | None" = None
    pending: deque["Op"] = field(default_factory=deque)
    last_used: float = field(default_factory=time.monotonic)
    freed: bool = False
    # chain hashes of the full token blocks (a function of ``tokens`` only; extended lazily, see block_hashes)
    _hashes: list[int] = field(default_factory=list)
    num_registered: int = 0  # leading blocks of block_table already registered in the prefix cache

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    def block_hashes(self, n_blocks: int, block_size: int) -> list[int]:
        """Chain hashes of the first ``n_blocks`` full blocks of ``tokens`` (prefix-cache keys)."""
        have = len(self._hashes)
        if n_blocks > have:
            prev = self._hashes[-1] if have else None
            self._hashes.extend(chain_hashes(self.tokens[: n_blocks * block_size], block_size, have, prev))
        return self._hashes[:n_blocks]


@dataclass(eq=False)
class Op:
    """One Fill or Generate call. Owned by the engine thread; results leave through ``on_*`` callbacks."""

    kind: OpKind
    ctx: Context
    new_tokens: list[int] = field(default_factory=list)  # FILL: tokens to append when the op starts
    sampling: SamplingParams | None = None  # GENERATE only
    arrival: float = field(default_factory=time.monotonic)
    seq_no: int = field(default_factory=lambda: next(_op_seq))
    status: OpStatus = OpStatus.QUEUED
    # filled in while running
    prompt_len: int = 0  # context length when the op started
    num_cached: int = 0  # FILL: tokens that were already computed (shared / cached KV)
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    decoder: Any = None  # IncrementalDecoder (GENERATE)
    stopper: Any = None  # StopChecker (GENERATE)
    generator: Any = None  # torch.Generator for seeded sampling (GENERATE), created by the sampler
    on_chunk: Callable[[list[int], str, FinishReason | None], None] | None = None
    on_done: Callable[["Op", BaseException | None], None] | None = None

    @property
    def is_generate(self) -> bool:
        return self.kind is OpKind.GENERATE

    @property
    def sort_key(self) -> tuple[float, int]:
        return (self.arrival, self.seq_no)
