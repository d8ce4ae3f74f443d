"""Application-centric scheduling vs request-centric baselines on a cluster of engine processes (paper §8.2
Fig. 12/14, §8.5 Fig. 19), one server per policy, the same seeded workload for each.

    python -m parrot.bench.cluster_bench [--quick] [--scenarios map_reduce chain_bg multi_chain mixed]
        [--policies parrot fifo-latency fifo-throughput] [--latency-cap 512] [--throughput-cap 16384]

For every policy a fresh ``parrot serve --engines E --policy P`` runs (engines are `parrot engine` processes,
each with ONE torch thread: this box has 2 cores). Under ``parrot`` the apps use the Parrot frontend (Semantic
Variables, one emulated round trip per app); under the baselines they use the LangChain-style client of
:mod:`parrot.workloads.baseline_client` (one emulated round trip per call), as in the paper. Scenarios:

* ``map_reduce`` (Fig. 14, 1 engine): one map-reduce summary, final fetched for LATENCY.
* ``chain_bg`` (Fig. 12a, 1 engine): one chain summary while ``background`` clients send unrelated completions.
* ``multi_chain`` (Fig. 12b/13, 1 engine): ``apps`` chain summaries at once; every app's latency is reported and
  compared app by app ("apps slower under parrot" counts apps that took longer under Parrot than under that
  baseline; the paper's claim is zero).
* ``mixed`` (Fig. 19, ``mixed_engines`` engines): chat completions arriving at a fixed rate (latency-critical, the
  same OpenAI client under every policy) plus map-reduce apps fetched for THROUGHPUT; chat normalized latency
  (s per output token) and map-reduce completion time.

Parrot apps declare their DAG before their inputs arrive (inputs are set after the final output was fetched
with its criterion), so perf deduction labels every step before it can be dispatched. Ratios are
``baseline / parrot`` (above 1 = Parrot better). Prints tables and conditions, saves JSON + PNG under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx
from tqdm import tqdm

from parrot.bench.app_bench import BackgroundLoad
from parrot.bench.apps import run_baseline
from parrot.bench.machine import describe_cpu
from parrot.common.report import format_conditions, format_table, ratio, save_bar_panels, save_json
from parrot.engine.server.procs import free_port
from parrot.frontend.client import connect
from parrot.frontend.function import Output, SemanticFunction
from parrot.frontend.variable import SemanticVariable
from parrot.workloads.apps import APPS, DEFAULT_DOCUMENT, App, Const, FromStep, load_document
from parrot.workloads.baseline_client import BaselineClient, EmulatedLatency
from parrot.workloads.cluster_mix import QUICK, Workload, chunks

log = logging.getLogger(__name__)

POLICIES = ("parrot", "fifo-latency", "fifo-throughput")
# also accepted by --policies: Parrot clients against another manager policy (compared with the parrot rows)
PARROT_VARIANTS = ("parrot-split",)
SCENARIOS = ("map_reduce", "chain_bg", "multi_chain", "mixed")
STARTUP_TIMEOUT_S = 900.0
APP_TIMEOUT_S = 3600.0


# ---- a server per policy ----------------------------------------------------------------------------------------
class Cluster:
    """``parrot serve --engines N --policy P`` in its own process group (killed as a whole at the end)."""

    def __init__(self, policy: str, engines: int, w: Workload, args: argparse.Namespace, log_path: Path) -> None:
        self.policy, self.engines = policy, engines
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "parrot.cli", "--log-level", "WARNING", "serve", "--engines", str(engines),
               "--policy", policy, "--port", str(self.port), "--num-threads", "1",
               "--latency-cap-tokens", str(w.latency_cap), "--throughput-cap-tokens", str(w.throughput_cap)]
        if args.model:
            cmd += ["--model", args.model]
        if args.share_slack is not None:
            cmd += ["--share-slack", str(args.share_slack)]
        self._log = open(log_path, "ab")
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"parrot serve ({self.policy}) exited with {self._proc.returncode}; "
                                   f"see {self._log.name}")
            try:
                engines = httpx.get(f"{self.url}/api/v1/engines", timeout=5).json()["engines"]
                if sum(e["healthy"] for e in engines) >= self.engines:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.engines} engine(s) not up after {STARTUP_TIMEOUT_S} s")

    def stop(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(10)
        self._log.close()

    def __enter__(self) -> "Cluster":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- drivers ----------------------------------------------------------------------------------------------------
def run_parrot_app(app: App, url: str, latency: EmulatedLatency, criteria: str) -> float:
    """Declare the app's DAG with pending inputs, fetch the final output with ``criteria`` (deduction labels
    every step now), set the inputs, wait for the final value. Returns end-to-end seconds (one round trip)."""
    session = connect(url, make_default=False)
    try:
        fixed = Output(max_tokens=app.output_len, ignore_eos=True, temperature=0.0, stop=[])
        funcs = {s.template: SemanticFunction(s.template, name=f"{app.name}_{s.name}", defaults=fixed)
                 for s in app.steps}
        t0 = time.perf_counter()
        rtt = latency.sample_s()
        time.sleep(rtt / 2)
        inputs: list[tuple[SemanticVariable, str]] = []
        outputs: dict[str, SemanticVariable] = {}
        for step in app.steps:
            args = {}
            for key, ref in step.inputs:
                if isinstance(ref, Const):
                    var = SemanticVariable(name=key, session=session)
                    inputs.append((var, ref.text))
                    args[key] = var
                else:
                    assert isinstance(ref, FromStep)
                    args[key] = outputs[ref.step]
            outputs[step.name] = funcs[step.template](session=session, **args)
        final = outputs[app.final]
        session.poll_variable(final.id, criteria, 0.0)  # GetPerfObj before anything can run
        for var, text in inputs:
            var.set(text)
        final.get(perf=criteria, timeout=APP_TIMEOUT_S)
        time.sleep(rtt / 2)
        return time.perf_counter() - t0
    finally:
        session.close()


async def run_app(app: App, policy: str, url: str, latency: EmulatedLatency, criteria: str = "latency") -> float:
    if policy.startswith("parrot"):
        return await asyncio.to_thread(run_parrot_app, app, url, latency, criteria)
    async with BaselineClient(url, latency=latency) as client:
        return (await run_baseline(app, client)).e2e_s


async def chat_stream(url: str, w: Workload, seed: int, until: asyncio.Event) -> list[tuple[float, float, int]]:
    """Chat completions at ``chat_rate`` until ``until`` is set and at least ``chat_min`` were sent; returns
    (start, latency s, output tokens) per request (start: ``time.perf_counter()`` when it was sent)."""
    rng = random.Random(seed)
    words = load_document(DEFAULT_DOCUMENT).split()
    loop = asyncio.get_running_loop()
    async with BaselineClient(url, latency_ms=(0.0, 0.0)) as client:
        async def one(i: int) -> tuple[float, float, int]:
            start = rng.randrange(0, len(words) - w.chat_words)
            prompt = f"[chat {seed}-{i}] User: {' '.join(words[start:start + w.chat_words])}\nAssistant:"
            n = rng.randint(*w.chat_out)
            t = time.perf_counter()
            await client.acomplete(prompt, max_tokens=n, ignore_eos=True)
            return t, time.perf_counter() - t, n

        tasks, t0, i = [], loop.time(), 0
        while i < w.chat_min or not until.is_set():
            await asyncio.sleep(max(0.0, t0 + i / w.chat_rate - loop.time()))
            tasks.append(asyncio.ensure_future(one(i)))
            i += 1
        return list(await asyncio.gather(*tasks))


# ---- scenarios --------------------------------------------------------------------------------------------------
async def scenario_map_reduce(url, policy, w, args, run_id) -> dict:
    app = APPS["map_reduce"](chunks(w, w.map_chunks, 0), w.output_len, tag=f"[{run_id}] ")
    return {"e2e_s": await run_app(app, policy, url, EmulatedLatency(tuple(args.latency_ms), args.seed))}


async def scenario_chain_bg(url, policy, w, args, run_id) -> dict:
    app = APPS["chain"](chunks(w, w.chain_chunks, 1), w.output_len, tag=f"[{run_id}] ")
    background = BackgroundLoad(url, None, w.background, load_document(DEFAULT_DOCUMENT)[:1500], w.output_len).start()
    try:
        e2e = await run_app(app, policy, url, EmulatedLatency(tuple(args.latency_ms), args.seed))
    finally:
        await asyncio.to_thread(background.stop)
    return {"e2e_s": e2e, "background_completed": background.completed}


async def scenario_multi_chain(url, policy, w, args, run_id) -> dict:
    apps = [APPS["chain"](chunks(w, w.multi_chunks, 2 + k), w.output_len, tag=f"[{run_id} app {k}] ")
            for k in range(w.apps)]
    times = await asyncio.gather(*(run_app(a, policy, url, EmulatedLatency(tuple(args.latency_ms), args.seed + k))
                                   for k, a in enumerate(apps)))
    return {"e2e_s": statistics.mean(times), "max_e2e_s": max(times), "apps_e2e_s": list(times)}


async def sample_placement(url: str, stop: asyncio.Event, period_s: float = 0.25) -> dict:
    """Poll the manager's scheduler stats: per engine the peak requests / tokens placed, the caps seen, and
    how often it held latency and throughput work at the same time."""
    peaks: dict[str, dict] = {}
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while not stop.is_set():
            try:
                engines = (await http.get("/api/v1/stats")).json()["scheduler"]["engines"]
            except (httpx.HTTPError, KeyError, ValueError):
                engines = {}
            for name, e in engines.items():
                p = peaks.setdefault(name, {"max_requests": 0, "max_tokens": 0, "caps": set(), "samples": 0,
                                            "mixed_kinds_samples": 0})
                p["max_requests"] = max(p["max_requests"], e["requests"])
                p["max_tokens"] = max(p["max_tokens"], e["tokens"])
                p["caps"].add(e["cap_sent"])
                p["samples"] += 1
                p["mixed_kinds_samples"] += len(e["kinds"]) > 1
            await asyncio.sleep(period_s)
    return {n: {**p, "caps": sorted(c for c in p["caps"] if c is not None)} for n, p in peaks.items()}


async def scenario_mixed(url, policy, w, args, run_id) -> dict:
    apps = [APPS["map_reduce"](chunks(w, w.mixed_chunks, 10 + k), w.output_len, tag=f"[{run_id} mr {k}] ")
            for k in range(w.mixed_apps)]
    done = asyncio.Event()
    t0 = time.perf_counter()
    chat = asyncio.ensure_future(chat_stream(url, w, args.seed, done))
    sampler = asyncio.ensure_future(sample_placement(url, done))
    try:
        times = await asyncio.gather(*(run_app(a, policy, url, EmulatedLatency(tuple(args.latency_ms), args.seed + k),
                                               criteria="throughput") for k, a in enumerate(apps)))
    finally:
        done.set()
    mr_end = time.perf_counter()
    chats = await chat
    per_token = sorted(lat / n for _, lat, n in chats)
    # chats sent while map-reduce ran share the machine with it; those sent after it ended run alone, and a
    # policy whose map-reduce ends sooner gets more of them: both shares are reported
    during = [lat / n for start, lat, n in chats if start < mr_end] or [float("nan")]
    return {"chat_s_per_token": statistics.mean(per_token),
            "chat_p90_s_per_token": per_token[int(0.9 * (len(per_token) - 1))],
            "chat_during_map_reduce_s_per_token": statistics.mean(during), "chat_requests": len(chats),
            "chats": [{"sent_s": round(start - t0, 3), "latency_s": round(lat, 4), "tokens": n}
                      for start, lat, n in chats],
            "map_reduce_e2e_s": statistics.mean(times), "map_reduce_end_s": round(mr_end - t0, 3),
            "placement": await sampler}


RUNNERS = {"map_reduce": scenario_map_reduce, "chain_bg": scenario_chain_bg, "multi_chain": scenario_multi_chain,
           "mixed": scenario_mixed}


WARMUP_WORDS = (5, 40, 120, 200)  # prompt sizes of the warm-up completions (all sent at once, per engine)


def _warm_up(url: str, engines: int) -> None:
    """Completions of several prompt sizes, all at once, so every engine has run prefills of several sizes and
    decode batches of 1 to ~4 sequences: its step-time statistics (in its heartbeats) then identify how its
    iteration time grows with the batch before the scenario starts (the ``parrot`` policy's cost-aware
    placement uses them; the baselines ignore them). Waits two heartbeats (1 s each) for them to arrive."""
    words = load_document(DEFAULT_DOCUMENT).split()

    async def main():
        async with BaselineClient(url, latency_ms=(0.0, 0.0)) as client:
            await asyncio.gather(*(client.acomplete(f"[warmup {e}-{n}] " + " ".join(words[:n]), max_tokens=8 + n // 10,
                                                    ignore_eos=True)
                                   for e in range(engines) for n in WARMUP_WORDS))

    asyncio.run(main())
    time.sleep(2.0)


# ---- reporting --------------------------------------------------------------------------------------------------
def median_run(runs: list[dict]) -> dict:
    """One policy's runs of a scenario as one result: the first run's fields, every number replaced by its median
    over the runs (lists and dicts are the first run's), and ``runs`` (every run) when there are several."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    if len(runs) > 1:
        out["runs"] = runs
    return out


METRICS = {  # scenario -> (metric, table header) compared across policies
    "map_reduce": [("e2e_s", "e2e s")],
    "chain_bg": [("e2e_s", "e2e s")],
    "multi_chain": [("e2e_s", "mean app e2e s"), ("max_e2e_s", "max app e2e s")],
    "mixed": [("chat_s_per_token", "chat s/token"), ("chat_p90_s_per_token", "chat p90 s/token"),
              ("chat_during_map_reduce_s_per_token", "chat s/token during map-reduce"),
              ("map_reduce_e2e_s", "map-reduce e2e s")],
}


def report(results: dict[str, dict[str, dict]], policies: list[str]) -> tuple[str, dict]:
    parts, panels = [], {}
    for scenario, by_policy in results.items():
        base = by_policy.get("parrot", {})
        headers = ["policy"]
        for _, h in METRICS[scenario]:
            headers += [h, "ratio"]
        if scenario == "multi_chain":
            headers.append("apps slower under parrot")
        rows = []
        for p in policies:
            r = by_policy.get(p)
            if r is None:
                continue
            row: list = [p]
            for key, _ in METRICS[scenario]:
                row += [r.get(key), ratio(r.get(key), base.get(key))]
            if scenario == "multi_chain":
                later = None if not base else sum(a > b for a, b in zip(base["apps_e2e_s"], r["apps_e2e_s"]))
                row.append(later if p != "parrot" else "-")
            rows.append(row)
        repeats = len(base.get("runs", ())) or 1
        title = f"[{scenario}]  ratio = policy / parrot (>1: parrot better)"
        if repeats > 1:
            title += f"; medians of {repeats} runs, ratio of the medians"
        parts.append(format_table(headers, rows, title=title))
        if repeats > 1:  # the ratio in each run (run i of a policy against run i of parrot): the spread
            for p in policies:
                if p == "parrot" or "runs" not in by_policy.get(p, {}):
                    continue
                spread = []
                for key, h in METRICS[scenario]:
                    each = [ratio(r.get(key), b.get(key)) for r, b in zip(by_policy[p]["runs"], base["runs"])]
                    spread.append(f"{h} " + " ".join("-" if x is None else f"{x:.2f}" for x in each))
                parts.append(f"  {p} / parrot per run: " + "; ".join(spread))
        if scenario == "multi_chain":  # every app's latency (Fig. 13: none may finish later under parrot)
            shown = [p for p in policies if p in by_policy]
            apps = zip(*(by_policy[p]["apps_e2e_s"] for p in shown))
            parts.append(format_table(["app", *(f"{p} e2e s" for p in shown)],
                                      [[k, *times] for k, times in enumerate(apps)],
                                      title="[multi_chain] per-app end-to-end latency"))
        for p in policies:
            placement = by_policy.get(p, {}).get("placement")
            if placement:
                parts.append(f"  {p} placement: " + "; ".join(
                    f"{n} peak {e['max_requests']} req / {e['max_tokens']} tok, caps {e['caps']}, latency+throughput "
                    f"together in {e['mixed_kinds_samples']}/{e['samples']} samples"
                    for n, e in sorted(placement.items())))
        for key, h in METRICS[scenario]:
            panels[f"{scenario}: {h}"] = {p: by_policy[p].get(key) for p in policies if p in by_policy}
    return "\n\n".join(parts), panels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small workload (minutes): proves the pipeline works")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES + PARROT_VARIANTS)
    p.add_argument("--model", default=None, help="model file for the engines (default: SmolLM2-135M)")
    p.add_argument("--latency-cap", type=int, default=None, help="server latency cap tokens (default per workload)")
    p.add_argument("--throughput-cap", type=int, default=None)
    p.add_argument("--share-slack", type=float, default=None, help="server --share-slack (policy parrot)")
    p.add_argument("--latency-ms", nargs=2, type=float, default=[200.0, 300.0], metavar=("LOW", "HIGH"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per policy (a fresh server each; the policy order rotates per repeat); tables show "
                        "each metric's median over the runs and the ratio of the medians")
    p.add_argument("--out", default="bench_out")
    ns = p.parse_args(argv)
    if ns.repeats < 1:
        p.error(f"--repeats must be >= 1, got {ns.repeats}")
    return ns


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    w = QUICK if args.quick else Workload()
    if args.latency_cap or args.throughput_cap:
        w = Workload(**{**asdict(w), "latency_cap": args.latency_cap or w.latency_cap,
                        "throughput_cap": args.throughput_cap or w.throughput_cap})
    started = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"cluster_bench-{started}.servers.log"
    groups = [(1, [s for s in args.scenarios if s != "mixed"]), (w.mixed_engines, [s for s in args.scenarios
                                                                                     if s == "mixed"])]
    runs: dict[str, dict[str, list[dict]]] = {s: {p: [] for p in args.policies} for s in args.scenarios}
    total = len(args.policies) * len(args.scenarios) * args.repeats
    with tqdm(total=total, desc="cluster_bench", unit="run") as bar:
        for rep in range(args.repeats):
            k = rep % len(args.policies)  # rotate the order: no policy always runs first (or last) on a warm box
            for engines, scenarios in groups:
                if not scenarios:
                    continue
                for policy in args.policies[k:] + args.policies[:k]:
                    bar.set_postfix_str(f"starting {engines} engine(s), policy {policy}")
                    with Cluster(policy, engines, w, args, log_path) as cluster:
                        _warm_up(cluster.url, engines)
                        for scenario in scenarios:
                            bar.set_postfix_str(f"{scenario} / {policy} (run {rep + 1}/{args.repeats})")
                            run_id = f"{args.seed}-{scenario}"  # the same tags under every policy and repeat
                            runs[scenario][policy].append(
                                asyncio.run(RUNNERS[scenario](cluster.url, policy, w, args, run_id)))
                            bar.update(1)
    results = {s: {p: median_run(rs) for p, rs in by_policy.items()} for s, by_policy in runs.items()}
    conditions = {"workload": asdict(w), "quick": args.quick, "repeats": args.repeats,
                  "latency_ms": tuple(args.latency_ms), "seed": args.seed, "engine_threads": 1, "cores": os.cpu_count(),
                  "drivers": "parrot: Parrot frontend (1 RTT/app); baselines: LangChain-style client (1 RTT/call)",
                  "model": args.model or "SmolLM2-135M-Instruct Q4_1 (default)", **describe_cpu()}
    text, panels = report(results, args.policies)
    print(format_conditions({k: v for k, v in conditions.items() if k != "workload"}))
    print("workload: " + ", ".join(f"{k}={v}" for k, v in asdict(w).items()))
    print()
    print(text)
    stem = out / f"cluster_bench-{started}"
    save_json(str(stem.with_suffix(".json")), {"conditions": conditions, "results": results, "args": vars(args)})
    save_bar_panels(str(stem.with_suffix(".png")), panels, title="cluster scheduling: parrot vs request-centric "
                    "baselines (lower is better)")
    print(f"\nsaved {stem.with_suffix('.json')}, {stem.with_suffix('.png')} (server logs: {log_path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
