"""Prefix sharing, three switches side by side in one run (paper §5.3, §7 kernel, §8.3, §8.4).

    python -m parrot.bench.prefix_bench [--requests 8 32] [--system-tokens 2000] [--out 50 200]

Switches (each a fresh in-process service on the default model):
  off     -- no sharing: manager prefix fork off, engine prefix cache off; every request computes its own KV
  paged   -- sharing on (manager forks the shared prefix context; engine prefix cache on), plain paged attention
  shared  -- sharing on + shared-prefix decode attention (prefix K/V read once per group, merged by LSE)

Workloads:
  copilot     -- one long system prompt (>= 2,000 tokens) shared by N concurrent user queries; outputs of
                 50..200 tokens (seeded, fixed with ignore_eos). Reports mean latency, mean time per output
                 token, and peak KV blocks in use (sampled) -- the memory ratio vs `off`.
  multiagent  -- architect writes a design doc (generated at run time) -> one coder per file -> one reviewer
                 per file -> one reviser per file, all later prompts starting with the design doc (§8.4).

Prints tables with ratios against `off` (and `shared` vs `paged`), its conditions, and saves JSON + PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import torch
from tqdm import tqdm

import parrot as P
from parrot.engine.files.model_files import default_model_path
from parrot.engine.files.tokenizer import load_tokenizer
from parrot.common.report import fmt_ratio, format_conditions, format_table, ratio, save_bar_panels, save_json

log = logging.getLogger(__name__)

CONFIGS = {
    "off": ({"prefix_sharing": False}, {"enable_prefix_cache": False, "shared_prefix_attention": False}),
    "paged": ({"prefix_sharing": True}, {"enable_prefix_cache": True, "shared_prefix_attention": False}),
    "shared": ({"prefix_sharing": True}, {"enable_prefix_cache": True, "shared_prefix_attention": True}),
}

TOPICS = ["weather", "stocks", "sports", "movies", "recipes", "travel", "history", "science", "music", "health",
          "gardening", "chess", "astronomy", "poetry", "economics", "geography"]


def system_prompt(n_tokens: int, tokenizer) -> str:
    """A Bing-Copilot-style instruction block with numbered 'search results', cut to ~n_tokens tokens."""
    rng = random.Random(1234)
    parts = ["You are a helpful search assistant. Answer the user's question using the search results below. "
             "Cite results by their number. Be concise, factual and polite.\n\n"]
    i = 0
    while len(tokenizer.encode("".join(parts))) < n_tokens:
        i += 1
        t = rng.sample(TOPICS, 3)
        parts.append(f"[{i}] Result about {t[0]}, {t[1]} and {t[2]}: the page explains how {t[0]} relates to "
                     f"{t[1]} in everyday life, lists {rng.randint(3, 12)} practical tips, and quotes experts "
                     f"who studied {t[2]} for {rng.randint(2, 40)} years.\n")
    return "".join(parts)


@dataclass
class Sampler:
    """Peak KV blocks in use, sampled from the server's engine status while a workload runs."""

    url: str
    period_s: float = 0.05
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> "Sampler":
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + 3600
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    for e in c.get(f"{self.url}/api/v1/engines").json()["engines"]:
                        if e["status"]:
                            self.peak = max(self.peak, e["status"]["kv_blocks_used"])
                except httpx.HTTPError:
                    pass
                time.sleep(self.period_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(10)


def copilot_fn(system: str) -> P.SemanticFunction:
    # the system prompt is constant template text: every call shares the prefix up to {{input:query}}
    template = system + "\nUser question: {{input:query}}\nAnswer: {{output:answer}}"
    return P.SemanticFunction(template, name="copilot", defaults=P.Output(stop=[]))


async def run_copilot(session, fn, n: int, out_range: tuple[int, int], seed: int) -> dict:
    rng = random.Random(seed)
    lens = [rng.randint(*out_range) for _ in range(n)]
    t0 = time.perf_counter()
    outs = [fn.options(outputs={"answer": P.Output(max_tokens=m, ignore_eos=True, stop=[])})(
        f"({i}) What should I know about {TOPICS[i % len(TOPICS)]} and {TOPICS[(i * 7 + 3) % len(TOPICS)]}?",
        session=session) for i, m in enumerate(lens)]
    done: list[float] = [0.0] * n

    async def one(i: int) -> None:
        await outs[i].aget(perf=P.LATENCY)
        done[i] = time.perf_counter() - t0

    await asyncio.gather(*(one(i) for i in range(n)))
    return {"mean_latency_s": sum(done) / n, "mean_tpot_s": sum(d / m for d, m in zip(done, lens)) / n,
            "makespan_s": max(done), "output_tokens": sum(lens)}


@P.semantic_function(max_tokens=160, ignore_eos=True, stop=[])
def architect(project: P.SemanticVariable):
    """You are a software architect. Write a design document for {{input:project}} with one section per file.
    Design document: {{output:design}}"""


def _stage(tpl: str, name: str, max_tokens: int) -> P.SemanticFunction:
    return P.SemanticFunction(tpl, name=name, defaults=P.Output(max_tokens=max_tokens, ignore_eos=True, stop=[]))


CODER = _stage("{{input:design}}\n\nYou are a programmer. Following the design above, write {{input:file}}.\n"
               "Code: {{output:code}}", "coder", 64)
REVIEWER = _stage("{{input:design}}\n\nYou are a reviewer. Review this code of {{input:file}}: {{input:code}}\n"
                  "Review: {{output:review}}", "reviewer", 32)
REVISER = _stage("{{input:design}}\n\nRevise {{input:file}} given the review. Code: {{input:code}}\n"
                 "Review: {{input:review}}\nRevised code: {{output:revised}}", "reviser", 64)


async def run_multiagent(session, files: int, tag: str) -> dict:
    t0 = time.perf_counter()
    design = architect(f"{tag}: a command-line todo application", session=session)
    revised = []
    for i in range(files):
        f = f"file_{i}.py"
        code = CODER(design, f, session=session)
        review = REVIEWER(design, f, code, session=session)
        revised.append(REVISER(design, f, code, review, session=session))
    await asyncio.gather(*(r.aget(perf=P.LATENCY) for r in revised))
    return {"latency_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--out", type=int, nargs=2, default=[50, 200], metavar=("MIN", "MAX"))
    ap.add_argument("--files", type=int, default=6, help="multi-agent: files (coder+reviewer+reviser each)")
    ap.add_argument("--configs", default="off,paged,shared")
    ap.add_argument("--workloads", default="copilot,multiagent")
    ap.add_argument("--kv-cache-tokens", type=int, default=131072)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="bench_out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    configs = args.configs.split(",")
    workloads = args.workloads.split(",")
    results: dict = {c: {} for c in configs}
    steps = len(configs) * (len(args.requests) * ("copilot" in workloads) + ("multiagent" in workloads))
    system = system_prompt(args.system_tokens, load_tokenizer(default_model_path()))
    bar = tqdm(total=steps, desc="prefix_bench", unit="run")
    for cfg in configs:
        server_kw, engine_kw = CONFIGS[cfg]
        with P.local(server_settings=server_kw, kv_cache_tokens=args.kv_cache_tokens,
                     num_threads=args.threads, make_default=False, **engine_kw) as s:
            fn = copilot_fn(system)
            asyncio.run(run_copilot(s, fn, 1, (4, 4), args.seed))  # warm-up (loads the prefix once)
            if "copilot" in workloads:
                for n in args.requests:
                    with Sampler(s.url) as smp:
                        r = asyncio.run(run_copilot(s, fn, n, tuple(args.out), args.seed + n))
                    r["peak_kv_blocks"] = smp.peak
                    results[cfg][f"copilot-{n}"] = r
                    bar.update(1)
            if "multiagent" in workloads:
                with Sampler(s.url) as smp:
                    r = asyncio.run(run_multiagent(s, args.files, f"run-{cfg}"))
                r["peak_kv_blocks"] = smp.peak
                results[cfg]["multiagent"] = r
                bar.update(1)
    bar.close()
    rows = []
    for key in results[configs[0]]:
        for cfg in configs:
            r = results[cfg][key]
            base = results.get("off", {}).get(key)
            lat = r.get("mean_latency_s", r.get("latency_s"))
            base_lat = base.get("mean_latency_s", base.get("latency_s")) if base else None
            paged = results.get("paged", {}).get(key)
            paged_lat = paged.get("mean_latency_s", paged.get("latency_s")) if paged else None
            rows.append([key, cfg, lat, r.get("mean_tpot_s"), r["peak_kv_blocks"],
                         fmt_ratio(ratio(base_lat, lat)), fmt_ratio(ratio(paged_lat, lat)) if cfg == "shared" else "",
                         fmt_ratio(ratio(base["peak_kv_blocks"], r["peak_kv_blocks"])) if base else ""])
    print(format_table(["workload", "config", "mean latency s", "mean s/token", "peak KV blocks", "speedup vs off",
                        "shared vs paged", "KV off/this"], rows, title="Prefix sharing"))
    from parrot.bench.machine import describe_cpu

    conditions = {"model": "SmolLM2-135M-Instruct Q4_1 (engine defaults)", **describe_cpu(),
                  "system_tokens": args.system_tokens,
                  "requests": args.requests, "output_tokens": args.out, "files": args.files,
                  "kv_cache_tokens": args.kv_cache_tokens, "threads": args.threads or torch.get_num_threads(),
                  "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d %H:%M")}
    print(format_conditions(conditions))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    save_json(f"{args.out_dir}/prefix_bench-{stamp}.json", {"conditions": conditions, "results": results})
    panels = {key: {cfg: results[cfg][key].get("mean_latency_s", results[cfg][key].get("latency_s"))
                    for cfg in configs} for key in results[configs[0]]}
    print("plot:", save_bar_panels(f"{args.out_dir}/prefix_bench-{stamp}.png", panels, title="Prefix sharing",
                                   ylabel="latency (s)"))


if __name__ == "__main__":
    main()
