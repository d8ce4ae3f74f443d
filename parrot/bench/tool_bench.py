"""Tool calls on the real engine (LAMPS §6): one `parrot serve` per engine policy, agent requests at Poisson
rates through the Semantic-Variable frontend and through the OpenAI chat API with tools.

    flock /tmp/bench.lock .venv/bin/python -m parrot.bench.tool_bench [--rates 1,2] [--requests 16]
        [--kv-tokens 2048] [--variants lamps,lamps-fcfs,infercept,discard,preserve] [--clients sv,openai]
        [--mix multi] [--seed 0] [--out docs/results/tools] [--quick]

Variants (each its own server, all started at the beginning and kept for the whole run; one engine thread each, a
KV pool of ``--kv-tokens`` so that paused requests compete for memory)::

    lamps        --engine-policy lamps       predicted handling + memory-over-time ranking (LAMPS)
    lamps-fcfs   --engine-policy lamps-fcfs  LAMPS' predicted handling, FCFS order (the ablation; run only where
                                             the engine offers that policy, else listed as skipped)
    infercept    --engine-policy infercept   min-waste handling decided at the pause, FCFS (INFERCEPT)
    discard      --engine-policy discard     free at every tool call, recompute on return, FCFS (vLLM)
    preserve     --engine-policy preserve    keep every paused context, FCFS

Runs go (client, rate) by (client, rate), every variant on the same requests (same seed), one server loaded at a
time, the variant order rotating from run to run. A request (:mod:`parrot.workloads.tools`) is a fresh system
prompt + question, then rounds of think -> tool -> think ..., then an answer, sent through the SV frontend
(``sv``) or the OpenAI chat API with tools (``openai``), as :mod:`parrot.bench.tool_clients` describes.

Reported per (client, rate) and variant: mean / p99 end-to-end latency and TTFT, their ratios to infercept and to
discard (same run), the engine's tool pauses by handling, preemptions and tokens computed (status counter deltas).
Writes ``<out>/real-<cpu path>-<cpu>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO

import httpx

from parrot.common.report import save_json
from parrot.bench.tool_clients import ToolBenchError, run_openai, run_sv
from parrot.bench.tool_stats import METRICS, RunStats, ratios
from parrot.workloads.tools import CPU_MIXES, CPU_TOOLS, AgentRequest, WorkloadConfig, make_requests

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Variant:
    name: str
    engine_policy: str
    env: tuple[tuple[str, str], ...] = ()
    description: str = ""


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("lamps", "lamps", (), "predicted handling + memory-over-time ranking"),
    Variant("lamps-fcfs", "lamps-fcfs", (), "LAMPS handling, FCFS ranking (ablation)"),
    Variant("infercept", "infercept", (), "min-waste handling at the pause, FCFS"),
    Variant("discard", "discard", (), "discard + recompute, FCFS (vLLM)"),
    Variant("preserve", "preserve", (), "preserve, FCFS"),
)}
CLIENTS = ("sv", "openai")


def supported_engine_policies() -> tuple[str, ...]:
    """The ``--engine-policy`` values this checkout's engine accepts."""
    from parrot.engine.scheduler.policies import engine_policy_names

    return engine_policy_names()


@dataclass(frozen=True)
class BenchConfig:
    variants: tuple[str, ...] = tuple(VARIANTS)
    clients: tuple[str, ...] = CLIENTS
    rates: tuple[float, ...] = (1.0, 2.0)
    requests: int = 16            # per (client, rate, variant)
    mix: str = "multi"
    kv_tokens: int = 2048
    seed: int = 0
    model: str | None = None      # None: the default SmolLM2-135M
    random_model: str | None = None  # "tiny": the random test model (quick mode)
    warmup: int = 6               # agent requests per client before the runs (predictor history)
    request_timeout_s: float = 600.0
    heartbeat_s: float = 0.5      # the manager's engine status refresh period (--engine-heartbeat-s); the counters
    #                               of a run are read heartbeat_s + 0.3 s after it
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS] + [c for c in self.clients if c not in CLIENTS]
        if unknown:
            raise ValueError(f"unknown variant/client {unknown}; variants {list(VARIANTS)}, clients {list(CLIENTS)}")
        if self.mix not in CPU_MIXES:
            raise ValueError(f"unknown mix {self.mix!r}; known {sorted(CPU_MIXES)}")


QUICK = BenchConfig(variants=("lamps", "discard"), rates=(8.0,), requests=3, kv_tokens=1024, random_model="tiny",
                    warmup=0, request_timeout_s=60.0, heartbeat_s=0.2,
                    workload=WorkloadConfig(prompt_words=(40, 60), out_tokens=(3, 6), result_words=(3, 6),
                                            final_tokens=(3, 6), duration_scale=0.02))


