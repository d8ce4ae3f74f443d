"""Preble's experiments on simulated engines: E2 vs round-robin vs least-loaded vs the oracle partition (Fig. 7
analogue), the ablation (§5.4), and the global scheduler's decision speed.

    python -m parrot.sim.preble_experiments sim [--engines 4] [--cost-model llama7b-a6000] [--workloads toolbench,...]
                                                [--rates 2,4,8] [--requests 300] [--pattern poisson|bursty]
                                                [--scale 1 --out-scale 1 --max-out N]
    python -m parrot.sim.preble_experiments ablation [--engines 4] [--rate 8] [--requests 400]
    python -m parrot.sim.preble_experiments speed [--requests 6000] [--engines 8]

``sim`` runs each workload of :mod:`parrot.workloads.preble` through the real manager (OpenAI completion path,
no declared structure) over N simulated engines, one fresh virtual cluster per (policy, rate), and prints mean /
p99 request latency and the ratios baseline / e2 measured in the same run. Conditions are printed with the tables.
``--scale`` / ``--out-scale`` / ``--max-out`` shape the simulated workload as the real benchmark
(``python -m parrot.bench.preble_bench real``) shapes its own (prompt sizes, output lengths x out-scale capped at
max-out), so the simulator can replay the real benchmark's setting. ``--json PATH`` saves the results.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from dataclasses import replace

from parrot.common.report import format_table, p99, save_json
from parrot.common.step_cost import StepCost
from parrot.manager.perf_deduction import SchedInfo
from parrot.manager.policies import E2Config, E2Policy
from parrot.manager.policies.base import ClusterView, DispatchRequest, EngineView, QueuedRequest
from parrot.manager.policies.oracle import OraclePartitionPolicy, prompt_group_lookup
from parrot.sim.cluster import ClusterConfig, SimCluster
from parrot.sim.cost_model import load_model
from parrot.sim.tokenizer import WordTokenizer
from parrot.sim.vloop import run_virtual
from parrot.workloads.azure_trace import azure_mixed, load_trace
from parrot.workloads.preble import WORKLOADS, Request, workload

log = logging.getLogger(__name__)


def requests_of(name: str, n: int, rate: float, seed: int = 0, pattern: str = "poisson", scale: float = 1.0,
                window: int = 4096) -> list[Request]:
    """The request stream of ``name``: one of the five workloads (Poisson / bursty at ``rate``), or ``azure``
    (Preble 5.3: the Azure trace's arrivals, code -> Tool and conversation -> VideoQA requests, inter-arrivals scaled
    so that the mean rate is ``rate``)."""
    if name != "azure":
        return workload(name, n, rate, seed, pattern, scale=scale, window=window)
    rows = load_trace()[:n]
    trace_rate = (len(rows) - 1) / max(1e-9, rows[-1].t_s - rows[0].t_s)
    return azure_mixed(n, seed, time_scale=trace_rate / rate, scale=scale, trace=rows)


def oracle_for(reqs: list[Request], vocab_size: int = 32000) -> OraclePartitionPolicy:
    """Preble 5.2's oracle partition for this stream: each request's group (its tool, episode, problem, video,
    document: the key-portion node) known offline by its prompt's token ids as the simulated engines tokenize them."""
    tok = WordTokenizer(vocab_size)
    groups: dict[tuple[int, ...], str] = {}
    for r in reqs:
        ids = tok.encode(r.prompt)
        groups[tuple(ids)] = groups[(tok.bos_token_id, *ids)] = r.group
    return OraclePartitionPolicy(prompt_group_lookup(groups))


def run_one(name: str, n: int, rate: float, config: ClusterConfig, *, policy=None, pattern: str = "poisson",
            seed: int = 0, scale: float = 1.0, out_scale: float = 1.0, max_out: int | None = None) -> dict:
    """Latencies of ``n`` requests of workload ``name`` at ``rate``/s on a fresh simulated cluster; prompt sizes x
    ``scale``, outputs x ``out_scale`` (at least 1, at most ``max_out``). ``policy="oracle"``: the oracle partition
    of this very stream."""
    reqs = requests_of(name, n, rate, seed, pattern, scale, window=load_model(config.cost_model).max_model_len)
    if policy == "oracle":
        policy = oracle_for(reqs)
    if out_scale != 1.0 or max_out is not None:
        reqs = [replace(r, max_tokens=max(1, min(max_out or r.max_tokens, round(r.max_tokens * out_scale))))
                for r in reqs]

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
            oracle = {"oracle_groups": pol.num_groups, "oracle_unknown": pol.num_unknown} \
                if isinstance(pol, OraclePartitionPolicy) else {}
            return {"mean": statistics.mean(lat), "p99": p99(lat), "busy": [s["busy_s"] for s in stats.values()],
                    "evicted_blocks": sum(e.pool.num_evicted for e in cluster.engines),
                    "preemptions": sum(s["preemptions"] for s in stats.values()),
                    "hit_blocks": sum(s["prefix_hit_blocks"] for s in stats.values()),
                    "tokens": sum(s["tokens"] for s in stats.values()),
                    "decisions": dict(e2.counts) if e2 is not None else {},
                    "notices_applied": e2.notices_applied if e2 is not None else 0, **oracle}

    return run_virtual(main())


def _decisions(r: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items()))


