"""Flows (docs/flows.md) on a real server: an agent loop as one flow submission vs the same agent driven by a
client, and branch speculation on a router app.

    flock /tmp/bench.lock .venv/bin/python -m parrot.bench.flow_bench [--quick] [--engines N] [--rtt-ms 250]
        [--agents 4] [--iterations 6] [--think-tokens 24] [--repeats 5] [--router-requests 48] [--router-rate 1]
        [--model PATH] [--out docs/results] [--key NAME] [--tag T]

(i) **agent loop**: ``--agents`` ReAct agents at once (:func:`parrot.workloads.flows.agent_flow`, deterministic:
exactly ``--iterations`` think -> tool (calculator / search_text, chosen by a branch on the thought) -> observe
iterations of exactly ``--think-tokens`` tokens), each mode on one server, modes rotating from repeat to repeat,
fresh questions (a unique tag) per mode and repeat so the engine's prefix cache never serves a repeat:

    flow+rtt     one flow submission (a session, the submit with the question and document inline, one get of the
                 final history: 3 calls)
    client+rtt   the client loop on the Parrot API: a session, then per iteration a submit of the rendered prompt + a
                 get; branch, tool and history in the client (the server's own tool functions)
    openai+rtt   the client loop on /v1/completions: one call per iteration
    flow, client the same two without emulated latency (localhost HTTP only)

Every HTTP call of the ``+rtt`` modes pays an emulated Internet round trip of ``--rtt-ms`` (paper §8.1): half
slept before the call, half after its answer. Reported: end-to-end seconds of the batch (all agents) and the mean
per agent, and the ratios mode / flow on the same network (client+rtt and openai+rtt over flow+rtt, client over
flow).

(ii) **router speculation**: the router app (:func:`parrot.workloads.flows.router_flow`, decisions 80/15/5 drawn
with a seed; the workloads module explains the seeded decision) on two servers, ``--flow-speculation`` and
``--no-flow-speculation``: the same warm-up requests (the branch profile), then ``--router-requests`` at a Poisson
``--router-rate``. Reported: mean / p99 latency (all, majority label, others), speculation hits / misses / wasted
tokens from ``GET /api/v1/stats`` -> ``flows`` (deltas over the measured requests).

Writes ``<out>/flows.json`` (this run under ``--key``, default ``<cpu path>-<cpu>``; other keys kept) and the real
section of ``<out>/flows.md``; ``--quick`` (tiny random model, seconds) writes under $TMPDIR instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from parrot.bench.load_bench import start_server
from parrot.common.report import format_table, p99, ratio, save_json
from parrot.backends.llama_server import stop_process
from parrot.workloads.apps import DEFAULT_DOCUMENT, load_document
from parrot.workloads.arrivals import poisson_arrivals
from parrot.workloads.baseline_client import EmulatedLatency
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
POLL_S = 60.0


class FlowBenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class BenchConfig:
    agents: int = 4
    iterations: int = 6
    think_tokens: int = 24
    repeats: int = 5
    rtt_ms: float = 250.0
    doc_sentences: int = 40           # the document search_text reads: the first sentences of the example text
    router_requests: int = 48
    router_rate: float = 1.0
    router_warmup: int = 20
    router_tokens: int = 8
    reply_tokens: int = 32
    probs: tuple[float, ...] = (0.8, 0.15, 0.05)
    engines: int = 0                  # 0: the server's in-process engine; N: --engines N processes
    model: str | None = None          # None: the default SmolLM2-135M
    random_model: str | None = None   # quick: "tiny"
    modes: tuple[str, ...] = AGENT_MODES
    seed: int = 0


QUICK = BenchConfig(agents=2, iterations=6, think_tokens=4, repeats=1, doc_sentences=12, router_requests=12,
                    router_rate=8.0, router_warmup=6, router_tokens=3, reply_tokens=6, random_model="tiny")


# ---- HTTP with emulated round trips -----------------------------------------------------------------------------
class Api:
    """The Parrot HTTP API with an emulated round trip per call (``latency`` None: none)."""

    def __init__(self, http: httpx.AsyncClient, latency: EmulatedLatency | None) -> None:
        self.http, self.latency = http, latency
        self.calls = 0
        self.headers: dict[str, str] = {}
        self.base = ""

    async def call(self, method: str, path: str, **kw) -> dict:
        self.calls += 1
        rtt = self.latency.sample_s() if self.latency is not None else 0.0
        await asyncio.sleep(rtt / 2)
        r = await self.http.request(method, path, headers=self.headers, **kw)
        await asyncio.sleep(rtt / 2)
        if r.status_code >= 400:
            raise FlowBenchError(f"{method} {path}: {r.status_code} {r.text[:300]}")
        return r.json()

    async def open(self) -> None:
        s = await self.call("POST", "/api/v1/sessions", json={"ttl_s": 3600})
        self.headers = {"X-Parrot-Session-Token": s["token"]}
        self.base = f"/api/v1/sessions/{s['session_id']}"

    async def close(self) -> None:  # not timed, no round trip: the answer is already on the client
        try:
            await self.http.delete(self.base, headers=self.headers)
        except httpx.HTTPError:
            pass

    async def variable(self, name: str, value: str) -> str:
        return (await self.call("POST", f"{self.base}/variables", json={"name": name, "value": value}))["var_id"]

    async def get(self, var_id: str) -> str:
        while True:
            v = await self.call("GET", f"{self.base}/variables/{var_id}",
                                params={"timeout": POLL_S, "criteria": "latency"})
            if v["status"] == "ready":
                return v["value"]

    async def generate(self, prompt: str, sampling: dict) -> str:
        """The client loop's generate: a submit of the rendered prompt, then a get."""
        r = await self.call("POST", f"{self.base}/submit", json={
            "prompt": escape_literal(prompt) + "{{output:thought}}", "name": "think",
            "placeholders": [{"name": "thought", "is_output": True, "sampling": sampling}]})
        return await self.get(r["outputs"]["thought"])


