"""Performance criteria of Semantic Variables (paper §4.1, §5.2): what a GET asks for, recorded per variable.

A ``get`` may carry a criterion (end-to-end LATENCY or THROUGHPUT). The manager records it on the fetched
variable (the GetPerfObj primitive) even while the value is pending; deducing request-level preferences from
these annotations (walking the DAG backwards, task groups) is done by a later stage and reads them from here.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class PerfAnnotation:
    """A criterion recorded on a variable by a GET, with the wall-clock time it was first recorded."""

    criteria: PerfCriteria
    recorded_at: float

    def merged(self, criteria: PerfCriteria, now: float) -> "PerfAnnotation":
        """Combine with a later GET: LATENCY is the stricter objective and wins over THROUGHPUT.

        Invariant: an annotation only ever tightens (throughput -> latency), so a deduction pass that ran on
        an older annotation never produced a looser schedule than the current one asks for.
        """
        if criteria is self.criteria or criteria is PerfCriteria.THROUGHPUT:
            return self
        return PerfAnnotation(criteria, now)
