"""Multi-agent programming (paper §8.4, Fig. 18) on the real engine: Parrot vs the request-centric latency- and
throughput-centric baselines, with the ablation (task groups, dynamic prefix sharing, shared-prefix kernel).

    python -m parrot.bench.multi_agent_bench [--files 4] [--design 24 --code 16 --review 8] [--repeats 1]

Every variant runs on a fresh ``parrot serve --engines 1`` (one engine process with one torch thread)
with the same seeded workflow (:mod:`parrot.workloads.multi_agent`): Parrot variants drive it through the Parrot
frontend (every step submitted up front, every output fetched for LATENCY: each role's message is shown as it
comes), the baselines through the LangChain-style client (one completion per step, one emulated round trip per
call, no structure: no dynamic prefix sharing, no engine prefix cache, the engine's plain paged attention).

Variants and what each switches (server flags / engine environment):

    parrot                 --policy parrot (the engine's shared-prefix kernel: auto, on where it measures faster)
    parrot kernel-on       PARROT_ENGINE_SHARED_PREFIX_ATTENTION=on
    parrot no-kernel       PARROT_ENGINE_SHARED_PREFIX_ATTENTION=off
    parrot no-sharing      PARROT_PREFIX_SHARING=false, PARROT_ENGINE_ENABLE_PREFIX_CACHE=false, no kernel
    parrot no-task-groups  --policy parrot-no-task-groups
    throughput-centric     --policy fifo-throughput (baseline client, no sharing, no cache, no kernel)
    latency-centric        --policy fifo-latency    (the same, latency cap)

Ratios are ``variant / parrot`` (above 1: Parrot faster), measured in the same run. Prints the table and its
conditions (CPU included) and saves JSON under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

from parrot.bench.cluster_bench import Cluster, _warm_up
from parrot.bench.machine import describe_cpu
from parrot.common.report import format_conditions, format_table, save_json
from parrot.common.template import parse_template, render_template
from parrot.frontend.client import connect
from parrot.frontend.function import Output, SemanticFunction
from parrot.workloads.apps import DEFAULT_DOCUMENT, Const, load_document
from parrot.workloads.baseline_client import BaselineClient, EmulatedLatency
from parrot.workloads.cluster_mix import Workload
from parrot.workloads.multi_agent import OUT, AgentSizes, Workflow, metagpt_workflow

log = logging.getLogger(__name__)

APP_TIMEOUT_S = 3600.0
BASELINE_ENV = {"PARROT_PREFIX_SHARING": "false", "PARROT_ENGINE_ENABLE_PREFIX_CACHE": "false",
                "PARROT_ENGINE_SHARED_PREFIX_ATTENTION": "off"}
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {  # name -> (policy, environment of the server and engine)
    "parrot": ("parrot", {}),
    "parrot kernel-on": ("parrot", {"PARROT_ENGINE_SHARED_PREFIX_ATTENTION": "on"}),
    "parrot no-kernel": ("parrot", {"PARROT_ENGINE_SHARED_PREFIX_ATTENTION": "off"}),
    "parrot no-sharing": ("parrot", BASELINE_ENV),
    "parrot no-task-groups": ("parrot-no-task-groups", {}),
    "throughput-centric": ("fifo-throughput", BASELINE_ENV),
    "latency-centric": ("fifo-latency", BASELINE_ENV),
}


@contextmanager
def _environment(env: dict[str, str]):
    """``env`` set for the server process started inside (it inherits os.environ), restored afterwards."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_parrot_workflow(wf: Workflow, url: str, latency: EmulatedLatency) -> float:
    """Submit every step, fetch every output for LATENCY, wait for the final files (one round trip)."""
    session = connect(url, make_default=False)
    try:
        funcs = {s.name: SemanticFunction(s.template, name=s.name, defaults=Output(
            max_tokens=s.max_tokens, ignore_eos=True, temperature=0.0, stop=[])) for s in wf.steps}
        t0 = time.perf_counter()
        rtt = latency.sample_s()
        time.sleep(rtt / 2)
        outputs = {}
        for s in wf.steps:
            args = {k: ref.text if isinstance(ref, Const) else outputs[ref.step] for k, ref in s.inputs}
            outputs[s.name] = funcs[s.name](session=session, **args)
        for var in outputs.values():
            session.poll_variable(var.id, "latency", 0.0)
        for name in wf.finals:
            outputs[name].get(perf="latency", timeout=APP_TIMEOUT_S)
        time.sleep(rtt / 2)
        return time.perf_counter() - t0
    finally:
        session.close()


