"""Where the engine's compute threads run (no torch): pinned one per CPU when the engine has the machine to itself.

torch's intra-op threads (OpenMP's pool: the engine thread is thread 0) spin at every barrier between kernels.
Left to the OS scheduler on a machine another process also uses, two of them may share one CPU while the other
process has the second one: the spinning thread then burns the time slice its partner needs, and a decode step
waits milliseconds at each of its hundreds of barriers (measured on 2 cores beside one busy process: the
16-sequence job kept 31-33 % of its quiet speed). Pinned one per CPU, the OS can only time-share each of them with
the other process, and the job keeps ~50 % (docs/results/kernels.md); the quiet speed does not change (a
passive OpenMP wait policy gains a few points more under contention but costs ~8 % quiet, so it is not used).

    bind_threads   "auto"  pin when the engine's thread count equals the CPUs the process may use (it owns them;
                           several engines on one machine use fewer threads each and are left to the OS)
                   "on"    pin to the first ``num_threads`` CPUs the process may use (confine each engine to its
                           own CPUs with taskset / cgroups first)
                   "off"   never
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
BIND_CHOICES = ("auto", "on", "off")


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask; all CPUs where the OS has no such call)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def binding(setting: str, num_threads: int, cpus: list[int] | None = None) -> list[int] | None:
    """The CPU each compute thread is pinned to (thread i -> result[i]), or None for no pinning."""
    if setting not in BIND_CHOICES:
        raise ValueError(f"bind_threads must be one of {BIND_CHOICES}, got {setting!r}")
    cpus = allowed_cpus() if cpus is None else cpus
    if setting == "off" or num_threads < 1 or num_threads > len(cpus):
        return None
    if setting == "auto" and num_threads != len(cpus):
        return None
    return cpus[:num_threads]


def bind(ops, cpus: list[int]) -> list[int]:
    """Pin torch's intra-op threads of the calling thread's pool (kernels/threads.cpp); returns where each runs."""
    where = list(ops.bind_threads(cpus))
    log.info("compute threads pinned to CPUs %s", where)
    return where
