"""Flows (docs/flows.md) at paper scale on the simulator: the real Manager's flow engine over simulated GPU engines.

    python -m parrot.sim.flow_experiments [agent|router|all] [--quick] [--seed N] [--cost-model NAME]
        [--engines N] [--save [DIR]]

* **agent**: a ReAct agent of ``iterations`` think -> tool -> observe steps (:func:`parrot.workloads.flows.agent_flow`,
  deterministic: exactly N iterations of exactly ``think_tokens`` tokens), hundreds of agents arriving as a Poisson
  stream, five ways: the whole loop as ONE flow submission (a session, the submit with the question and document
  inline, one get); the same agent as a client loop on the Parrot API (a
  submit of the rendered prompt + a get per iteration, branch / tool / history in the client); the client loop on
  the OpenAI-style completion API (one call per iteration); and the Parrot client loop without emulated latency.
  Every client call pays an emulated Internet round trip (paper §8.1, uniform 200-300 ms): half before it reaches
  the service, half after its answer leaves. Reported: mean / p99 end-to-end latency per agent and the ratios
  client / flow.
* **router**: the router app (:func:`parrot.workloads.flows.router_flow`: a router generate, then one of three
  handler generates) with decisions drawn 80/15/5 (seeded; see the workloads module for why the decision is a
  seeded input joined to the router's output), a Poisson stream of requests, speculation on vs off (the flow body's
  ``speculate``), after the same warm-up of the branch profile. Reported: mean / p99 latency (all, majority label,
  the others), hits / misses / wasted tokens (``Manager.stats()["flows"]``).

Every run is a fresh cluster on a fresh virtual loop; everything is deterministic for a seed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from parrot.common.report import format_table, p99, ratio, save_json
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from parrot.sim.cluster import ClusterConfig, SimCluster
from parrot.sim.vloop import run_virtual
from parrot.workloads import synth as W
from parrot.workloads.arrivals import poisson_arrivals
from parrot.workloads.flows import (
    AGENT_MODES,
    MODE_BASE,
    AgentConfig,
    RouterConfig,
    agent_flow,
    agent_questions,
    build_router_flow,
    counter_delta,
    escape_literal,
    router_requests,
    run_client_agent,
    speculation_counters,
    write_section,
)

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class AgentExperiment:
    agents: int = 300
    rate: float = 2.0             # agents per second (Poisson)
    iterations: int = 8
    think_tokens: int = 48
    doc_tokens: int = 1500        # the document search_text reads (observations are its sentences)
    engines: int = 4
    cost_model: str = "llama13b-a100"
    latency_ms: tuple[float, float] = (200.0, 300.0)


@dataclass(frozen=True)
class RouterExperiment:
    requests: int = 400
    rate: float = 8.0
    warmup: int = 10              # sequential requests before the stream (the branch profile's history)
    router_tokens: int = 16
    reply_tokens: int = 128
    probs: tuple[float, ...] = (0.8, 0.15, 0.05)
    engines: int = 4
    cost_model: str = "llama13b-a100"


QUICK_AGENT = AgentExperiment(agents=24, rate=2.0, iterations=6, think_tokens=32, doc_tokens=600, engines=2)
QUICK_ROUTER = RouterExperiment(requests=60, rate=6.0, warmup=8, engines=2)


def _run(config: ClusterConfig, body):
    """``body(cluster)`` on a fresh cluster on a fresh virtual loop (:func:`parrot.sim.vloop.run_virtual`)."""

    async def main():
        async with SimCluster(config) as cluster:
            return await body(cluster)

    return run_virtual(main())


def _document(tokens: int, seed: int) -> str:
    """Seeded sentences of ~12-25 words (search_text returns sentences)."""
    rng = random.Random(f"flow-doc:{seed}")
    sents, total = [], 0
    while total < tokens:
        s = W.synth_text(rng.randint(15, 30), rng)
        sents.append(s[0].upper() + s[1:] + ".")
        total += len(s.split()) * W.TOKENS_PER_WORD
    return " ".join(sents)


class _Rtt:
    """Per-call emulated round trips on the virtual clock: half before the call reaches the service, half after
    its answer leaves it (0 when off)."""

    def __init__(self, cluster: SimCluster, on: bool) -> None:
        self.cluster, self.on, self.calls = cluster, on, 0

    async def call(self, fn, *args):
        self.calls += 1
        trip = self.cluster.sample_rtt() if self.on else 0.0
        await asyncio.sleep(trip / 2)
        out = fn(*args)
        if asyncio.iscoroutine(out):
            out = await out
        await asyncio.sleep(trip / 2)
        return out


class _ParrotAgentApi:
    """The client loop's generate on the Parrot API: a submit of the rendered prompt, then a get."""

    def __init__(self, cluster: SimCluster, session, rtt: _Rtt) -> None:
        self.cluster, self.session, self.rtt = cluster, session, rtt

    async def generate(self, prompt: str, sampling: dict) -> str:
        m = self.cluster.manager
        spec = SubmitSpec(escape_literal(prompt) + "{{output:thought}}",
                          [PlaceholderSpec("thought", True, None, dict(sampling))], name="think")
        req = await self.rtt.call(m.submit, self.session, spec)
        return await self.rtt.call(self.cluster.wait_value, self.session, req.outputs[0])


