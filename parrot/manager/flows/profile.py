"""What flows learned from past runs (speculation's evidence) and their counters.

``BranchProfile`` keeps, per branch (``<flow name>/<branch name>``), the case taken in each of its last
``window`` runs; a case is *likely* when it was taken in at least ``min_prob`` of at least ``min_runs`` runs. It
also keeps each loop's iteration counts (what a loop's generates tell the engine to expect: Lookahead).
``FlowStats`` counts flows, loop iterations and speculation outcomes (``GET /api/v1/stats`` ``flows`` and the
Prometheus counters of parrot.manager.metrics). Both live in the manager's memory (a restart relearns them).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field


class BranchProfile:
    def __init__(self, window: int = 100) -> None:
        self.window = window
        self._runs: dict[str, deque[int]] = {}
        self._loops: dict[str, deque[int]] = {}  # loop key -> iterations of its recent runs

    def record_loop(self, key: str, iterations: int) -> None:
        self._loops.setdefault(key, deque(maxlen=self.window)).append(iterations)

    def expected_iterations(self, key: str, default: int) -> int:
        """The mean iteration count of the loop's recent runs (rounded); ``default`` before its first run."""
        runs = self._loops.get(key)
        return round(sum(runs) / len(runs)) if runs else default

    def record(self, key: str, case: int) -> None:
        self._runs.setdefault(key, deque(maxlen=self.window)).append(case)

    def likely(self, key: str, min_runs: int, min_prob: float) -> int | None:
        runs = self._runs.get(key)
        if not runs or len(runs) < min_runs:
            return None
        case, n = Counter(runs).most_common(1)[0]
        return case if n / len(runs) >= min_prob else None

    def frequencies(self) -> dict[str, dict[int, float]]:
        return {k: {c: n / len(v) for c, n in sorted(Counter(v).items())} for k, v in self._runs.items() if v}


@dataclass
class FlowStats:
    flows: int = 0
    ended: Counter = field(default_factory=Counter)  # status -> flows
    iterations: int = 0
    hits: int = 0
    misses: int = 0
    wasted_tokens: int = 0
    on_speculation: Callable[[bool, int], None] = lambda hit, wasted: None  # metrics hook
    on_iteration: Callable[[], None] = lambda: None

    def flow_started(self) -> None:
        self.flows += 1

    def flow_ended(self, status: str) -> None:
        self.ended[status] += 1

    def iteration(self) -> None:
        self.iterations += 1
        self.on_iteration()

    def speculation(self, hit: bool, wasted_tokens: int) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1
            self.wasted_tokens += wasted_tokens
        self.on_speculation(hit, wasted_tokens)

    def to_dict(self) -> dict:
        return {"flows": self.flows, "ended": dict(self.ended), "iterations": self.iterations,
                "speculations": {"hit": self.hits, "miss": self.misses}, "wasted_tokens": self.wasted_tokens}
