"""Scrape ``/metrics`` of ``parrot serve --engines N`` and of its engine processes before, during and after a
workload, parse every scrape with the Prometheus text parser, and report each metric's before / during / after
values and whether it moved (every metric should change under load; one that does not is dead).

    python -m parrot.bench.metrics_scrape [--engines 2] [--rounds 2] [--app-bench] [--json out.json]

The server runs with an API key (the scraper sends it as a bearer token, as a Prometheus scrape config would) and
the ``fifo-latency`` policy with a small per-engine token cap, and engines that run at most 3 sequences at once, so
requests also wait in the manager's queue and in the engines' (the queue gauges move). The workload
(:func:`mixed_round`) mixes Parrot-API apps whose requests share a prompt prefix (prefix-sharing forks), OpenAI
completions with ``n=3`` (forks decoding together: shared-prefix decode rows), streamed chat, a repeated prompt
(prefix-cache hits) and a backlog of plain completions; prompts vary per round. ``--app-bench`` also runs a small
``parrot.bench.app_bench`` against the same server at the same time. The first scrape is taken before the engines
registered (engine liveness moves from absent to 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from parrot.bench.cluster_bench import Cluster
from parrot.engine.server.procs import free_port

log = logging.getLogger(__name__)

API_KEY = "sk-metrics-scrape"
STARTUP_TIMEOUT_S = 300.0
# the list, as metric families of the server's /metrics (parrot.manager.metrics, parrot.protocol.metrics)
REQUIRED = {
    "requests by API / status / policy": ("parrot_requests",),
    "queue lengths": ("parrot_queue_length", "parrot_engine_waiting_requests"),
    "running tokens": ("parrot_engine_running_tokens", "parrot_placed_tokens"),
    "KV blocks used / shared / cached": ("parrot_engine_kv_blocks_used", "parrot_engine_kv_blocks_shared",
                                         "parrot_engine_kv_blocks_cached"),
    "prefix-cache hit rate": ("parrot_engine_prefix_cache_hit_rate",),
    "shared-prefix decode rows": ("parrot_engine_shared_prefix_decode_rows",),
    "TTFT / TPOT / end-to-end histograms": ("parrot_time_to_first_token_seconds",
                                            "parrot_time_per_output_token_seconds",
                                            "parrot_e2e_request_latency_seconds"),
    "placement decisions by reason": ("parrot_placements",),
    "engine liveness": ("parrot_engine_up",),
}
# what an engine process's own /metrics must show moving
ENGINE_REQUIRED = ("parrot_engine_steps", "parrot_engine_tokens_computed", "parrot_engine_running_requests",
                   "parrot_engine_kv_blocks_used", "parrot_engine_kv_blocks_cached")
ENGINE_REPORTED = ENGINE_REQUIRED + ("parrot_engine_shared_prefix_decode_rows", "parrot_engine_prefix_cache_hit_rate")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (sample name, sorted labels) -> value


@dataclass
class Scrape:
    """One parsed exposition: family name -> type, and family name -> its samples."""

    t: float
    types: dict[str, str]
    samples: dict[str, Samples]

    @classmethod
    def parse(cls, text: str, t: float | None = None) -> "Scrape":
        types: dict[str, str] = {}
        samples: dict[str, Samples] = {}
        for fam in text_string_to_metric_families(text):
            types[fam.name] = fam.type
            out = samples.setdefault(fam.name, {})
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(time.time() if t is None else t, types, samples)

    def value(self, family: str) -> float | None:
        """One number per family for the report: counters their ``_total`` summed over labels, histograms their
        ``_count``, gauges their sum (``*_rate`` gauges their max); None if the family has no sample."""
        got = self.samples.get(family)
        if not got:
            return None
        kind = self.types.get(family)
        if kind == "counter":
            vals = [v for (name, _), v in got.items() if name.endswith("_total")]
        elif kind == "histogram":
            vals = [v for (name, _), v in got.items() if name.endswith("_count")]
        else:
            vals = list(got.values())
        if not vals:
            return None
        return max(vals) if family.endswith("_rate") else sum(vals)


def moved(before: Scrape, later: Sequence[Scrape], family: str) -> bool:
    """Whether any sample of ``family`` appeared or took another value in a later scrape."""
    base = before.samples.get(family, {})
    for s in later:
        for key, v in s.samples.get(family, {}).items():
            if key[0].endswith("_created"):
                continue
            if base.get(key) != v:
                return True
    return False


class Scraper:
    """Scrapes ``targets`` (name -> URL) every ``interval_s`` in a thread until :meth:`stop`; keeps every scrape."""

    def __init__(self, targets: dict[str, str], headers: dict[str, str], interval_s: float = 0.25) -> None:
        self.targets, self.headers, self.interval_s = targets, headers, interval_s
        self.scrapes: dict[str, list[Scrape]] = {name: [] for name in targets}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-scraper", daemon=True)

    def scrape(self, name: str) -> Scrape:
        r = httpx.get(self.targets[name], headers=self.headers, timeout=10)
        r.raise_for_status()
        return Scrape.parse(r.text)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for name in self.targets:
                try:
                    self.scrapes[name].append(self.scrape(name))
                except httpx.HTTPError:
                    self.errors += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


# ---- the server -------------------------------------------------------------------------------------------------
class Serve(Cluster):
    """``parrot serve --engines N`` with an API key, in its own process group (stopped as a whole by the cluster
    benchmark's :meth:`Cluster.stop`); the engines' URLs from its banner."""

    def __init__(self, engines: int, log_path: Path, extra: Sequence[str] = ()) -> None:
        # not Cluster.__init__: another command line (API key, heartbeats, caps); stop() needs _proc and _log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engines = engines
        self.log_path = log_path
        cmd = [sys.executable, "-m", "parrot.cli", "--log-level", "WARNING", "serve", "--engines", str(engines),
               "--port", str(self.port), "--api-key", API_KEY, "--num-threads", "1", "--kv-cache-tokens", "8192",
               "--engine-heartbeat-s", "0.5", "--policy", "fifo-latency", "--latency-cap-tokens", "400",
               "--max-num-seqs", "3", "--shared-prefix-attention", "on", *extra]  # on: its metric must move
        self._log = open(log_path, "wb")
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait(self, cond: Callable[[], object], what: str) -> object:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"parrot serve exited with {self._proc.returncode}; see {self.log_path}")
            try:
                got = cond()
                if got:
                    return got
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{what} not after {STARTUP_TIMEOUT_S} s; see {self.log_path}")

    def wait_up(self) -> None:
        self._wait(lambda: httpx.get(f"{self.url}/health", timeout=2).status_code == 200, "server up")

    def engine_urls(self) -> dict[str, str]:
        """Engine name -> URL, from the banner ``... engine-0=http://127.0.0.1:PORT (pid N), ...``."""
        def found() -> dict[str, str]:
            text = self.log_path.read_text(errors="replace")
            return dict(re.findall(r"(\S+)=(http://127\.0\.0\.1:\d+) \(pid", text))

        return self._wait(lambda: len(found()) >= self.engines and found(), "the engines' URLs")  # type: ignore

    def wait_ready(self) -> None:
        def ready() -> bool:
            r = httpx.get(f"{self.url}/ready", timeout=2)
            return r.status_code == 200 and len(r.json()["engines"]) >= self.engines

        self._wait(ready, f"{self.engines} live engine(s)")


# ---- the workload -----------------------------------------------------------------------------------------------
TOPICS = ["lighthouses", "tides", "glaciers", "volcanoes", "bridges", "orchards", "comets", "deserts", "rivers",
          "libraries", "harbors", "forests"]
SYSTEM = ("You are a careful assistant. You answer in plain words, one short sentence at a time, without lists, "
          "without headings and without repeating the question. ")


@dataclass
class Client:
    url: str
    key: str
    model: str
    failures: list[str] = field(default_factory=list)

    def post(self, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
        r = httpx.post(f"{self.url}{path}", json=body, timeout=300,
                       headers={"Authorization": f"Bearer {self.key}", **(headers or {})})
        if r.status_code != 200:
            self.failures.append(f"{path}: {r.status_code} {r.text[:200]}")
        return r


def parrot_app(c: Client, topic: str, questions: int = 3, max_tokens: int = 24) -> None:
    """A session whose requests share ``SYSTEM + topic`` (prefix sharing forks them off one prefix context)."""
    r = c.post("/api/v1/sessions", {"ttl_s": 120})
    if r.status_code != 200:
        return
    sid, token = r.json()["session_id"], r.json()["token"]
    h = {"X-Parrot-Session-Token": token}
    base = f"/api/v1/sessions/{sid}"
    var = c.post(f"{base}/variables", {"name": "topic", "value": topic}, h).json()["var_id"]
    outs = []
    for q in range(questions):
        r = c.post(f"{base}/submit", {
            "prompt": SYSTEM + "Topic: {{input:topic}}.\n" + f"Question {q + 1}: name one fact about it.\n"
                      "Answer: {{output:a}}",
            "placeholders": [{"name": "topic", "is_output": False, "var_id": var},
                             {"name": "a", "is_output": True,
                              "sampling": {"max_tokens": max_tokens, "ignore_eos": True, "stop": []}}]}, h)
        if r.status_code == 200:
            outs.append(r.json()["outputs"]["a"])
    for vid in outs:
        got = httpx.get(f"{c.url}{base}/variables/{vid}", params={"timeout": 60, "criteria": "latency"},
                        headers={"Authorization": f"Bearer {c.key}", **h}, timeout=90)
        if got.status_code != 200 or got.json()["status"] != "ready":
            c.failures.append(f"get {vid}: {got.status_code} {got.text[:200]}")
    httpx.delete(f"{c.url}{base}", headers={"Authorization": f"Bearer {c.key}", **h}, timeout=30)


def forked_completion(c: Client, topic: str, seed: int, max_tokens: int = 24) -> None:
    """``n=3`` choices forked from one filled prompt (> 2 KV blocks): they decode as one shared-prefix group."""
    prompt = SYSTEM * 2 + f"Write three different opening lines for a story about {topic}.\nLine:"
    c.post("/v1/completions", {"model": c.model, "prompt": prompt, "n": 3, "max_tokens": max_tokens,
                               "temperature": 0.8, "seed": seed, "ignore_eos": True})


def streamed_chat(c: Client, topic: str, max_tokens: int = 24) -> None:
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", timeout=300,
                      headers={"Authorization": f"Bearer {c.key}"},
                      json={"model": c.model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                            "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": f"Say something about {topic}."}]}) as r:
        if r.status_code != 200:
            c.failures.append(f"chat stream: {r.status_code}")
        for _ in r.iter_lines():
            pass


