"""The criterion a GET records on a variable (paper §4.1, §5.2: GetPerfObj), and how later GETs combine with it.

A ``get`` may carry a criterion (:class:`~parrot.common.perf.PerfCriteria`: end-to-end LATENCY or THROUGHPUT).
The manager records it on the fetched variable even while the value is pending;
:mod:`parrot.manager.perf_deduction` turns these annotations into request-level labels (walking the DAG
backwards, task groups).
"""

from __future__ import annotations

from dataclasses import dataclass

from parrot.common.perf import PerfCriteria


@dataclass(frozen=True)
class PerfAnnotation:
    """A criterion recorded on a variable by a GET, with the time (on the graph's clock) it was first recorded."""

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
