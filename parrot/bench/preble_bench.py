"""Preble's workloads on real engines: E2 vs round-robin vs least-loaded, each policy behind its own manager over
`parrot engine` processes (:mod:`parrot.bench.preble_real`; the simulated runs, the ablation and the decision speed
are :mod:`parrot.sim.preble_experiments`).

    python -m parrot.bench.preble_bench real [--engines 2] [--kv-tokens 2048] [--workloads toolbench,...]
                                             [--rates R1,R2 (default: per workload)] [--requests 20] [--scale 0.1]

The workloads are scaled down (one torch thread per engine, a small KV pool). ``--json PATH`` saves the results.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import subprocess
import sys
from pathlib import Path

from parrot.common.report import format_conditions, save_json
from parrot.workloads.preble import WORKLOADS


REAL_RATES = {  # req/s per workload on 2 engines (one thread each, AVX2 EPYC): a light and a heavy load
    "toolbench": (0.75, 1.5), "embodied": (0.75, 1.5), "programming": (0.5, 1.0), "videoqa": (0.75, 1.5),
    "loogle": (0.75, 1.5),
}


def real(args) -> tuple[str, dict]:
    from parrot.bench.machine import describe_cpu
    from parrot.bench.preble_real import RealConfig, report, run_all

    cfg = RealConfig(engines=args.engines, kv_tokens=args.kv_tokens or RealConfig.kv_tokens,
                     scale=args.scale, requests=args.requests or RealConfig.requests, model=args.model,
                     seed=args.seed, local_policy=args.local_policy)
    names = args.workloads.split(",")
    rates = {n: [float(r) for r in args.rates.split(",")] if args.rates else list(REAL_RATES[n]) for n in names}
    data = run_all(cfg, rates, Path(args.out))
    conditions = {"date": datetime.date.today().isoformat(), "code": _commit(), **describe_cpu(),
                  "cores": os.cpu_count(), "model": data["model"], "engines per cluster": cfg.engines,
                  "engine threads": 1, "KV per engine": f"{data['kv_blocks_per_engine']} blocks x "
                  f"{data['block_size']} = {data['kv_blocks_per_engine'] * data['block_size']} tokens",
                  "engine wait queue": cfg.local_policy, "prompt scale": cfg.scale,
                  "outputs": f"x{cfg.out_scale}, at most {cfg.max_out}", "requests per run": cfg.requests,
                  "rates": "; ".join(f"{n} {'/'.join(f'{r:g}' for r in rs)} req/s" for n, rs in rates.items()),
                  "startup + warm-up s": round(data["startup_s"], 1), "total s": round(data["total_s"], 1)}
    data["conditions"] = conditions
    return format_conditions(conditions) + "\n\n" + report(data), data


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("real",))
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV pool per engine (default 2048)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of " + ", ".join(WORKLOADS))
    ap.add_argument("--rates", default=None, help="req/s list (default: per workload)")
    ap.add_argument("--requests", type=int, default=None, help="per run (default 20)")
    ap.add_argument("--scale", type=float, default=0.1, help="prompt sizes x this")
    ap.add_argument("--engine-policy", dest="local_policy", default="fcfs", choices=("fcfs", "preble"),
                    help="the engines' --engine-policy (their wait queue; paused contexts preserved)")
    ap.add_argument("--model", default=None, help="engine model (default: SmolLM2-135M)")
    ap.add_argument("--out", default="bench_out", help="engine logs go here")
    ap.add_argument("--json", default=None, help="save the results as JSON here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.scale <= 0:
        ap.error("--scale must be > 0")
    text, data = real(args)
    print(text)
    if args.json:
        save_json(args.json, {"command": "python -m parrot.bench.preble_bench " + " ".join(argv or sys.argv[1:]),
                              "args": vars(args), **data})
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
