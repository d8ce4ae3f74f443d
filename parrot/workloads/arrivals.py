"""Seeded arrival processes: when each request of a stream arrives (seconds from the stream's start).

Two Poisson shapes live here, and they differ in the first arrival, so each workload keeps the one it was
measured with (the same draws in the same order):

    arrivals(n, rate, rng)          first arrival after one exponential gap; ``bursty``: on/off at the same mean
    poisson_arrivals(n, rate, rng)  first arrival at 0, then exponential gaps

The simulator's tool mixes draw their gaps inline, interleaved with each request's other draws
(:func:`parrot.workloads.tools.make_workload`).
"""

from __future__ import annotations

import random


def arrivals(n: int, rate: float, rng: random.Random, pattern: str = "poisson") -> list[float]:
    """``n`` arrival times at mean ``rate``/s: ``poisson``, or ``bursty`` (on/off: 4x the rate for a quarter of
    each 10-second period, 0 otherwise; the same mean)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    out, t = [], 0.0
    if pattern == "poisson":
        for _ in range(n):
            t += rng.expovariate(rate)
            out.append(t)
        return out
    if pattern != "bursty":
        raise ValueError(f"pattern must be poisson or bursty, got {pattern!r}")
    period, on = 10.0, 2.5
    while len(out) < n:
        t += rng.expovariate(rate * period / on)
        phase = t % period
        if phase >= on:  # off: skip to the next burst
            t += period - phase
        out.append(t)
    return out


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """``n`` arrival times (s, the first at 0) of a Poisson process of ``rate`` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out
