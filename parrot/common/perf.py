"""Performance criteria and latency targets of a GET (paper §4.1, §5.2), shared by the frontend and the manager.

A fetch may carry a criterion (end-to-end LATENCY or THROUGHPUT) and, with LATENCY, targets. The targets
exist in two forms with the same per-token half::

    LatencyTargets(ttft_s, tpot_s, deadline_s)   as the application states them: deadline relative to the GET
          | .pinned(now)
          v
    PinnedTargets(ttft_s, tpot_s, deadline)       as the manager schedules by: deadline absolute, on its clock

Both validate their fields with one rule (:func:`_check_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from parrot.common.errors import InvalidRequestError


class PerfCriteria(str, Enum):
    """The end-to-end objective an application asks for when it fetches a variable."""

    LATENCY = "latency"
    THROUGHPUT = "throughput"

    @classmethod
    def parse(cls, value: "str | PerfCriteria | None") -> "PerfCriteria | None":
        """``None`` stays None; a known name (case-insensitive) becomes the enum; anything else -> 400."""
        if value is None or isinstance(value, PerfCriteria):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            known = ", ".join(c.value for c in cls)
            raise InvalidRequestError(f"unknown criteria {value!r} (known: {known})", param="criteria") from None


def _check_seconds(name: str, value: object) -> None:
    """A target duration is None or a positive finite number of seconds; InvalidRequestError naming ``name``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not (value > 0 and math.isfinite(value))):
        raise InvalidRequestError(f"{name} must be a positive number of seconds, got {value!r}", param=name)


@dataclass(frozen=True)
class _TokenTargets:
    """The per-token half of the latency targets, the same in both forms: ``ttft_s`` -- first token within
    this, ``tpot_s`` -- at most this per output token. None = no target."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        _check_seconds("ttft_s", self.ttft_s)
        _check_seconds("tpot_s", self.tpot_s)


@dataclass(frozen=True)
class LatencyTargets(_TokenTargets):
    """Latency targets as an application states them; ``deadline_s`` -- the value wanted within this many
    seconds of the GET. Each is optional, > 0 and finite."""

    deadline_s: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_seconds("deadline_s", self.deadline_s)

    def query(self) -> dict[str, float]:
        """The GET parameters (docs/api.md: ``ttft_ms``, ``tpot_ms``, ``deadline_s``)."""
        out: dict[str, float] = {}
        if self.ttft_s is not None:
            out["ttft_ms"] = self.ttft_s * 1000
        if self.tpot_s is not None:
            out["tpot_ms"] = self.tpot_s * 1000
        if self.deadline_s is not None:
            out["deadline_s"] = self.deadline_s
        return out

    def pinned(self, now: float) -> "PinnedTargets":
        """These targets with the deadline made absolute: ``now`` (the GET's time on the manager's clock)
        plus ``deadline_s``."""
        return PinnedTargets(self.ttft_s, self.tpot_s, None if self.deadline_s is None else now + self.deadline_s)


@dataclass(frozen=True)
class PinnedTargets(_TokenTargets):
    """Latency targets as the manager schedules by: ``deadline`` is absolute, on the manager's clock
    (``time.time`` in a server, the virtual clock in the simulator)."""

    deadline: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.deadline is None

    def tightest(self, other: "PinnedTargets") -> "PinnedTargets":
        """Field-wise the stricter of the two (None = no target)."""
        def pick(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else min(a, b)

        return PinnedTargets(pick(self.ttft_s, other.ttft_s), pick(self.tpot_s, other.tpot_s),
                             pick(self.deadline, other.deadline))

    def deadline_only(self) -> "PinnedTargets":
        return PinnedTargets(deadline=self.deadline)