# ---- one server per variant -------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ToolServer:
    """``parrot serve`` for one variant: a subprocess on 127.0.0.1 with one engine thread and a small KV pool."""

    def __init__(self, variant: Variant, cfg: BenchConfig, output: IO) -> None:
        self.variant = variant
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PARROT_ENGINE_NUM_THREADS="1", PARROT_ENGINE_KV_CACHE_TOKENS=str(cfg.kv_tokens),
                   PARROT_LOG_LEVEL="WARNING", **dict(variant.env))
        args = [sys.executable, "-m", "parrot.cli", "serve", "--port", str(self.port),
                "--engine-policy", variant.engine_policy, "--engine-heartbeat-s", str(cfg.heartbeat_s)]
        if cfg.random_model:
            args += ["--random-model", cfg.random_model, "--dtype", "float32"]
        elif cfg.model:
            args += ["--model", cfg.model]
        self.proc = subprocess.Popen(args, env=env, stdout=output, stderr=output)
        self.model_id: str | None = None
        self.numerics: dict = {}

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ToolBenchError(f"parrot serve for {self.variant.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    model = httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"][0]
                    self.model_id = model["id"]
                    self.numerics = next(iter(model.get("numerics", {}).values()), {})
                    return
            except (httpx.HTTPError, KeyError, IndexError):
                pass
            time.sleep(0.3)
        raise ToolBenchError(f"parrot serve for {self.variant.name} not ready in time")

    def engine_counters(self) -> dict:
        """The engine's counters from its status: tool pauses by handling, preemptions, tokens computed, cache."""
        engines = httpx.get(f"{self.url}/api/v1/engines", timeout=10).json()["engines"]
        st = (engines[0].get("status") or {}) if engines else {}
        x = st.get("extra") or {}
        tp = x.get("tool_pauses") or {}
        return {"tool_pauses": dict(tp.get("by_handling") or {}),
                "pause_events": {k: int(tp.get(k, 0)) for k in ("resumed", "expired", "demoted")},  # counters
                "host_store": {k: int(v) for k, v in (x.get("host_store") or {}).items() if k in ("stored", "hits")},
                "preemptions": int(st.get("num_preempted_total", 0)),
                "tokens_computed": int(x.get("tokens_computed", 0)),
                "prefix_hit_tokens": int(x.get("prefix_cache_hit_tokens", 0)),
                "kv_blocks_total": int(st.get("kv_blocks_total", 0)), "block_size": int(st.get("block_size", 0)),
                "engine_policy": x.get("engine_policy")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def counter_delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        if isinstance(v, dict):
            out[k] = counter_delta(v, before.get(k) or {})
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v - (before.get(k) or 0)
    return out


def run_client(server: ToolServer, client: str, reqs: Sequence[AgentRequest], cfg: BenchConfig) -> RunStats:
    if client == "sv":
        return run_sv(server.url, reqs, cfg.request_timeout_s, cfg.workload.duration_scale)
    assert server.model_id is not None
    return run_openai(server.url, server.model_id, reqs, cfg.request_timeout_s)


def run_one(server: ToolServer, client: str, reqs: Sequence[AgentRequest], cfg: BenchConfig) -> dict:
    before = server.engine_counters()
    t = time.perf_counter()
    stats = run_client(server, client, reqs, cfg)
    wall = time.perf_counter() - t
    time.sleep(cfg.heartbeat_s + 0.3)  # the engine's status after the run reaches the manager
    after = server.engine_counters()
    return {**stats.summary(), "wall_s": wall, "engine": counter_delta(after, before),
            "engine_policy": after.get("engine_policy"),
            "latencies_s": [round(x, 4) for x in stats.latencies_s]}


# ---- the experiment ---------------------------------------------------------------------------------------------
def run_all(cfg: BenchConfig, log_path: Path) -> dict:
    """Start every variant's server, warm each up, run every (client, rate) on each; JSON-ready results. The
    servers' output goes to ``log_path``."""
    logf = open(log_path, "ab")
    servers: dict[str, ToolServer] = {}
    t_start = time.perf_counter()
    known = supported_engine_policies()
    skipped = {n: f"the engine has no engine policy {VARIANTS[n].engine_policy!r} (known: {', '.join(known)})"
               for n in cfg.variants if VARIANTS[n].engine_policy not in known}
    for n, why in skipped.items():
        log.warning("variant %s skipped: %s", n, why)
    cfg = replace(cfg, variants=tuple(n for n in cfg.variants if n not in skipped))
    try:
        for name in cfg.variants:
            servers[name] = ToolServer(VARIANTS[name], cfg, logf)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for s in servers.values():
            s.wait_ready(deadline)
        startup_s = time.perf_counter() - t_start
        if cfg.warmup:
            warm = make_requests(cfg.mix, cfg.warmup, 4.0, cfg.seed + 10_000, replace(cfg.workload,
                                                                                       duration_scale=0.1))
            with ThreadPoolExecutor(max_workers=len(servers) * len(cfg.clients)) as pool:
                for f in [pool.submit(run_client, s, c, warm, cfg) for s in servers.values() for c in cfg.clients]:
                    f.result()
            time.sleep(cfg.heartbeat_s + 0.3)
        runs, k = [], 0
        for client in cfg.clients:
            for j, rate in enumerate(cfg.rates):
                seed = cfg.seed * 1000 + 10 * CLIENTS.index(client) + j
                reqs = make_requests(cfg.mix, cfg.requests, rate, seed, cfg.workload)
                order = list(cfg.variants[k % len(cfg.variants):]) + list(cfg.variants[:k % len(cfg.variants)])
                k += 1
                res = {}
                for name in order:
                    res[name] = run_one(servers[name], client, reqs, cfg)
                    log.warning("%s @ %g/s %s: mean %s s, p99 %s s, ttft %s s, failed %d (%.0f s elapsed)", client,
                                rate, name, _f(res[name]["mean_s"]), _f(res[name]["p99_s"]),
                                _f(res[name]["ttft_mean_s"]), res[name]["failed"], time.perf_counter() - t_start)
                runs.append({"client": client, "rate": rate, "seed": seed, "order": order,
                             "tool_time_s_mean": sum(r.tool_time_s for r in reqs) / len(reqs),
                             "calls_mean": sum(len(r.segments) for r in reqs) / len(reqs),
                             "kinds": {kd: sum(r.kind == kd for r in reqs)
                                       for kd in dict.fromkeys(r.kind for r in reqs)},
                             "variants": res,
                             "vs_infercept": ratios(res, "infercept"), "vs_discard": ratios(res, "discard")})
        predictors = {name: httpx.get(f"{s.url}/api/v1/stats", timeout=10).json().get("tools")
                      for name, s in servers.items()}
        first = next(iter(servers.values()))
        facts = first.engine_counters()
        model, numerics = first.model_id, first.numerics
    finally:
        for s in servers.values():
            s.stop()
        logf.close()
    return {"runs": runs, "startup_s": startup_s, "total_s": time.perf_counter() - t_start, "model": model,
            "numerics": numerics, "kv_blocks": facts["kv_blocks_total"], "block_size": facts["block_size"],
            "config": asdict(cfg), "skipped_variants": skipped, "predictors": predictors}


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(data: dict) -> str:
    """Markdown: the conditions, then a table per (client, rate) with every variant and its ratios."""
    parts = ["| condition | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in
                                                            data.get("conditions", {}).items())]
    for run in data["runs"]:
        rows = []
        for name in [v for v in data["config"]["variants"] if v in run["variants"]]:
            r = run["variants"][name]
            vi, vd = run["vs_infercept"][name], run["vs_discard"][name]
            pauses = r["engine"].get("tool_pauses") or {}
            rows.append([f"**{name}**" if name == "lamps" else name] + [_f(r[m]) for m in METRICS]
                        + [_r(vi[m]) for m in METRICS] + [_r(vd[m]) for m in METRICS]
                        + [" / ".join(f"{h[0]}{int(pauses.get(h, 0))}" for h in ("preserve", "swap", "discard")),
                           " / ".join(str((r["engine"].get("pause_events") or {}).get(k, "-"))
                                      for k in ("resumed", "expired", "demoted")),
                           str(r["engine"].get("preemptions", "-")), str(r["engine"].get("tokens_computed", "-")),
                           f"{r['completed']}/{r['requests']}"])
        headers = (["variant", "mean s", "p99 s", "TTFT mean s", "TTFT p99 s"]
                   + [f"{m} /infercept" for m in ("mean", "p99", "TTFT mean", "TTFT p99")]
                   + [f"{m} /discard" for m in ("mean", "p99", "TTFT mean", "TTFT p99")]
                   + ["pauses p/s/d", "resumed / expired / demoted", "preempt", "tokens computed", "done"])
        kinds = ", ".join(f"{k} {v}" for k, v in run["kinds"].items())
        parts.append(f"### {run['client']} client, {run['rate']:g} req/s (seed {run['seed']}; {kinds}; "
                     f"{run['calls_mean']:.1f} tool calls and {run['tool_time_s_mean']:.1f} s of tools per request "
                     f"on average; variant order {', '.join(run['order'])})\n\n" + md_table(headers, rows))
    pred = data.get("predictors") or {}
    if pred:
        rows = []
        for name, st in pred.items():
            ol, td = (st or {}).get("output_length") or {}, (st or {}).get("tool_durations") or {}
            rows.append([name, str(ol.get("observations", "-")), _f(ol.get("mean_abs_error")),
                         _f(ol.get("within_bin_rate")), ", ".join(f"{t} {v['mean_s']:.3g} s (n {v['count']})"
                                                                  for t, v in sorted(td.items()))])
        parts.append("### The manager's predictions over the whole run (`GET /api/v1/stats` -> `tools`)\n\n"
                     + md_table(["variant", "output-length observations", "MAE tokens", "within-bin rate",
                                 "tool durations learned (mean, count)"], rows))
    return "\n\n".join(parts) + "\n"


