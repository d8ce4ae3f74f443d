"""E2's hot-prefix replication fires end to end (Preble 4.2): a simulated 4-engine cluster, one prefix taking 85 % of
a request rate that ramps from 5 to 60 requests/s. With post-assignment rebalancing off, the key node's queueing
estimate doubles over the window and E2 places a request of it on an engine that does not hold it (``replicate``);
with rebalancing on, rebalancing moves the hot prefix's overflow first, which spreads it before it turns hot."""

from __future__ import annotations

import asyncio
import random

from parrot.manager.policies import E2Config, E2Policy
from parrot.sim.cluster import ClusterConfig, SimCluster
from parrot.sim.vloop import run_virtual
from parrot.workloads.synth import synth_text


def _requests(n: int = 400, rate0: float = 5.0, rate1: float = 60.0) -> list[tuple[float, str]]:
    rng = random.Random(0)
    hot = "[hot] " + synth_text(2500, rng)
    cold = [f"[cold {k}] " + synth_text(2000, rng) for k in range(3)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate0 + (rate1 - rate0) * i / n)
        base = hot if rng.random() < 0.85 else rng.choice(cold)
        out.append((t, f"{base}\nQ: {synth_text(30, rng)}\nA:"))
    return out


def _run(rebalance: bool) -> dict[str, int]:
    policy = E2Policy(E2Config(window_s=5.0, rebalance=rebalance))
    reqs = _requests()

    async def main() -> dict[str, int]:
        async with SimCluster(ClusterConfig(engines=4, cost_model="llama7b-a6000", policy="e2",
                                            latency_ms=(0.0, 0.0)), policy=policy) as c:
            t0 = c.clock()

            async def one(arrival: float, prompt: str) -> None:
                await asyncio.sleep(max(0.0, t0 + arrival - c.clock()))
                await c.complete(prompt, 40, rtt=False)

            await asyncio.gather(*(one(a, p) for a, p in reqs))
        return policy.decision_counts()

    return run_virtual(main())


def test_a_hot_prefix_is_replicated_when_rebalancing_does_not_spread_it_first():
    alone = _run(rebalance=False)
    assert alone.get("replicate", 0) >= 1 and alone.get("rebalance", 0) == 0
    both = _run(rebalance=True)
    assert both.get("rebalance", 0) >= 1 and both.get("replicate", 0) == 0