def sim(args) -> tuple[str, dict]:
    base = ClusterConfig(engines=args.engines, cost_model=args.cost_model, seed=args.seed, latency_ms=(0.0, 0.0),
                         kv_cache_tokens=args.kv_tokens,
                         latency_cap_tokens=min(ClusterConfig.latency_cap_tokens, args.kv_tokens or 1 << 30))
    policies = ("e2", "round-robin", "least-loaded", "oracle")  # oracle: Preble 5.2's oracle partition
    out, data = [], []
    for name in args.workloads.split(","):
        rows = []
        for rate in (float(r) for r in args.rates.split(",")):
            res = {p: run_one(name, args.requests, rate, replace(base, policy="least-loaded" if p == "oracle" else p),
                              policy="oracle" if p == "oracle" else None, pattern=args.pattern, seed=args.seed,
                              scale=args.scale, out_scale=args.out_scale, max_out=args.max_out)
                   for p in policies}
            data.append({"workload": name, "rate": rate, "policies": res})
            e2 = res["e2"]
            rows.append([f"{rate:g} req/s"] + [res[p][k] for p in policies for k in ("mean", "p99")]
                        + [res[p][k] / e2[k] for p in policies[1:] for k in ("mean", "p99")]
                        + ["/".join(str(res[p]["evicted_blocks"]) for p in policies),
                           "/".join(str(res[p]["preemptions"]) for p in policies),
                           f"{_decisions(e2)}; notices {e2['notices_applied']}"])
        out.append(format_table(
            ["rate", "e2 mean s", "e2 p99 s", "rr mean s", "rr p99 s", "ll mean s", "ll p99 s", "or mean s",
             "or p99 s", "rr/e2 mean", "rr/e2 p99", "ll/e2 mean", "ll/e2 p99", "or/e2 mean", "or/e2 p99",
             "evicted blk e2/rr/ll/or", "preempt e2/rr/ll/or", "e2 decisions"], rows,
            title=f"[Preble Fig. 7 analogue] {name}: {args.requests} requests ({args.pattern}), {args.engines}x "
                  f"{args.cost_model} (sim), KV {args.kv_tokens or 'cost model'} tokens/engine, seed {args.seed}"
                  + (f", prompts x{args.scale:g}" if args.scale != 1.0 else "")
                  + (f", outputs x{args.out_scale:g}" if args.out_scale != 1.0 else "")
                  + (f" capped at {args.max_out}" if args.max_out is not None else "")))
    return "\n\n".join(out), {"runs": data}


ABLATION = (
    ("round-robin", "round-robin", None, "fcfs"),
    ("e2 alone", "e2", E2Config(rebalance=False, replicate=False, pd_balance=False), "fcfs"),
    ("+ rebalancing/replication", "e2", E2Config(pd_balance=False), "fcfs"),
    ("+ P/D balancing", "e2", E2Config(), "fcfs"),
    ("+ local priority queue", "e2", E2Config(), "preble"),
)


def ablation(args) -> tuple[str, dict]:
    base = ClusterConfig(engines=args.engines, cost_model=args.cost_model, seed=args.seed, latency_ms=(0.0, 0.0),
                         kv_cache_tokens=args.kv_tokens)
    rows, data = [], []
    ref = None
    for label, pol, cfg, local in ABLATION:
        obj = E2Policy(cfg) if cfg is not None else None
        r = run_one("toolbench", args.requests, args.rate, replace(base, policy=pol, local_policy=local), policy=obj,
                    pattern=args.pattern, seed=args.seed)
        data.append({"variant": label, **r})
        ref = ref or r
        rows.append([label, r["mean"], r["p99"], ref["mean"] / r["mean"], ref["p99"] / r["p99"], r["evicted_blocks"],
                     r["preemptions"], _decisions(r)])
    text = format_table(["variant", "mean s", "p99 s", "rr/variant mean", "rr/variant p99", "evicted blk",
                         "preempt", "decisions"], rows,
                        title=f"[Preble §5.4 ablation] toolbench Zipf-1.1, {args.requests} requests at "
                              f"{args.rate:g}/s ({args.pattern}), {args.engines}x {args.cost_model} (sim), KV "
                              f"{args.kv_tokens or 'cost model'} tokens/engine, seed {args.seed}")
    return text, {"variants": data}


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
    ap.add_argument("what", choices=("sim", "ablation", "speed"))
    ap.add_argument("--engines", type=int, default=None, help="engines (default: 4; speed 8)")
    ap.add_argument("--cost-model", default="llama7b-a6000")
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV pool per engine (default: the cost model's)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="comma list of " + ", ".join(WORKLOADS) + ", azure (Preble 5.3's trace-driven mix)")
    ap.add_argument("--rates", default="2,4,8", help="sim: req/s list")
    ap.add_argument("--rate", type=float, default=None, help="ablation: req/s (default 8); speed: virtual arrivals")
    ap.add_argument("--requests", type=int, default=None, help="default: sim 300, ablation 400, speed 6000")
    ap.add_argument("--pattern", default="poisson", choices=("poisson", "bursty"))
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--scale", type=float, default=1.0, help="prompt sizes x this")
    ap.add_argument("--out-scale", type=float, default=1.0, help="output lengths x this")
    ap.add_argument("--max-out", type=int, default=None, help="output lengths capped at this")
    ap.add_argument("--json", default=None, help="save the results as JSON here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.engines = args.engines or (8 if args.what == "speed" else 4)
    if args.scale <= 0 or args.out_scale <= 0 or (args.max_out is not None and args.max_out < 1):
        ap.error("--scale and --out-scale must be > 0, --max-out >= 1")
    if args.what == "speed":
        args.requests = args.requests or 6000
        args.rate = args.rate or 3000.0
        text, data = speed(args), None
    else:
        args.requests = args.requests or (300 if args.what == "sim" else 400)
        args.rate = args.rate or 8.0
        text, data = sim(args) if args.what == "sim" else ablation(args)
    print(text)
    if args.json and data is not None:
        save_json(args.json, {"command": "python -m parrot.sim.preble_experiments " + " ".join(argv or sys.argv[1:]),
                              "args": vars(args), **data})
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