def conditions(data: dict, cfg: BenchConfig) -> dict:
    num = data.get("numerics") or {}
    lscpu = _lscpu_model()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m parrot.bench.tool_bench " + " ".join(sys.argv[1:]),
            "cpu (lscpu)": lscpu, "cpu path (engine numerics)": num.get("path"),
            "numerics": ", ".join(f"{k} {v}" for k, v in num.items() if k not in ("cpu_model",)),
            "cores": os.cpu_count(), "model": data.get("model"), "engine threads": 1,
            "KV pool": f"{data['kv_blocks']} blocks x {data['block_size']} = "
                       f"{data['kv_blocks'] * data['block_size']} tokens "
                       f"(PARROT_ENGINE_KV_CACHE_TOKENS={cfg.kv_tokens})",
            "mix": f"{cfg.mix}: " + ", ".join(f"{k.name} ({k.tool}, {k.calls[0]}-{k.calls[1]} calls, "
                                               f"w {k.weight})" for k in CPU_MIXES[cfg.mix]),
            "tools (mean, sd) s": ", ".join(f"{t.name} ({t.mean_s * cfg.workload.duration_scale:g}, "
                                            f"{t.sd_s * cfg.workload.duration_scale:g})" for t in CPU_TOOLS.values()),
            "sizes": f"prompt {cfg.workload.prompt_words} words, think {cfg.workload.out_tokens} tokens, tool result "
                     f"{cfg.workload.result_words} words, answer {cfg.workload.final_tokens} tokens",
            "rates req/s": ", ".join(f"{r:g}" for r in cfg.rates), "requests per run": cfg.requests,
            "seeds": f"base {cfg.seed} (per run: seed x 1000 + 10 x client + rate index)",
            "variants": ", ".join(f"{n} ({VARIANTS[n].description})" for n in data["config"]["variants"]),
            "skipped variants": "; ".join(f"{n}: {why}" for n, why in data.get("skipped_variants", {}).items())
                                or "none",
            "warm-up": f"{cfg.warmup} requests per client and server", "startup s": round(data["startup_s"], 1),
            "total s": round(data["total_s"], 1)}


