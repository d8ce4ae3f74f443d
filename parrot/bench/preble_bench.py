"""Preble experiments: E2 vs round-robin vs least-loaded on simulated engines, the ablation, and the global
scheduler's decision speed.

    python -m parrot.bench.preble_bench speed [--requests 6000] [--engines 8]
    python -m parrot.bench.preble_bench sim [--engines 4] [--cost-model llama7b-a6000] [--workloads toolbench,...]
                                            [--rates 2,4,8] [--requests 300] [--pattern poisson|bursty]
    python -m parrot.bench.preble_bench ablation [--engines 4] [--rate 8] [--requests 400]

``sim`` runs each workload of :mod:`parrot.sim.preble_workloads` through the real manager (OpenAI completion path,
no declared structure) over N simulated engines, one fresh virtual cluster per (policy, rate), and prints mean /
p99 request latency and the ratios baseline / e2 measured in the same run. Conditions are printed with the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import statistics
import time
from dataclasses import replace

from parrot.bench.report import format_table
from parrot.common.step_cost import StepCost
from parrot.manager.policies import E2Config, E2Policy
from parrot.manager.policies.base import ClusterView, DispatchRequest, EngineView, QueuedRequest
from parrot.manager.perf_deduction import SchedInfo
from parrot.sim.cluster import ClusterConfig, SimCluster
from parrot.sim.preble_workloads import WORKLOADS, workload
from parrot.sim.tokenizer import WordTokenizer
from parrot.sim.vloop import run_virtual

log = logging.getLogger(__name__)


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def run_one(name: str, n: int, rate: float, config: ClusterConfig, *, policy=None, pattern: str = "poisson",
            seed: int = 0) -> dict:
    """Latencies of ``n`` requests of workload ``name`` at ``rate``/s on a fresh simulated cluster."""
    reqs = workload(name, n, rate, seed, pattern)

    async def main() -> dict:
        async with SimCluster(config, policy=policy) as cluster:
            t0 = cluster.clock()

            async def one(r):
                await asyncio.sleep(max(0.0, t0 + r.arrival_s - cluster.clock()))
                res = await cluster.complete(r.prompt, r.max_tokens, rtt=False)
                return res.latency_s

            lat = await asyncio.gather(*(one(r) for r in reqs))
            stats = cluster.engine_stats()
            pol = cluster.manager.dispatcher.policy
            e2 = pol if isinstance(pol, E2Policy) else getattr(pol, "e2", None)
            return {"mean": statistics.mean(lat), "p99": p99(lat), "busy": [s["busy_s"] for s in stats.values()],
                    "hit_blocks": sum(s["prefix_hit_blocks"] for s in stats.values()),
                    "tokens": sum(s["tokens"] for s in stats.values()),
                    "decisions": dict(e2.counts) if e2 is not None else {}}

    return run_virtual(main())


def sim(args) -> str:
    base = ClusterConfig(engines=args.engines, cost_model=args.cost_model, seed=args.seed, latency_ms=(0.0, 0.0),
                         kv_cache_tokens=args.kv_tokens)
    policies = ("e2", "round-robin", "least-loaded")
    out = []
    for name in args.workloads.split(","):
        rows = []
        for rate in (float(r) for r in args.rates.split(",")):
            res = {p: run_one(name, args.requests, rate, replace(base, policy=p), pattern=args.pattern, seed=args.seed)
                   for p in policies}
            e2 = res["e2"]
            rows.append([f"{rate:g} req/s"] + [res[p][k] for p in policies for k in ("mean", "p99")]
                        + [res["round-robin"]["mean"] / e2["mean"], res["round-robin"]["p99"] / e2["p99"],
                           res["least-loaded"]["mean"] / e2["mean"], res["least-loaded"]["p99"] / e2["p99"],
                           ", ".join(f"{k} {v}" for k, v in sorted(e2["decisions"].items()))])
        out.append(format_table(
            ["rate", "e2 mean s", "e2 p99 s", "rr mean s", "rr p99 s", "ll mean s", "ll p99 s",
             "rr/e2 mean", "rr/e2 p99", "ll/e2 mean", "ll/e2 p99", "e2 decisions"], rows,
            title=f"[Preble Fig. 7 analogue] {name}: {args.requests} requests ({args.pattern}), {args.engines}x "
                  f"{args.cost_model} (sim), KV {args.kv_tokens or 'cost model'} tokens/engine, seed {args.seed}"))
    return "\n\n".join(out)


ABLATION = (
    ("round-robin", "round-robin", None, "fcfs"),
    ("e2 alone", "e2", E2Config(rebalance=False, replicate=False, pd_balance=False), "fcfs"),
    ("+ rebalancing/replication", "e2", E2Config(pd_balance=False), "fcfs"),
    ("+ P/D balancing", "e2", E2Config(), "fcfs"),
    ("+ local priority queue", "e2", E2Config(), "preble"),
)


def ablation(args) -> str:
    base = ClusterConfig(engines=args.engines, cost_model=args.cost_model, seed=args.seed, latency_ms=(0.0, 0.0),
                         kv_cache_tokens=args.kv_tokens)
    rows = []
    ref = None
    for label, pol, cfg, local in ABLATION:
        obj = E2Policy(cfg) if cfg is not None else None
        r = run_one("toolbench", args.requests, args.rate, replace(base, policy=pol, local_policy=local), policy=obj,
                    pattern=args.pattern, seed=args.seed)
        ref = ref or r
        rows.append([label, r["mean"], r["p99"], ref["mean"] / r["mean"], ref["p99"] / r["p99"],
                     ", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items()))])
    return format_table(["variant", "mean s", "p99 s", "rr/variant mean", "rr/variant p99", "decisions"], rows,
                        title=f"[Preble §5.4 ablation] toolbench Zipf-1.1, {args.requests} requests at {args.rate:g}/s "
                              f"({args.pattern}), {args.engines}x {args.cost_model} (sim), KV "
                              f"{args.kv_tokens or 'cost model'} tokens/engine, seed {args.seed}")


def speed(args) -> str:
    """Decisions per second of E2's global path (place(): sync + match + costs + insert) on a toolbench tree."""
    tok = WordTokenizer()
    reqs = workload("toolbench", args.requests, 1000.0, args.seed)
    ids = [tuple(tok.encode(r.prompt)) for r in reqs]
    cost = StepCost(0.025, 1.45e-4, 1.37e-6, 1.45e-4)
    engines = {f"e{i}": EngineView(f"e{i}", "m", 4096, None, 50_000, (), step_cost=cost) for i in range(args.engines)}
    policy = E2Policy(E2Config(window_s=args.window_s))
    info = SchedInfo()
    names = tuple(engines)
    t0 = time.perf_counter()
    for i, (r, toks) in enumerate(zip(reqs, ids)):
        req = DispatchRequest(f"r{i}", prompt_tokens=len(toks), max_new_tokens=r.max_tokens, prompt_token_ids=toks)
        cluster = ClusterView(engines, now=i / args.rate)
        policy.place([QueuedRequest(i, req, info, i / args.rate, names)], cluster)
    dt = time.perf_counter() - t0
    mean_len = statistics.mean(len(t) for t in ids)
    return (f"E2 global decisions: {len(ids) / dt:,.0f} req/s ({dt / len(ids) * 1e6:.0f} us each) over {len(ids)} "
            f"toolbench requests (mean prompt {mean_len:.0f} tokens), {args.engines} engines, arrivals at "
            f"{args.rate:g}/s virtual, window {args.window_s:g} s; tree {policy.tree.num_nodes} nodes; "
            f"decisions {dict(sorted(policy.counts.items()))}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("speed", "sim", "ablation"))
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--cost-model", default="llama7b-a6000")
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV pool per engine (default: the cost model's)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rates", default="2,4,8")
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--pattern", default="poisson", choices=("poisson", "bursty"))
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.what == "speed":
        if args.requests == 300:
            args.requests = 6000
        if args.rate == 8.0:
            args.rate = 3000.0
        print(speed(args))
    elif args.what == "sim":
        print(sim(args))
    else:
        print(ablation(args))


if __name__ == "__main__":
    main()
