"""Contexts (the fork tree) and the operations queued on them. No torch.

A context is a token sequence plus the KV blocks that hold its computed prefix:

    tokens:       t0 t1 ... t(n-1)                       (every token, the inherited prefix included)
    block_table:  [b7      ][b2      ][b9   ]            (covers tokens [0, num_computed))
                   shared with parent   own (partial)

A child created from a parent copies the parent's token list and references (incref) the parent's *full,
computed* blocks; the partial tail is recomputed by the child, so shared blocks are never written again.
Freeing a parent only drops its references: children keep theirs. A context whose KV was dropped (preempted
or evicted) keeps its tokens and is recomputed when next used.

The KV side (``block_table``, ``num_computed``, ``num_registered``; ``kv_state`` is a frozen snapshot of the
three) is read-only here: only :class:`~parrot.engine.kv_cache.manager.KVManager` changes it. An op's status
moves only along :data:`OP_TRANSITIONS`.

Logprobs, when an op asks for them, are kept as the runner computed them (:class:`RawLogprobs`: ids and floats)
and given text only when they leave the engine: a Generate's one per sampled token (``Op.logprobs``), a Fill's
one per filled token (``Op.prompt_lp``; ``None`` until computed or served by the prompt-logprob cache).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from parrot.common.sampling import FinishReason, PositionLogprobs, SamplingParams, TokenLogprob
from parrot.protocol.interface import GenerateChunk, OpHint
from parrot.protocol.block_hashes import chain_hashes
from parrot.engine.kv_cache.manager import ContextKV


class OpKind(enum.Enum):
    FILL = "fill"
    GENERATE = "generate"


class OpStatus(enum.Enum):
    QUEUED = "queued"  # behind another op of the same context
    WAITING = "waiting"  # in the scheduler's waiting queue (no KV allocated for it yet)
    RUNNING = "running"  # admitted: its context holds KV and it is computed/decoded each iteration
    FINISHED = "finished"
    FAILED = "failed"


# op lifecycle: QUEUED -> WAITING -> RUNNING -> FINISHED | FAILED; a preempted op goes back RUNNING -> WAITING; an
# op ends from any live state (an empty fill, a failed start, a freed context, a failed step)
OP_TRANSITIONS: dict[OpStatus, frozenset[OpStatus]] = {
    OpStatus.QUEUED: frozenset({OpStatus.WAITING, OpStatus.FINISHED, OpStatus.FAILED}),
    OpStatus.WAITING: frozenset({OpStatus.RUNNING, OpStatus.FINISHED, OpStatus.FAILED}),
    OpStatus.RUNNING: frozenset({OpStatus.WAITING, OpStatus.FINISHED, OpStatus.FAILED}),
    OpStatus.FINISHED: frozenset(),
    OpStatus.FAILED: frozenset(),
}


class IllegalOpTransition(AssertionError):
    """An op status change :data:`OP_TRANSITIONS` does not allow: a bug in the engine, not a request error."""


_op_seq = itertools.count()


@dataclass(frozen=True, slots=True)
class RawLogprobs:
    """Logprobs at one position as the runner computes them (fp32 log_softmax): the token that is there and the
    ``k`` most likely tokens, most likely first (``top_ids[i]`` has ``top_logprobs[i]``). ``k`` is the number asked
    for; the top is shorter only if the vocabulary is."""

    token_id: int
    logprob: float
    k: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def truncated(self, k: int) -> "RawLogprobs":
        """The same position with only the ``k <= self.k`` most likely alternatives."""
        if k == self.k:
            return self
        return RawLogprobs(self.token_id, self.logprob, k, self.top_ids[:k], self.top_logprobs[:k])


class LogprobLabels:
    """Turns the runner's :class:`RawLogprobs` (ids and floats) into the API's records with each token's text and
    bytes (``tokenizer.token_to_bytes``, decoded with errors replaced), cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, tuple[str, bytes]] = {}

    def position(self, raw: RawLogprobs) -> PositionLogprobs:
        return PositionLogprobs(self.token(raw.token_id, raw.logprob),
                                tuple(map(self.token, raw.top_ids, raw.top_logprobs)))

    def token(self, token_id: int, logprob: float) -> TokenLogprob:
        text = self._texts.get(token_id)
        if text is None:
            raw = self._tokenizer.token_to_bytes(token_id)
            text = self._texts[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return TokenLogprob(token_id, text[0], text[1], logprob)


@dataclass(eq=False)
class Context:
    id: str
    parent_id: str | None
    tokens: list[int] = field(default_factory=list)
    # Opaque to the scheduler: the runner stores the final hidden state of the last computed token here, so a
    # Generate on a fully computed context can sample without recomputing anything. Valid while
    # num_computed == len(tokens) (it depends only on the tokens, so it survives eviction).
    last_hidden: Any = None
    active: "Op | None" = None
    pending: deque["Op"] = field(default_factory=deque)
    last_used: float = field(default_factory=time.monotonic)
    freed: bool = False
    # Arrival of the latest FILL on this context that no GENERATE has followed yet (a fork inherits its parent's):
    # the GENERATE that completes that turn queues by it, so a request's decode is not served after every fill
    # that arrived while its own prompt was being prefilled (fair service: early requests finish early).
    turn_arrival: float | None = None
    # the Handling predicted for a tool call after this context's last generate (LAMPS), used if it is paused
    tool_handling: Any = None
    # chain hashes of the full token blocks (a function of ``tokens`` only; extended lazily, see block_hashes)
    _hashes: list[int] = field(default_factory=list)
    # KV state: read-only here, rebound only by parrot.engine.kv_cache.manager (immutable values: a tuple, ints)
    _block_ids: tuple[int, ...] = field(default=(), init=False)
    _num_computed: int = field(default=0, init=False)
    _num_registered: int = field(default=0, init=False)

    @property
    def block_table(self) -> tuple[int, ...]:
        return self._block_ids

    @property
    def num_computed(self) -> int:
        return self._num_computed

    @property
    def num_registered(self) -> int:
        """Leading blocks of block_table already offered to the prefix cache."""
        return self._num_registered

    @property
    def kv_state(self) -> ContextKV:
        """A frozen snapshot of the KV state."""
        return ContextKV(self._block_ids, self._num_computed, self._num_registered)

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self._num_computed

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
    prompt_logprobs: int | None = None  # FILL: report per filled token its logprob and this many alternatives
    arrival: float = field(default_factory=time.monotonic)
    seq_no: int = field(default_factory=lambda: next(_op_seq))
    # FCFS key when it differs from ``arrival``: a GENERATE's turn arrival (Context.turn_arrival)
    turn_arrival: float | None = None
    hint: OpHint | None = None  # GENERATE: the manager's predictions (output length, a tool call after it)
    # GENERATE under a "predicted" tool policy: the Handling chosen at admission from the hint, used at the pause
    handling: Any = None
    _status: OpStatus = field(default=OpStatus.QUEUED, init=False)
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
    guide: Any = None  # parrot.engine.runtime.guided.Guide when sampling.constraint is set (GENERATE), made at op start
    # FILL with prompt_logprobs: one entry per filled token (position prompt_len + i), None until known
    prompt_lp: list[RawLogprobs | None] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # GENERATE with sampling.logprobs: per token
    on_chunk: Callable[[GenerateChunk], None] | None = None  # GENERATE: each streamed increment
    on_done: Callable[["Op", BaseException | None], None] | None = None

    @property
    def status(self) -> OpStatus:
        return self._status

    def set_status(self, status: OpStatus) -> None:
        """Move to ``status``; raises IllegalOpTransition unless :data:`OP_TRANSITIONS` allows it."""
        if status not in OP_TRANSITIONS[self._status]:
            raise IllegalOpTransition(f"op {self.seq_no} on context {self.ctx.id!r}: {self._status.value} -> "
                                      f"{status.value} is not a legal transition")
        self._status = status

    @property
    def is_generate(self) -> bool:
        return self.kind is OpKind.GENERATE

    @property
    def sort_key(self) -> tuple[float, int]:
        """FCFS order: by the turn's arrival (a GENERATE ranks with the FILL it follows), then submission."""
        first = self.arrival if self.turn_arrival is None else min(self.arrival, self.turn_arrival)
        return (first, self.seq_no)