class _OpenAIAgentApi:
    """The client loop's generate on the completion API: one call (its own round trip) per iteration."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.calls = 0

    async def generate(self, prompt: str, sampling: dict) -> str:
        self.calls += 1
        r = await self.cluster.complete(prompt, sampling["max_tokens"], ignore_eos=True, rtt=True)
        return r.text


async def run_agent(c: SimCluster, mode: str, cfg: AgentConfig, question: str, doc: str) -> tuple[float, int, int]:
    """One agent from now to its final history on the client: (seconds, client calls, iterations)."""
    t0 = c.clock()
    m = c.manager
    if mode == "openai+rtt":
        api = _OpenAIAgentApi(c)
        res = await run_client_agent(api, question, doc, cfg)
        return c.clock() - t0, api.calls, res.iterations
    rtt = _Rtt(c, mode.endswith("+rtt"))
    session = await rtt.call(m.create_session)
    try:
        if mode.startswith("flow"):  # the question and the document inline: no variable to create first
            sub = await rtt.call(m.submit_flow, session, agent_flow(cfg, question=question, doc=doc))
            await rtt.call(c.wait_value, session, sub.outputs["history2"])
            iterations = cfg.max_steps
        else:
            res = await run_client_agent(_ParrotAgentApi(c, session, rtt), question, doc, cfg)
            iterations = res.iterations
        elapsed = c.clock() - t0
    finally:
        await m.delete_session(session)
    return elapsed, rtt.calls, iterations


def agent(quick: bool = False, seed: int = 0, exp: AgentExperiment | None = None) -> tuple[str, dict]:
    exp = exp or (QUICK_AGENT if quick else AgentExperiment())
    cfg = AgentConfig(max_steps=exp.iterations, think_tokens=exp.think_tokens, deterministic=True)
    doc = _document(exp.doc_tokens, seed)
    arrivals = poisson_arrivals(exp.agents, exp.rate, random.Random(f"agent-arrivals:{seed}"))
    ccfg = ClusterConfig(engines=exp.engines, cost_model=exp.cost_model, policy="parrot",
                         latency_ms=exp.latency_ms, seed=seed)
    results: dict[str, dict] = {}
    for k, mode in enumerate(AGENT_MODES):
        # a tag per mode: prompts are as long in every mode, and no mode could reuse another's cache anyway
        questions = agent_questions(exp.agents, seed, doc, tag=f"m{k}-")

        async def body(c: SimCluster, mode=mode, questions=questions):
            loop = asyncio.get_running_loop()

            async def one(at: float, q: str):
                await asyncio.sleep(max(0.0, at - loop.time()))
                return await run_agent(c, mode, cfg, q, doc)

            out = await asyncio.gather(*(one(a, q) for a, q in zip(arrivals, questions)))
            return out, speculation_counters(c.manager.stats()), loop.time()

        out, counters, makespan = _run(ccfg, body)
        lat = [x[0] for x in out]
        results[mode] = {"mean_s": statistics.fmean(lat), "p99_s": p99(lat), "makespan_s": makespan,
                         "calls_per_agent": statistics.fmean(x[1] for x in out),
                         "iterations": statistics.fmean(x[2] for x in out), "flows": counters}
    rows = [[mode, r["mean_s"], r["p99_s"], r["calls_per_agent"], r["iterations"], r["makespan_s"],
             ratio(r["mean_s"], results[MODE_BASE[mode]]["mean_s"])] for mode, r in results.items()]
    table = format_table(["mode", "mean s", "p99 s", "client calls / agent", "iterations", "makespan s",
                          "mean / flow (same RTT)"], rows,
                         title=f"[flows: agent loop] {exp.agents} ReAct agents (Poisson {exp.rate:g}/s), "
                               f"{exp.iterations} iterations x {exp.think_tokens} thought tokens, tools "
                               f"calculator / search_text on a {exp.doc_tokens}-token document; {exp.engines}x "
                               f"{exp.cost_model} (sim), policy parrot; RTT {exp.latency_ms[0]:g}-"
                               f"{exp.latency_ms[1]:g} ms per client call in the +rtt modes")
    return table, {"experiment": exp.__dict__, "modes": results}


async def run_router_request(c: SimCluster, cfg: RouterConfig, query: str, label: str,
                             speculate: bool) -> float:
    """One router request, submit to reply (no emulated round trip: the same in both arms)."""
    t0 = c.clock()
    m = c.manager
    session = m.create_session()
    try:
        q = m.create_variable(session, "query", query)
        lab = m.create_variable(session, "label", label)
        sub = m.submit_flow(session, build_router_flow(cfg, q.var_id, lab.var_id, speculate=speculate))
        await c.wait_value(session, sub.outputs["reply"])
        return c.clock() - t0
    finally:
        await m.delete_session(session)


def router(quick: bool = False, seed: int = 0, exp: RouterExperiment | None = None) -> tuple[str, dict]:
    exp = exp or (QUICK_ROUTER if quick else RouterExperiment())
    rcfg = RouterConfig(router_tokens=exp.router_tokens, reply_tokens=exp.reply_tokens, probs=exp.probs)
    warm = router_requests(exp.warmup, seed + 10_000, replace(rcfg, probs=(1.0, 0.0, 0.0)), tag="w")
    reqs = router_requests(exp.requests, seed, rcfg, tag="r")
    arrivals = poisson_arrivals(exp.requests, exp.rate, random.Random(f"router-arrivals:{seed}"))
    ccfg = ClusterConfig(engines=exp.engines, cost_model=exp.cost_model, policy="parrot", seed=seed)
    majority = rcfg.labels[max(range(len(rcfg.probs)), key=rcfg.probs.__getitem__)]
    results: dict[str, dict] = {}
    for arm, spec in (("speculation on", True), ("speculation off", False)):
        async def body(c: SimCluster, spec=spec):
            # outputs streamed, as in a real server: a cancelled speculated handler has counted the tokens it
            # generated (SimCluster turns streaming off for speed: a whole output arrives at once there)
            c.manager.executor.stream_outputs = True
            loop = asyncio.get_running_loop()
            for q, lab in warm:  # the branch profile's history (min_runs), the same in both arms
                await run_router_request(c, rcfg, q, lab, spec)
            before = speculation_counters(c.manager.stats())
            t0 = loop.time()

            async def one(at: float, q: str, lab: str):
                await asyncio.sleep(max(0.0, t0 + at - loop.time()))
                return await run_router_request(c, rcfg, q, lab, spec)

            lat = await asyncio.gather(*(one(a, q, lab) for a, (q, lab) in zip(arrivals, reqs)))
            return list(lat), counter_delta(speculation_counters(c.manager.stats()), before)

        lat, counters = _run(ccfg, body)
        maj = [x for x, (_, lab) in zip(lat, reqs) if lab == majority]
        rest = [x for x, (_, lab) in zip(lat, reqs) if lab != majority]
        results[arm] = {"mean_s": statistics.fmean(lat), "p99_s": p99(lat),
                        "majority_mean_s": statistics.fmean(maj) if maj else None,
                        "others_mean_s": statistics.fmean(rest) if rest else None, **counters}
    off = results["speculation off"]["mean_s"]
    rows = [[arm, r["mean_s"], r["p99_s"], r["majority_mean_s"], r["others_mean_s"], r["hit"], r["miss"],
             r["wasted_tokens"], ratio(off, r["mean_s"])] for arm, r in results.items()]
    counts = {lab: sum(1 for _, x in reqs if x == lab) for lab in rcfg.labels}
    table = format_table(["arm", "mean s", "p99 s", f"mean s ({majority})", "mean s (others)", "hits", "misses",
                          "wasted tokens", "off / arm"], rows,
                         title=f"[flows: router speculation] {exp.requests} requests (Poisson {exp.rate:g}/s), "
                               f"decisions {'/'.join(f'{p * 100:g}' for p in exp.probs)} seeded ("
                               + ", ".join(f"{k} {v}" for k, v in counts.items())
                               + f"), router {exp.router_tokens} tokens, handlers {exp.reply_tokens} tokens; "
                               f"{exp.warmup} warm-up requests; {exp.engines}x {exp.cost_model} (sim); no RTT")
    return table, {"experiment": exp.__dict__, "labels": counts, "arms": results}


EXPERIMENTS = {"agent": agent, "router": router}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", default="all", choices=[*EXPERIMENTS, "all"])
    p.add_argument("--quick", action="store_true", help="smaller workloads (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost-model", default=None, help="override the cost model (default llama13b-a100)")
    p.add_argument("--engines", type=int, default=None)
    p.add_argument("--save", default=None, nargs="?", const="docs/results",
                   help="write the results to DIR/flows.json (key 'sim') and the simulator section of DIR/flows.md "
                        "(default DIR: docs/results)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    saved: dict = {"command": "python -m parrot.sim.flow_experiments " + " ".join(argv if argv is not None
                                                                                   else sys.argv[1:]),
                   "seed": args.seed}
    texts = []
    for name in (list(EXPERIMENTS) if args.name == "all" else [args.name]):
        t = time.perf_counter()
        base = {"agent": QUICK_AGENT if args.quick else AgentExperiment(),
                "router": QUICK_ROUTER if args.quick else RouterExperiment()}[name]
        over = {k: v for k, v in {"cost_model": args.cost_model, "engines": args.engines}.items() if v is not None}
        table, data = EXPERIMENTS[name](quick=args.quick, seed=args.seed, exp=replace(base, **over))
        print(table)
        print(f"  ({name}: {time.perf_counter() - t:.1f} s wall)\n", flush=True)
        saved[name] = data
        texts.append(table)
    if args.save:
        save_results(Path(args.save), saved, texts)
    return 0


def save_results(out: Path, saved: dict, texts: list[str]) -> None:
    """``saved`` under key ``sim`` of ``out/flows.json`` (other keys kept), the tables as the ``sim`` section of
    ``out/flows.md``."""
    path = out / "flows.json"
    runs = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    runs["sim"] = saved
    save_json(str(path), runs)
    write_section(out / "flows.md", "sim", "## Simulator (`flows.json` → `sim`)\n\n`" + saved["command"].strip()
                  + "` (virtual time; deterministic for the seed)\n\n```text\n" + "\n\n".join(texts) + "\n```")


if __name__ == "__main__":
    sys.exit(main())