def plain_completion(c: Client, prompt: str, max_tokens: int = 32) -> None:
    c.post("/v1/completions", {"model": c.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


def mixed_round(c: Client, rnd: int, backlog: int = 8) -> None:
    """One round: a repeated prompt first (prefix-cache hits), then a concurrent burst of every kind of call, the
    forks first (so their choices start together), ``backlog`` plain completions last (more tokens than the
    engines' caps hold: the rest wait in the manager's queue for seconds)."""
    rng = random.Random(rnd)
    topics = rng.sample(TOPICS, 6)
    repeated = SYSTEM + f"Round {rnd}: describe {topics[0]} in one sentence."
    for _ in range(2):
        c.post("/v1/completions", {"model": c.model, "prompt": repeated, "max_tokens": 4, "temperature": 0})
    jobs: list[Callable[[], None]] = [
        lambda: forked_completion(c, topics[3], rnd), lambda: forked_completion(c, topics[4], rnd + 100),
        lambda: streamed_chat(c, topics[5]), lambda: streamed_chat(c, topics[0]),
        lambda: parrot_app(c, topics[1]), lambda: parrot_app(c, topics[2]),
        *[lambda k=k: plain_completion(c, f"Note {k} on {topics[k % 6]} (round {rnd}):") for k in range(backlog)],
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for f in [pool.submit(j) for j in jobs]:
            f.result()


# ---- one run ----------------------------------------------------------------------------------------------------
@dataclass
class EngineScrapes:
    before: Scrape
    during: list[Scrape]
    after: Scrape


@dataclass
class Run:
    server: dict[str, Scrape]  # "start" (engines not registered yet), "before", "after"
    during: list[Scrape]
    engines: dict[str, "EngineScrapes"]  # each engine process's own /metrics
    failures: list[str]
    wall_s: float

    def report(self) -> dict:
        """Per required family: before / min and max during / after (see Scrape.value) and whether it moved."""
        later = self.during + [self.server["after"]]
        rows = {}
        for item, fams in REQUIRED.items():
            for fam in fams:
                base = self.server["start"] if item == "engine liveness" else self.server["before"]
                during = [v for v in (s.value(fam) for s in self.during) if v is not None]
                rows[fam] = {"item": item, "type": self.server["after"].types.get(fam),
                             "before": base.value(fam), "during_min": min(during, default=None),
                             "during_max": max(during, default=None), "after": self.server["after"].value(fam),
                             "moved": moved(base, later if item != "engine liveness"
                                            else [self.server["before"], *later], fam)}
        engines = {name: {fam: {"before": e.before.value(fam), "during_max": max(
            (v for v in (s.value(fam) for s in e.during) if v is not None), default=None), "after": e.after.value(fam),
            "moved": moved(e.before, [*e.during, e.after], fam)} for fam in ENGINE_REPORTED}
            for name, e in self.engines.items()}
        after = {fam: {_series(name, labels): v for (name, labels), v in got.items()
                       if not name.endswith(("_created", "_bucket"))}
                 for fam, got in self.server["after"].samples.items()}
        return {"server": rows, "engines": engines, "scrapes_during": len(self.during), "wall_s": self.wall_s,
                "failures": self.failures[:20], "after": after}


def _series(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")


def run(engines: int = 2, rounds: int = 1, *, app_bench: bool = False, log_dir: Path | None = None) -> Run:
    """Start the server, scrape, run the workload while scraping, scrape again; always stops the server."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="metrics_scrape_"))
    serve = Serve(engines, log_dir / "serve.log")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        serve.wait_up()
        start = Scraper({"server": f"{serve.url}/metrics"}, headers).scrape("server")
        urls = serve.engine_urls()
        serve.wait_ready()
        targets = {"server": f"{serve.url}/metrics", **{n: f"{u}/metrics" for n, u in urls.items()}}
        model = httpx.get(f"{serve.url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        client = Client(serve.url, API_KEY, model)
        scraper = Scraper(targets, headers)
        before = {n: scraper.scrape(n) for n in targets}
        t0 = time.monotonic()
        bench = None
        with scraper:
            if app_bench:
                bench = subprocess.Popen(
                    [sys.executable, "-m", "parrot.bench.app_bench", "--url", serve.url, "--api-key", API_KEY,
                     "--chunks", "4", "--output-len", "16", "--warmup", "0", "--background", "1",
                     "--out", str(log_dir / "app_bench")],
                    stdout=open(log_dir / "app_bench.log", "wb"), stderr=subprocess.STDOUT)
            for rnd in range(rounds):
                mixed_round(client, rnd)
            if bench is not None and bench.wait(1800) != 0:
                client.failures.append(f"app_bench exited with {bench.returncode}; see {log_dir / 'app_bench.log'}")
            time.sleep(1.0)  # one more heartbeat: the engines' final counters reach the manager
        wall = time.monotonic() - t0
        after = {n: scraper.scrape(n) for n in targets}
        eng = {n: EngineScrapes(before[n], scraper.scrapes[n], after[n]) for n in urls}
        return Run({"start": start, "before": before["server"], "after": after["server"]}, scraper.scrapes["server"],
                   eng, client.failures, wall)
    finally:
        serve.stop()


def _fmt(v: float | None) -> str:
    return "-" if v is None else (f"{v:.3f}" if abs(v) < 10 and v != int(v) else f"{v:g}")


def main(argv: list[str] | None = None) -> None:
    from parrot.bench.machine import describe_cpu, describe_machine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--app-bench", action="store_true", help="also run a small parrot.bench.app_bench meanwhile")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args.engines, args.rounds, app_bench=args.app_bench)
    report = {"conditions": {**describe_machine(), **describe_cpu(), "engines": args.engines, "rounds": args.rounds,
                             "app_bench": args.app_bench, "policy": "fifo-latency", "latency_cap_tokens": 400},
              **result.report()}
    print(f"# /metrics during a workload: {report['conditions']['cpu']} ({report['conditions']['cpu_path']}), "
          f"{report['conditions']['date']}, {report['scrapes_during']} scrapes in {result.wall_s:.1f} s")
    print("| item | metric | type | before | during (min..max) | after | moved |")
    print("|---|---|---|---|---|---|---|")
    for fam, row in report["server"].items():
        print(f"| {row['item']} | `{fam}` | {row['type']} | {_fmt(row['before'])} | {_fmt(row['during_min'])}.."
              f"{_fmt(row['during_max'])} | {_fmt(row['after'])} | {'yes' if row['moved'] else 'NO'} |")
    for name, fams in report["engines"].items():
        print(f"\nengine process {name} (its own /metrics):")
        for fam, row in fams.items():
            print(f"  {fam}: {_fmt(row['before'])} -> max {_fmt(row['during_max'])} -> {_fmt(row['after'])}"
                  f"{'' if row['moved'] else '  (did not move)'}")
    after = report["after"]
    print("\nafter, by label:")
    for fam in ("parrot_requests", "parrot_placements"):
        for series, v in sorted(after.get(fam, {}).items()):
            print(f"  {series} {v:g}")
    for fam in ("parrot_time_to_first_token_seconds", "parrot_time_per_output_token_seconds",
                "parrot_e2e_request_latency_seconds"):
        got = after.get(fam, {})
        for series, n in sorted(got.items()):
            if "_count" in series and n:
                print(f"  {series.replace('_count', '')} mean {got[series.replace('_count', '_sum')] / n:.3f} s "
                      f"over {n:g}")
    if report["failures"]:
        print("\nfailed calls:", *report["failures"], sep="\n  ")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
