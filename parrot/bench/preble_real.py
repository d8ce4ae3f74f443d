"""Preble on real engines: E2 vs round-robin vs least-loaded, each a manager over `parrot engine` processes, driven
by Preble's five workloads scaled down for the default 135M model on CPU (``python -m parrot.bench.preble_bench
real``).

One cluster per policy, all started at the beginning and kept for the whole run (each engine one torch thread, a
small KV pool so prefixes compete for memory); the runs then go (workload, rate) by (workload, rate), every policy
on the same requests, one cluster loaded at a time (the policy order rotates from run to run)::

    cluster e2            manager (policy e2)           -> engine e2-0, e2-1
    cluster round-robin   manager (policy round-robin)  -> engine round-robin-0, round-robin-1
    cluster least-loaded  manager (policy least-loaded) -> engine least-loaded-0, least-loaded-1

    toolbench @ r1:  e2 | round-robin | least-loaded      toolbench @ r2:  round-robin | least-loaded | e2   ...

A manager is the app ``parrot serve --engines N`` runs (``create_app`` + ``start_engines``, the same code), served
from a thread of this process instead of its own, so the benchmark can read the E2 policy's counters (decisions by
kind, eviction notices applied) that the HTTP stats do not carry. Requests are OpenAI text completions (the
official ``openai`` async client, temperature 0, ``ignore_eos``) sent at their Poisson arrival times. Each prompt
ends with a few fresh random words (a nonce), so no two requests are identical: what is shared is the workload's
prefixes, not whole prompts. Each (workload, rate) uses its own seed, so runs share no prefixes either.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO

import httpx

from parrot.common.report import p99
from parrot.workloads.preble import WORKLOADS, Request, workload
from parrot.workloads.synth import synth_text

log = logging.getLogger(__name__)

POLICIES = ("e2", "round-robin", "least-loaded")
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RealConfig:
    engines: int = 2
    kv_tokens: int = 2048  # per engine
    local_policy: str = "fcfs"  # every engine's wait queue (the comparison is of the global placement)
    scale: float = 0.1  # prompt sizes x this (simulator tokens ~ real tokens of the 135M model's tokenizer)
    out_scale: float = 0.25  # output lengths x this, capped at max_out
    max_out: int = 16
    requests: int = 20  # per (workload, rate, policy)
    nonce_words: int = 3
    heartbeat_s: float = 0.5  # engines push their status (eviction notices, step statistics) this often
    model: str | None = None  # None: the engines' default (SmolLM2-135M)
    seed: int = 0


def real_requests(name: str, rate: float, seed: int, cfg: RealConfig) -> list[Request]:
    """The scaled workload: sizes x ``cfg.scale``, outputs x ``cfg.out_scale`` (at least 1, at most max_out), and a
    nonce of ``cfg.nonce_words`` fresh random words at the end of every prompt."""
    rng = random.Random(f"nonce:{name}:{seed}")
    return [replace(r, prompt=f"{r.prompt} {synth_text(cfg.nonce_words, rng)}",
                    max_tokens=max(1, min(cfg.max_out, round(r.max_tokens * cfg.out_scale))))
            for r in workload(name, cfg.requests, rate, seed, scale=cfg.scale)]


# ---- a cluster per policy ---------------------------------------------------------------------------------------
class RealCluster:
    """A manager app (policy ``policy``) in a thread of this process over ``cfg.engines`` engine processes."""

    def __init__(self, policy: str, cfg: RealConfig, output: IO) -> None:
        from parrot.api.app import create_app
        from parrot.api.settings import ServerSettings
        from parrot.engine.server.procs import start_engines
        from parrot.frontend.local import LocalServer

        self.policy_name = policy
        self.cfg = cfg
        secret = secrets.token_urlsafe(32)
        self.app = create_app(ServerSettings(policy=policy, engine_heartbeat_s=2.0, engine_secret=secret), [])
        self.server = LocalServer(self.app)
        self.url = self.server.url
        args = ["--num-threads", "1", "--kv-cache-tokens", str(cfg.kv_tokens), "--engine-policy", cfg.local_policy]
        if cfg.model:
            args += ["--model", cfg.model]
        try:
            self.procs = start_engines(cfg.engines, self.url, secret=secret, engine_args=args, prefix=policy,
                                       heartbeat_s=cfg.heartbeat_s, output=output)
        except BaseException:
            self.server.stop()
            raise
        self.model_id: str | None = None

    @property
    def policy(self):
        return self.app.state.manager.dispatcher.policy

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            dead = [p.name for p in self.procs if not p.alive]
            if dead:
                raise RuntimeError(f"engine(s) {dead} of cluster {self.policy_name} exited during start")
            try:
                engines = httpx.get(f"{self.url}/api/v1/engines", timeout=5).json()["engines"]
                if sum(e["healthy"] for e in engines) >= self.cfg.engines:
                    self.model_id = httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"][0]["id"]
                    return
            except (httpx.HTTPError, KeyError, IndexError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"cluster {self.policy_name}: {self.cfg.engines} engines not up in time")

    def engine_counters(self) -> dict[str, dict[str, int]]:
        """Per engine, from its last pushed status: KV blocks evicted, prefix-cache hit blocks, tokens computed."""
        out = {}
        for e in self.app.state.manager.registry.entries():
            x = e.status.extra if e.status is not None else {}
            out[e.name] = {"evicted_blocks": int(x.get("kv_blocks_evicted", 0)),
                           "hit_blocks": int(x.get("prefix_cache_hit_blocks", 0)),
                           "tokens_computed": int(x.get("tokens_computed", 0)),
                           "kv_blocks_total": e.status.kv_blocks_total if e.status is not None else 0,
                           "block_size": e.status.block_size if e.status is not None else 0}
        return out

    def policy_counters(self) -> dict:
        """E2's decisions by kind and eviction notices applied ({} for the other policies)."""
        from parrot.manager.policies import E2Policy

        pol = self.policy
        if not isinstance(pol, E2Policy):
            return {}
        return {"decisions": dict(pol.counts), "notices_applied": pol.notices_applied,
                "notice_tokens_dropped": pol.notice_tokens_dropped}

    def stop(self) -> None:
        from parrot.engine.server.procs import stop_all

        stop_all(self.procs)
        self.server.stop()