class OpenAIApi:
    """The client loop's generate on /v1/completions: one call (one round trip) per iteration."""

    def __init__(self, http: httpx.AsyncClient, latency: EmulatedLatency, model: str) -> None:
        self.http, self.latency, self.model = http, latency, model
        self.calls = 0

    async def generate(self, prompt: str, sampling: dict) -> str:
        self.calls += 1
        rtt = self.latency.sample_s()
        await asyncio.sleep(rtt / 2)
        r = await self.http.post("/v1/completions", json={
            "model": self.model, "prompt": prompt, "max_tokens": sampling["max_tokens"], "temperature": 0.0,
            "ignore_eos": bool(sampling.get("ignore_eos")), "stop": list(sampling.get("stop") or [])})
        await asyncio.sleep(rtt / 2)
        if r.status_code >= 400:
            raise FlowBenchError(f"/v1/completions: {r.status_code} {r.text[:300]}")
        return r.json()["choices"][0]["text"]


# ---- (i) the agent loop ---------------------------------------------------------------------------------------
async def run_agent(url: str, mode: str, cfg: AgentConfig, question: str, doc: str, latency: EmulatedLatency,
                    model: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        t0 = time.perf_counter()
        if mode == "openai+rtt":
            api_o = OpenAIApi(http, latency, model)
            res = await run_client_agent(api_o, question, doc, cfg)
            return {"s": time.perf_counter() - t0, "calls": api_o.calls, "iterations": res.iterations,
                    "chars": len(res.history)}
        api = Api(http, latency if mode.endswith("+rtt") else None)
        await api.open()
        try:
            if mode.startswith("flow"):  # the question and the document inline: no variable to create first
                sub = await api.call("POST", f"{api.base}/flows", json=agent_flow(cfg, question=question, doc=doc))
                history = await api.get(sub["outputs"]["history2"])
                iterations = cfg.max_steps
            else:
                res = await run_client_agent(api, question, doc, cfg)
                history, iterations = res.history, res.iterations
            elapsed = time.perf_counter() - t0
        finally:
            await api.close()
        return {"s": elapsed, "calls": api.calls, "iterations": iterations, "chars": len(history)}


async def agent_batch(url: str, mode: str, cfg: AgentConfig, questions: list[str], doc: str,
                      latency: EmulatedLatency, model: str) -> dict:
    t0 = time.perf_counter()
    out = await asyncio.gather(*(run_agent(url, mode, cfg, q, doc, latency, model) for q in questions))
    return {"batch_s": time.perf_counter() - t0, "mean_s": statistics.fmean(x["s"] for x in out),
            "calls_per_agent": statistics.fmean(x["calls"] for x in out),
            "iterations": statistics.fmean(x["iterations"] for x in out),
            "history_chars": statistics.fmean(x["chars"] for x in out), "agents_s": [round(x["s"], 3) for x in out]}


def run_agents(url: str, bc: BenchConfig, model: str) -> dict:
    cfg = AgentConfig(max_steps=bc.iterations, think_tokens=bc.think_tokens, deterministic=True)
    doc = " ".join(re.split(r"(?<=[.!?])\s+", load_document(DEFAULT_DOCUMENT).strip())[:bc.doc_sentences])
    latency = EmulatedLatency((bc.rtt_ms, bc.rtt_ms), bc.seed)
    # warm-up (not measured): the engine's first batches, the manager's first flow
    warm = agent_questions(bc.agents, bc.seed + 999, doc, tag="warm-")
    for mode in ("flow", "client"):
        asyncio.run(agent_batch(url, mode, replace(cfg, max_steps=2), warm, doc, EmulatedLatency((0, 0)), model))
    runs: list[dict] = []
    modes = list(bc.modes)
    for r in range(bc.repeats):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        res = {}
        for mode in order:
            questions = agent_questions(bc.agents, bc.seed * 100 + r, doc, tag=f"r{r}m{AGENT_MODES.index(mode)}-")
            res[mode] = asyncio.run(agent_batch(url, mode, cfg, questions, doc, latency, model))
            log.warning("agent repeat %d %s: batch %.2f s, mean %.2f s, %.1f calls/agent", r, mode,
                        res[mode]["batch_s"], res[mode]["mean_s"], res[mode]["calls_per_agent"])
        runs.append({"repeat": r, "order": order, "modes": res})
    summary = {}
    for mode in modes:
        b = [run["modes"][mode]["batch_s"] for run in runs]
        m = [run["modes"][mode]["mean_s"] for run in runs]
        summary[mode] = {"batch_s_median": statistics.median(b), "mean_s_median": statistics.median(m),
                         "calls_per_agent": runs[0]["modes"][mode]["calls_per_agent"],
                         "iterations": runs[0]["modes"][mode]["iterations"]}
    ratios = {mode: {"batch": ratio(s["batch_s_median"], summary[MODE_BASE[mode]]["batch_s_median"]),
                     "mean": ratio(s["mean_s_median"], summary[MODE_BASE[mode]]["mean_s_median"])}
              for mode, s in summary.items() if MODE_BASE[mode] in summary}
    return {"runs": runs, "summary": summary, "ratios_vs_flow": ratios, "config": asdict(cfg),
            "doc_chars": len(doc)}


# ---- (ii) router speculation -------------------------------------------------------------------------------------
async def router_request(url: str, cfg: RouterConfig, query: str, label: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        api = Api(http, None)
        t0 = time.perf_counter()
        await api.open()
        try:
            q = await api.variable("query", query)
            lab = await api.variable("label", label)
            sub = await api.call("POST", f"{api.base}/flows", json=build_router_flow(cfg, q, lab))
            await api.get(sub["outputs"]["reply"])
            return time.perf_counter() - t0
        finally:
            await api.close()


def flow_counters(url: str) -> dict:
    return speculation_counters(httpx.get(f"{url}/api/v1/stats", timeout=30).json())


def run_router(url: str, bc: BenchConfig) -> dict:
    rcfg = RouterConfig(router_tokens=bc.router_tokens, reply_tokens=bc.reply_tokens, probs=bc.probs)
    warm = router_requests(bc.router_warmup, bc.seed + 10_000, rcfg, tag="w")
    reqs = router_requests(bc.router_requests, bc.seed, rcfg, tag="r")
    arrivals = poisson_arrivals(bc.router_requests, bc.router_rate, random.Random(f"router-arrivals:{bc.seed}"))

    async def stream() -> list[float]:
        for q, lab in warm:
            await router_request(url, rcfg, q, lab)
        t0 = time.perf_counter()

        async def one(at: float, q: str, lab: str) -> float:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await router_request(url, rcfg, q, lab)

        before.update(flow_counters(url))
        return list(await asyncio.gather(*(one(a, q, lab) for a, (q, lab) in zip(arrivals, reqs))))

    before: dict = {}
    lat = asyncio.run(stream())
    counters = counter_delta(flow_counters(url), before)
    majority = rcfg.labels[max(range(len(rcfg.probs)), key=rcfg.probs.__getitem__)]
    maj = [x for x, (_, lab) in zip(lat, reqs) if lab == majority]
    rest = [x for x, (_, lab) in zip(lat, reqs) if lab != majority]
    return {"mean_s": statistics.fmean(lat), "p99_s": p99(lat),
            "majority_mean_s": statistics.fmean(maj) if maj else None,
            "others_mean_s": statistics.fmean(rest) if rest else None, **counters,
            "labels": {lab: sum(1 for _, x in reqs if x == lab) for lab in rcfg.labels},
            "latencies_s": [round(x, 4) for x in lat]}


# ---- the run ----------------------------------------------------------------------------------------------------
def serve_flags(bc: BenchConfig) -> list[str]:
    flags: list[str] = []
    if bc.engines:
        flags += ["--engines", str(bc.engines)]
    if bc.random_model:
        flags += ["--random-model", bc.random_model, "--dtype", "float32"]
    elif bc.model:
        flags += ["--model", bc.model]
    return flags


def run_all(bc: BenchConfig) -> dict:
    tmp = os.environ.get("TMPDIR", "/tmp")
    t_start = time.perf_counter()
    data: dict = {"config": asdict(bc)}
    proc, url = start_server(serve_flags(bc), os.path.join(tmp, "flow_bench.serve.log"))
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        data["model"] = model["id"]
        data["numerics"] = next(iter(model.get("numerics", {}).values()), {})
        data["agent"] = run_agents(url, bc, model["id"])
        data["agent"]["flows_stats"] = flow_counters(url)
    finally:
        stop_process(proc)
    data["router"] = {}
    arms = [("speculation on", "--flow-speculation"), ("speculation off", "--no-flow-speculation")]
    for arm, flag in arms if bc.router_requests > 0 else ():  # --router-requests 0: the agent loop only
        proc, url = start_server(serve_flags(bc) + [flag], os.path.join(tmp, f"flow_bench.serve{flag}.log"))
        try:
            data["router"][arm] = run_router(url, bc)
            r = data["router"][arm]
            log.warning("router %s: mean %.3f s, p99 %.3f s, hits %d, misses %d, wasted %d", arm, r["mean_s"],
                        r["p99_s"], r["hit"], r["miss"], r["wasted_tokens"])
        finally:
            stop_process(proc)
    data["total_s"] = time.perf_counter() - t_start
    data["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    return data


def conditions(data: dict, bc: BenchConfig, load: str) -> dict:
    from parrot.bench.machine import cpu_family_model, describe_cpu, describe_machine

    return {**describe_machine(), **describe_cpu(),
            "cpu family / model (/proc/cpuinfo)": cpu_family_model(), "model": data.get("model"),
            "server": "parrot serve " + " ".join(serve_flags(bc))
                      + " (router: + --flow-speculation | --no-flow-speculation)",
            "command": "python -m parrot.bench.flow_bench " + " ".join(sys.argv[1:]),
            "agent": f"{bc.agents} agents at once, {bc.iterations} iterations x {bc.think_tokens} thought tokens "
                     f"(ignore_eos), tools calculator / search_text over {bc.doc_sentences} sentences of "
                     f"{Path(DEFAULT_DOCUMENT).name}; {bc.repeats} repeats, modes rotating, medians",
            "emulated RTT": f"{bc.rtt_ms:g} ms per HTTP call (flow+rtt, client+rtt, openai+rtt)",
            "router": f"{bc.router_requests} requests at Poisson {bc.router_rate:g}/s after {bc.router_warmup} "
                      f"warm-up requests; decisions {'/'.join(f'{p * 100:g}' for p in bc.probs)} (seed {bc.seed}); "
                      f"router {bc.router_tokens} tokens, handlers {bc.reply_tokens} tokens; no emulated RTT",
            "load before the run (uptime)": load,
            "load average at the end (1 / 5 / 15 min)": " / ".join(data.get("loadavg_after") or []),
            "total s": round(data["total_s"], 1)}


def _f(x) -> str:
    return "-" if x is None else f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"


def _r(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _md(headers: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def tables(data: dict) -> tuple[str, str]:
    """(plain text, markdown) of one run."""
    ag, rt = data["agent"], data["router"]
    a_rows = [[mode, s["batch_s_median"], s["mean_s_median"], s["calls_per_agent"], s["iterations"],
               ag["ratios_vs_flow"].get(mode, {}).get("batch"), ag["ratios_vs_flow"].get(mode, {}).get("mean")]
              for mode, s in ag["summary"].items()]
    a_head = ["mode", "batch s", "mean s / agent", "HTTP calls / agent", "iterations", "batch / flow (same RTT)",
              "mean / flow (same RTT)"]
    text = format_table(a_head, a_rows, title="[flow_bench] agent loop (medians over repeats)")
    md = ("### Agent loop (medians over repeats; ratio above 1: the flow is faster)\n\n"
          + _md(a_head, [[a[0]] + [_f(x) for x in a[1:5]] + [_r(a[5]), _r(a[6])] for a in a_rows]))
    if not rt:  # --router-requests 0
        return text, md
    off = rt["speculation off"]["mean_s"]
    r_rows = [[arm, r["mean_s"], r["p99_s"], r["majority_mean_s"], r["others_mean_s"], r["hit"], r["miss"],
               r["wasted_tokens"], ratio(off, r["mean_s"])] for arm, r in rt.items()]
    r_head = ["arm", "mean s", "p99 s", "mean s (billing)", "mean s (others)", "hits", "misses", "wasted tokens",
              "off / arm"]
    text += "\n\n" + format_table(r_head, r_rows, title="[flow_bench] router speculation")
    md += ("\n\n### Router speculation (80/15/5)\n\n"
           + _md(r_head, [[r[0]] + [_f(x) for x in r[1:5]] + [str(x) for x in r[5:8]] + [_r(r[8])]
                          for r in r_rows]))
    return text, md


def render_md(runs: dict) -> str:
    parts = []
    for key, data in runs.items():
        cond = data.get("conditions", {})
        parts.append(f"## Real server: `{key}` (`flows.json` → `{key}`)\n\n"
                     + _md(["condition", "value"], [[k, str(v)] for k, v in cond.items()]) + "\n\n"
                     + tables(data)[1])
    return "\n\n".join(parts)


def result_key(data: dict) -> str:
    from parrot.bench.machine import cpu_key

    return cpu_key((data.get("numerics") or {}).get("path"))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 agents, 12 router requests")
    p.add_argument("--engines", type=int, default=None)
    p.add_argument("--rtt-ms", type=float, default=None)
    p.add_argument("--agents", type=int, default=None)
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--think-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--router-requests", type=int, default=None)
    p.add_argument("--router-rate", type=float, default=None)
    p.add_argument("--modes", default=None,
                   help=f"comma-separated subset of {','.join(AGENT_MODES)} (flow is required)")
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--key", default=None, help="the run's key in flows.json (default <cpu path>-<cpu>)")
    p.add_argument("--tag", default=None, help="appended to the key (<key>-<tag>)")
    p.add_argument("--out", default=None, help="directory of flows.json / flows.md (default docs/results; "
                   "--quick: $TMPDIR/flow_bench_quick)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    bc = QUICK if args.quick else BenchConfig()
    over = {k: v for k, v in {"engines": args.engines, "rtt_ms": args.rtt_ms, "agents": args.agents,
                              "iterations": args.iterations, "think_tokens": args.think_tokens,
                              "repeats": args.repeats, "router_requests": args.router_requests,
                              "router_rate": args.router_rate, "model": args.model, "seed": args.seed,
                              "modes": tuple(args.modes.split(",")) if args.modes else None}.items()
            if v is not None}
    bc = replace(bc, **over)
    if set(bc.modes) - set(AGENT_MODES) or any(MODE_BASE[m] not in bc.modes for m in bc.modes):
        raise SystemExit(f"--modes: a subset of {AGENT_MODES} with the flow mode of each (flow+rtt for the +rtt modes)")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    data = run_all(bc)
    data["conditions"] = conditions(data, bc, load)
    text, _ = tables(data)
    print(text)
    out = Path(args.out or (os.path.join(os.environ.get("TMPDIR", "/tmp"), "flow_bench_quick") if args.quick
                            else "docs/results"))
    jpath = out / "flows.json"
    runs = json.loads(jpath.read_text(encoding="utf-8")) if jpath.exists() else {}
    runs[(args.key or result_key(data)) + (f"-{args.tag}" if args.tag else "")] = data
    save_json(str(jpath), runs)
    write_section(out / "flows.md", "real", render_md({k: v for k, v in runs.items() if k != "sim"}))
    return data


if __name__ == "__main__":
    main()