def _lscpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        m = re.search(r"Model name:\s*(.+)", text)
        return m.group(1).strip() if m else "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def result_name(data: dict) -> str:
    from parrot.bench.machine import cpu_key

    return f"real-{cpu_key((data.get('numerics') or {}).get('path'))}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny random model, 2 variants, 3 requests")
    p.add_argument("--variants", default=None)
    p.add_argument("--clients", default=None)
    p.add_argument("--rates", default=None)
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--kv-tokens", type=int, default=None)
    p.add_argument("--mix", default=None, choices=sorted(CPU_MIXES))
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--tag", default=None, help="appended to the result files' name (real-<cpu path>-<cpu>-<tag>)")
    p.add_argument("--out", default=None, help="directory of the JSON + markdown (default docs/results/tools; with "
                   "--quick $TMPDIR/tool_bench_quick, so a smoke run never replaces the results)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    cfg = QUICK if args.quick else BenchConfig()
    over = {k: v for k, v in {
        "variants": tuple(args.variants.split(",")) if args.variants else None,
        "clients": tuple(args.clients.split(",")) if args.clients else None,
        "rates": tuple(float(r) for r in args.rates.split(",")) if args.rates else None,
        "requests": args.requests, "kv_tokens": args.kv_tokens, "mix": args.mix, "seed": args.seed,
        "warmup": args.warmup, "model": args.model}.items() if v is not None}
    cfg = replace(cfg, **over)
    tmp = os.environ.get("TMPDIR", "/tmp")
    out = Path(args.out or (os.path.join(tmp, "tool_bench_quick") if args.quick else "docs/results/tools"))
    data = run_all(cfg, Path(tmp) / "tool_bench.serve.log")
    data["conditions"] = conditions(data, cfg)
    text = report(data)
    name = result_name(data) + (f"-{args.tag}" if args.tag else "")
    save_json(str(out / f"{name}.json"), data)
    (out / f"{name}.md").write_text(f"# Tool calls on the real engine (`parrot.bench.tool_bench`)\n\n{text}",
                                    encoding="utf-8")
    print(text)
    return data


if __name__ == "__main__":
    main()