async def run_baseline_workflow(wf: Workflow, url: str, latency: EmulatedLatency) -> float:
    """Render and call each step once its inputs are back on the client (parallel steps concurrently)."""
    async with BaselineClient(url, latency=latency) as client:
        t0 = time.perf_counter()
        tasks: dict[str, asyncio.Future[str]] = {}

        async def step_call(s) -> str:
            values = {k: ref.text if isinstance(ref, Const) else await tasks[ref.step] for k, ref in s.inputs}
            prompt = render_template(parse_template(s.template), values, until=OUT)
            return await client.acomplete(prompt, max_tokens=s.max_tokens, ignore_eos=True)

        for s in wf.steps:
            tasks[s.name] = asyncio.ensure_future(step_call(s))
        await asyncio.gather(*(tasks[n] for n in wf.finals))
        return time.perf_counter() - t0


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    words = load_document(DEFAULT_DOCUMENT).split()
    rng = random.Random(args.seed)
    start = rng.randrange(0, len(words) - args.task_words)
    task = " ".join(words[start:start + args.task_words])
    sizes = AgentSizes(design=args.design, code=args.code, review=args.review, rounds=args.rounds)
    w = Workload(latency_cap=args.latency_cap, throughput_cap=args.throughput_cap)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {}
    for variant in args.variants:
        policy, env = VARIANTS[variant]
        with _environment(env):
            cluster = Cluster(policy, 1, w, args, out / "multi_agent_bench-server.log")
        with cluster:
            _warm_up(cluster.url, 1)
            latency = EmulatedLatency(tuple(args.latency_ms), args.seed)
            for rep in range(args.repeats):
                wf = metagpt_workflow(args.files, task, sizes, tag=f"[project {args.seed}-{variant}-{rep}] ")
                if policy.startswith("fifo"):
                    t = asyncio.run(run_baseline_workflow(wf, cluster.url, latency))
                else:
                    t = run_parrot_workflow(wf, cluster.url, latency)
                times.setdefault(variant, []).append(t)
                log.warning("%s run %d: %.2f s", variant, rep, t)
    return times


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--design", type=int, default=24, help="architect output tokens")
    p.add_argument("--code", type=int, default=16, help="code tokens per file (coders and revisers)")
    p.add_argument("--review", type=int, default=8, help="review tokens per file")
    p.add_argument("--rounds", type=int, default=3, help="review-and-revise rounds (the paper: 3)")
    p.add_argument("--task-words", type=int, default=30)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--latency-ms", nargs=2, type=float, default=[200.0, 300.0], metavar=("LOW", "HIGH"))
    p.add_argument("--latency-cap", type=int, default=256, help="latency cap (tokens) of the latency baseline")
    p.add_argument("--throughput-cap", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    if min(args.files, args.design, args.code, args.review, args.rounds, args.repeats) < 1:
        p.error("--files, the output lengths, --rounds and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    started = time.strftime("%Y%m%d-%H%M%S")
    times = measure(args)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    base = med.get("parrot")
    rows = [[v, med[v], (med[v] / base) if base else "-", " ".join(f"{t:.2f}" for t in times[v])] for v in times]
    wf = metagpt_workflow(args.files, "", AgentSizes(args.design, args.code, args.review, args.rounds))
    conditions = {"files": args.files, "calls per run": wf.num_calls, "output tokens per run": wf.output_tokens,
                  "outputs (design / code / review)": f"{args.design} / {args.code} / {args.review}",
                  "rounds": args.rounds, "latency_ms": tuple(args.latency_ms), "latency cap": args.latency_cap,
                  "throughput cap": args.throughput_cap, "engine torch threads": 1,
                  "repeats": args.repeats, "seed": args.seed, **describe_cpu()}
    print(format_table(["variant", "e2e s (median)", "variant / parrot", "runs s"], rows,
                       title=f"[multi-agent, real engine] MetaGPT-style workflow, {args.files} files, 1 engine"))
    print(format_conditions(conditions))
    path = save_json(str(Path(args.out) / f"multi_agent_bench-{started}.json"),
                     {"conditions": conditions, "times_s": times, "median_s": med, "args": vars(args)})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
