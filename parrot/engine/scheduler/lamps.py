"""LAMPS' admission order: waiting ops by score (memory over time), starving ops first (Alg. 1, §4.3-4.4). No torch.

Each scheduling iteration the engine asks :meth:`LampsRanker.order` for the waiting queue's admission order and,
after admitting down that order, reports who got in and who did not (:meth:`LampsRanker.after_admission`)::

    waiting (FCFS):   a(9.0)  b(2.0)  c(5.0)  d(2.0)        scores in ()
    order:            b  d  c  a                            ascending score; b before d: FCFS among ties
    a passed over 100 times (threshold) -> starving:
    order:            a | b  d  c                           starving first (by score among themselves)

Counters (§4.4): every iteration an op stays waiting its counter grows by one; when it reaches the threshold
the op is *starving* and goes to the head. Admission resets the counter, but a starving op keeps its priority
until it finishes or pauses for a tool call (:meth:`LampsRanker.forget`): a preempted half-finished op should
not lose its place again. Scores are cached per key and recomputed every ``refresh_interval`` calls of
:meth:`LampsRanker.order` (LAMPS' selective refresh; 1 = every iteration); a key seen for the first time is
scored at once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class LampsRanker(Generic[K]):
    """Admission order by score with starvation prevention (LAMPS Alg. 1 lines 13-31, §4.4)."""

    def __init__(self, starvation_threshold: int = 100, refresh_interval: int = 1) -> None:
        if starvation_threshold < 1:
            raise ValueError(f"starvation_threshold must be >= 1, got {starvation_threshold!r}")
        if refresh_interval < 1:
            raise ValueError(f"refresh_interval must be >= 1, got {refresh_interval!r}")
        self.starvation_threshold = starvation_threshold
        self.refresh_interval = refresh_interval
        self._scores: dict[K, float] = {}
        self._counters: dict[K, int] = {}
        self._starving: set[K] = set()
        self._calls = 0
        self.num_scored = 0  # score() evaluations (what the refresh interval saves)

    def order(self, waiting: Sequence[T], key: Callable[[T], K], score: Callable[[T], float]) -> list[T]:
        """``waiting`` (FCFS order) in admission order: starving items first, then the rest, each group by
        ascending score, ties by position in ``waiting``."""
        refresh = self._calls % self.refresh_interval == 0
        self._calls += 1
        keys = [key(item) for item in waiting]
        if refresh:
            live = set(keys)
            for stale in [k for k in self._scores if k not in live]:
                del self._scores[stale]
        for item, k in zip(waiting, keys):
            if refresh or k not in self._scores:
                self._scores[k] = float(score(item))
                self.num_scored += 1
        ranked = sorted(range(len(waiting)),
                        key=lambda i: (keys[i] not in self._starving, self._scores[keys[i]], i))
        return [waiting[i] for i in ranked]

    def after_admission(self, admitted: Iterable[K], still_waiting: Iterable[K]) -> None:
        """One iteration's outcome: ``admitted`` keys get their counter reset (a starving one stays starving
        until :meth:`forget`); every ``still_waiting`` key counts one more pass, starving at the threshold."""
        for k in admitted:
            self._counters[k] = 0
        for k in still_waiting:
            n = self._counters.get(k, 0) + 1
            self._counters[k] = n
            if n >= self.starvation_threshold:
                self._starving.add(k)

    def forget(self, key: K) -> None:
        """The op finished or paused for a tool call: drop its counter, starvation mark and cached score."""
        self._counters.pop(key, None)
        self._starving.discard(key)
        self._scores.pop(key, None)

    def is_starving(self, key: K) -> bool:
        return key in self._starving

    def passes(self, key: K) -> int:
        """Iterations ``key`` has waited since it was last admitted (0 when unknown)."""
        return self._counters.get(key, 0)
