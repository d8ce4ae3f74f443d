"""Paused contexts (a tool call is running) and the costs the engine weighs their handling with. No torch.

A context handed over by ``EngineClient.pause_context`` stays in the engine (its tokens, and its KV as its
handling says) until it is *resumed* or its TTL ends::

    PRESERVE  the context keeps its block table (its blocks are referenced: neither evictable nor allocatable)
    SWAP      its full computed blocks are copied to the host store, then its KV is dropped
    DISCARD   its KV is dropped (registered blocks fall into the prefix cache: a later hit is a bonus)

    resume:   a context whose computed prefix reaches the paused context's last full block (a prefix-cache
              match, a swap-in or a recompute; KVManager.pause_keys / covered), a fork of it, or an op on it
    expiry:   ``deadline`` passed -> freed

:class:`PauseTable` is the engine's record of them (by id, and by the chain hash of the last full block, the key
of a resume by prefix), with counters for the status. :class:`EngineToolCosts` is the
:class:`~parrot.engine.scheduler.tool_handling.ToolCosts` of a live engine: recompute and decode-step times from
its own step-time fit (:class:`~parrot.common.step_cost.StepStats`), swap time from the runner's measured copy
rate; conservative CPU-class defaults until the fit exists.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parrot.common.step_cost import StepCost, StepStats
from parrot.protocol.interface import ToolHint
from parrot.engine.scheduler.tool_handling import Handling

if TYPE_CHECKING:
    from parrot.engine.runtime.context import Context

MIN_TTL_S = 30.0  # a pause lives at least this long without a configured TTL ...
TTL_FACTOR = 4.0  # ... or this many times the tool's expected duration
DEFAULT_TOOL_S = 1.0  # a tool's duration when neither the hint nor past pauses of that tool say
# before the engine has a step-time fit (its first few iterations): a small model on one CPU core
FALLBACK_FWD_TOKEN_S = 1e-3
FALLBACK_STEP_S = 0.03
FIT_EVERY = 64  # uses between refits of the step-time model (a 4x4 solve)


def pause_ttl(tool: ToolHint, configured_s: float | None) -> float:
    """The TTL of a pause: the configured one, else max(MIN_TTL_S, TTL_FACTOR x the expected duration)."""
    if configured_s is not None:
        return configured_s
    return max(MIN_TTL_S, TTL_FACTOR * (tool.expected_duration_s or 0.0))


@dataclass(eq=False)
class PausedContext:
    ctx: Context
    tool: ToolHint
    handling: Handling
    started: float
    deadline: float
    num_tokens: int  # context length at the pause
    num_blocks: int  # blocks kept (preserve) / freed (discard) / held by the host store (swap)
    key: int | None  # chain hash of the last full block (None: no full block, resumable only by id)


@dataclass
class PauseTable:
    by_id: dict[str, PausedContext] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {h.value: 0 for h in Handling})  # pauses by handling
    num_resumed: int = 0
    num_expired: int = 0
    num_demoted: int = 0  # preserved pauses moved to swap / discard under KV pressure
    _durations: dict[str, tuple[float, int]] = field(default_factory=dict)  # tool -> (sum of seconds, count)
    # (deadline, n, pause) of every pause added, earliest first; entries of pauses already gone are skipped when
    # they come up (the engine asks for the expired ones at every command and plan: no scan of all pauses)
    _deadlines: list[tuple[float, int, PausedContext]] = field(default_factory=list)
    _seq: Iterator[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[PausedContext]:
        return iter(list(self.by_id.values()))

    def get(self, context_id: str) -> PausedContext | None:
        return self.by_id.get(context_id)

    def add(self, p: PausedContext) -> None:
        self.by_id[p.ctx.id] = p
        self.counts[p.handling.value] += 1
        heapq.heappush(self._deadlines, (p.deadline, next(self._seq), p))

    def pop(self, context_id: str, now: float, *, resumed: bool) -> PausedContext | None:
        p = self.by_id.pop(context_id, None)
        if p is not None and resumed:
            self.num_resumed += 1
            total, n = self._durations.get(p.tool.name, (0.0, 0))
            self._durations[p.tool.name] = (total + max(0.0, now - p.started), n + 1)
        return p

    def expected_s(self, tool: ToolHint) -> float:
        """The tool's expected duration: the hint's, else the mean of its resumed pauses, else DEFAULT_TOOL_S."""
        if tool.expected_duration_s is not None:
            return tool.expected_duration_s
        total, n = self._durations.get(tool.name, (0.0, 0))
        return total / n if n else DEFAULT_TOOL_S

    def expired(self, now: float) -> list[PausedContext]:
        """The pauses whose deadline has passed (each returned once: the caller drops them)."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, p = heapq.heappop(self._deadlines)
            if self.by_id.get(p.ctx.id) is p:
                out.append(p)
        return out

    def preserved(self) -> list[PausedContext]:
        """Preserved pauses, the latest deadline first (demoted first under pressure: resumed last)."""
        return sorted((p for p in self.by_id.values() if p.handling is Handling.PRESERVE),
                      key=lambda p: -p.deadline)

    def to_wire(self) -> dict:
        return {"paused": len(self.by_id), "by_handling": dict(self.counts), "resumed": self.num_resumed,
                "expired": self.num_expired, "demoted": self.num_demoted}


class EngineToolCosts:
    """ToolCosts of a live engine. ``batch`` answers the running batch as (decode rows, context tokens);
    ``copy_rate`` the runner's measured host<->pool copy rate (bytes/s, None before any copy);
    ``kv_bytes_per_token`` the K/V bytes of one token (all layers)."""

    def __init__(self, stats: StepStats, batch: Callable[[], tuple[int, int]], kv_bytes_per_token: int,
                 copy_rate: Callable[[], float | None], default_copy_rate: float) -> None:
        self.stats = stats
        self.batch = batch
        self.kv_bytes_per_token = kv_bytes_per_token
        self.copy_rate = copy_rate
        self.default_copy_rate = default_copy_rate
        self._fit: StepCost | None = None
        self._calls = 0

    def _cost(self) -> StepCost | None:
        """The step-time fit, refitted every FIT_EVERY uses (and while there is none yet)."""
        if self._fit is None or self._calls % FIT_EVERY == 0:
            self._fit = self.stats.fit()
        self._calls += 1
        return self._fit

    def fwd_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        fit = self._cost()
        return fit.step_s(0, 0, tokens) if fit is not None else tokens * FALLBACK_FWD_TOKEN_S

    def swap_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        rate = self.copy_rate() or self.default_copy_rate
        return tokens * self.kv_bytes_per_token / rate

    def step_s(self) -> float:
        fit = self._cost()
        if fit is None:
            return FALLBACK_STEP_S
        rows, ctx_tokens = self.batch()
        return fit.step_s(max(1, rows), ctx_tokens, 0)