# ---- load -------------------------------------------------------------------------------------------------------
async def send(url: str, model: str, reqs: Sequence[Request]) -> list[dict]:
    """Every request at its arrival time (relative to now); per request latency and usage."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(r: Request) -> dict:
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - loop.time()))
        t = time.perf_counter()
        resp = await client.completions.create(model=model, prompt=r.prompt, max_tokens=r.max_tokens,
                                               temperature=0.0, extra_body={"ignore_eos": True})
        lat = time.perf_counter() - t
        u = resp.usage
        details = getattr(u, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) if details is not None else None
        return {"latency_s": lat, "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "cached_tokens": cached or 0, "group": r.group}

    try:
        return list(await asyncio.gather(*(one(r) for r in reqs)))
    finally:
        await client.close()


def warm_up(cluster: RealCluster, seed: int) -> None:
    """Completions of several sizes, all at once, so each engine has step statistics (E2's costs) before the runs;
    then two heartbeats for them to arrive."""
    rng = random.Random(f"warmup:{seed}")
    prompts = [f"[warmup {i}] " + synth_text(n, rng) for i, n in enumerate((20, 80, 160, 240) * cluster.cfg.engines)]

    async def main() -> None:
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0,
                               timeout=REQUEST_TIMEOUT_S) as client:
            await asyncio.gather(*(client.completions.create(model=cluster.model_id, prompt=p, max_tokens=8,
                                                             temperature=0.0, extra_body={"ignore_eos": True})
                                   for p in prompts))

    asyncio.run(main())
    time.sleep(2 * cluster.cfg.heartbeat_s + 0.5)


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        if isinstance(v, dict):
            out[k] = _delta(v, before.get(k, {}))
        elif isinstance(v, (int, float)):
            out[k] = v - before.get(k, 0)
    return out


def run_one(cluster: RealCluster, reqs: Sequence[Request]) -> dict:
    """One (workload, rate) on one cluster: latencies, cache hits, engine and policy counter deltas."""
    before_e, before_p = cluster.engine_counters(), cluster.policy_counters()
    t0 = time.perf_counter()
    assert cluster.model_id is not None
    got = asyncio.run(send(cluster.url, cluster.model_id, reqs))
    wall = time.perf_counter() - t0
    time.sleep(cluster.cfg.heartbeat_s + 0.3)  # the engines' counters after the run
    eng = _delta(cluster.engine_counters(), before_e)
    pol = _delta(cluster.policy_counters(), before_p)
    lat = [g["latency_s"] for g in got]
    prompt = sum(g["prompt_tokens"] for g in got)
    return {"mean_s": statistics.mean(lat), "p99_s": p99(lat), "p50_s": statistics.median(lat), "wall_s": wall,
            "requests": len(got), "prompt_tokens": prompt, "cached_tokens": sum(g["cached_tokens"] for g in got),
            "hit_ratio": sum(g["cached_tokens"] for g in got) / max(1, prompt),
            "evicted_blocks": sum(e["evicted_blocks"] for e in eng.values()),
            "tokens_computed": sum(e["tokens_computed"] for e in eng.values()),
            "per_engine_tokens": {n: e["tokens_computed"] for n, e in eng.items()},
            "e2": pol, "latencies_s": [round(x, 4) for x in lat]}


# ---- the experiment ---------------------------------------------------------------------------------------------
def run_all(cfg: RealConfig, rates: dict[str, list[float]], out_dir: Path,
            policies: Sequence[str] = POLICIES) -> dict:
    """Start a cluster per policy, warm each up, run every (workload, rate) on each; returns the JSON-ready
    results (``runs``: one entry per (workload, rate) with each policy's summary) and the cluster facts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    logf = open(out_dir / f"preble_real-{time.strftime('%Y%m%d-%H%M%S')}.engines.log", "ab")
    clusters: dict[str, RealCluster] = {}
    t_start = time.perf_counter()
    try:
        for p in policies:
            clusters[p] = RealCluster(p, cfg, logf)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for c in clusters.values():
            c.wait_ready(deadline)
        startup_s = time.perf_counter() - t_start
        log.warning("clusters up in %.0f s; warming up", startup_s)
        for c in clusters.values():
            warm_up(c, cfg.seed)
        facts = next(iter(clusters.values())).engine_counters()
        runs = []
        k = 0
        for name, rs in rates.items():
            for j, rate in enumerate(rs):
                seed = cfg.seed * 1000 + 10 * WORKLOADS.index(name) + j  # one per (workload, rate)
                reqs = real_requests(name, rate, seed, cfg)
                order = list(policies[k % len(policies):]) + list(policies[:k % len(policies)])
                k += 1
                res = {}
                for p in order:
                    res[p] = run_one(clusters[p], reqs)
                    log.warning("%s @ %g/s %s: mean %.2f s, p99 %.2f s, hit %.0f %%, evicted %d blocks (%.0f s "
                                "elapsed)", name, rate, p, res[p]["mean_s"], res[p]["p99_s"],
                                100 * res[p]["hit_ratio"], res[p]["evicted_blocks"], time.perf_counter() - t_start)
                runs.append({"workload": name, "rate": rate, "seed": seed, "order": order,
                             "mean_prompt_tokens": res[order[0]]["prompt_tokens"] / max(1, len(reqs)),
                             "mean_max_tokens": statistics.mean(r.max_tokens for r in reqs),
                             "groups": len({r.group for r in reqs}), "policies": res})
        model = next(iter(clusters.values())).model_id
    finally:
        for c in clusters.values():
            c.stop()
        logf.close()
    any_engine = next(iter(facts.values()))
    return {"runs": runs, "startup_s": startup_s, "total_s": time.perf_counter() - t_start, "model": model,
            "kv_blocks_per_engine": any_engine["kv_blocks_total"], "block_size": any_engine["block_size"],
            "config": asdict(cfg), "rates": rates}


def report(data: dict, policies: Sequence[str] = POLICIES) -> str:
    from parrot.common.report import format_table

    by_wl: dict[str, list[dict]] = {}
    for r in data["runs"]:
        by_wl.setdefault(r["workload"], []).append(r)
    parts = []
    for name, runs in by_wl.items():
        rows = []
        for r in runs:
            res = r["policies"]
            e2 = res.get("e2")
            row: list = [f"{r['rate']:g}"]
            for p in policies:
                row += [res[p]["mean_s"], res[p]["p99_s"]]
            for p in policies:
                if p != "e2" and e2 is not None:
                    row += [res[p]["mean_s"] / e2["mean_s"], res[p]["p99_s"] / e2["p99_s"]]
            row += ["/".join(f"{100 * res[p]['hit_ratio']:.0f}" for p in policies),
                    "/".join(str(res[p]["evicted_blocks"]) for p in policies)]
            if e2 is not None:
                pe = e2.get("e2", {})
                row += [", ".join(f"{k} {v}" for k, v in sorted(pe.get("decisions", {}).items()) if v),
                        f"{pe.get('notices_applied', 0)} ({pe.get('notice_tokens_dropped', 0)} tok)"]
            rows.append(row)
        short = {"e2": "e2", "round-robin": "rr", "least-loaded": "ll"}
        headers = ["req/s"] + [f"{short.get(p, p)} {m}" for p in policies for m in ("mean s", "p99 s")]
        headers += [f"{short.get(p, p)}/e2 {m}" for p in policies if p != "e2" for m in ("mean", "p99")]
        headers += ["hit % " + "/".join(short.get(p, p) for p in policies),
                    "evicted blk " + "/".join(short.get(p, p) for p in policies)]
        if "e2" in policies:
            headers += ["e2 decisions", "e2 notices applied"]
        r0 = runs[0]
        parts.append(format_table(headers, rows, title=(
            f"[Preble Fig. 7, real engines] {name}: {data['config']['requests']} requests per run (Poisson), mean "
            f"prompt ~{r0['mean_prompt_tokens']:.0f} tokens, mean output {r0['mean_max_tokens']:.1f}, "
            f"{r0['groups']} sharing groups")))
    return "\n\n".join(parts)
