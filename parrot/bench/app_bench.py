"""Chain and map-reduce summary, Parrot vs request-centric baseline, on one server in one run (paper §8.2).

    python -m parrot.bench.app_bench --url http://127.0.0.1:8000 --chunks 8 16 --output-len 25 50 \\
        --latency-ms 200 300 [--background 2] [--local]

For every (app, chunks, output length) both drivers run back to back on the same server (the order alternates
between repeats), with fixed output lengths (``ignore_eos`` + ``max_tokens``). How the emulated network
latency is charged is documented in :mod:`parrot.bench.apps`. ``--background N`` keeps N clients sending
unrelated completions during the measurements (paper Fig. 12a). Prints a table and its conditions, and saves
``bench_out/app_bench-<time>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import threading
import time
from pathlib import Path

from tqdm import tqdm

from parrot.bench.apps import run_baseline, run_parrot
from parrot.frontend.client import Session, connect
from parrot.workloads.apps import APPS, DEFAULT_DOCUMENT, load_document, split_words
from parrot.workloads.baseline_client import BaselineClient, EmulatedLatency

log = logging.getLogger(__name__)

BACKGROUND_MAX_S = 3600.0  # background clients stop by themselves after this, whatever happens


class BackgroundLoad:
    """N clients looping over /v1/completions in a thread of their own, until ``stop()`` (bounded in time)."""

    def __init__(self, url: str, api_key: str | None, clients: int, prompt: str, max_tokens: int) -> None:
        self.url, self.api_key, self.clients, self.prompt, self.max_tokens = url, api_key, clients, prompt, max_tokens
        self._stop = threading.Event()
        self.completed = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="bench-background",
                                        daemon=True)

    async def _worker(self, client: BaselineClient, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            await client.acomplete(f"[background {i}.{n}] {self.prompt}", max_tokens=self.max_tokens,
                                   ignore_eos=True)
            self.completed += 1
            n += 1

    async def _main(self) -> None:
        async with BaselineClient(self.url, api_key=self.api_key, latency_ms=(0, 0)) as client:
            workers = [asyncio.ensure_future(self._worker(client, i)) for i in range(self.clients)]
            deadline = time.monotonic() + BACKGROUND_MAX_S
            while not self._stop.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    def start(self) -> "BackgroundLoad":
        if self.clients > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)


def _run_baseline_sync(app, url: str, api_key: str | None, latency: EmulatedLatency, model: str | None):
    async def main():
        async with BaselineClient(url, api_key=api_key, latency=latency, model=model) as client:
            return await run_baseline(app, client)

    return asyncio.run(main())


def measure(args: argparse.Namespace, session: Session, url: str) -> list[dict]:
    """Run every configuration; returns one row per configuration (medians over repeats)."""
    text = load_document(args.document)
    latency = EmulatedLatency(tuple(args.latency_ms), args.seed)
    configs = [(a, c, o) for a in args.apps for c in args.chunks for o in args.output_len]
    rows = []
    run_no = 0
    no_latency = EmulatedLatency((0.0, 0.0))
    for w in range(args.warmup):  # unrecorded: first-use costs (allocations, kernels) hit neither mode
        for app_name in args.apps:
            app = APPS[app_name](split_words(text, min(args.chunks), args.chunk_words), min(args.output_len),
                                 tag=f"[warmup {args.seed}-{w}] ")
            run_parrot(app, session, no_latency)
            _run_baseline_sync(app, url, args.api_key, no_latency, args.model)
    with tqdm(total=len(configs) * args.repeats * 2, desc="app_bench", unit="run") as bar:
        for app_name, chunks, out_len in configs:
            pieces = split_words(text, chunks, args.chunk_words)
            times: dict[str, list[float]] = {"baseline": [], "parrot": []}
            trips: dict[str, int] = {}
            for rep in range(args.repeats):
                order = ("baseline", "parrot") if rep % 2 == 0 else ("parrot", "baseline")
                for mode in order:
                    run_no += 1
                    app = APPS[app_name](pieces, out_len, tag=f"[job {args.seed}-{run_no}] ")
                    bar.set_postfix_str(f"{app_name} x{chunks} len{out_len} {mode}")
                    if mode == "parrot":
                        result = run_parrot(app, session, latency)
                    else:
                        result = _run_baseline_sync(app, url, args.api_key, latency, args.model)
                    times[mode].append(result.e2e_s)
                    trips[mode] = result.round_trips
                    bar.update(1)
            base, parrot = statistics.median(times["baseline"]), statistics.median(times["parrot"])
            rows.append({"app": app_name, "chunks": chunks, "output_len": out_len, "calls": app.num_calls,
                         "baseline_s": base, "parrot_s": parrot, "ratio": base / parrot,
                         "baseline_round_trips": trips["baseline"], "parrot_round_trips": trips["parrot"],
                         "baseline_runs_s": times["baseline"], "parrot_runs_s": times["parrot"]})
    return rows


def _engine_conditions(args) -> dict:
    """The CPU and the default engine's numerics when the service runs here (--local); unknown for a --url."""
    if not args.local:
        return {"engine": "remote (see its /v1/models numerics)"}
    from parrot.bench.machine import describe_cpu

    return describe_cpu()


def print_table(rows: list[dict], conditions: dict) -> None:
    print("conditions: " + ", ".join(f"{k}={v}" for k, v in conditions.items()))
    header = f"{'app':<11} {'chunks':>6} {'out len':>7} {'calls':>5} {'baseline s':>11} {'parrot s':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['app']:<11} {r['chunks']:>6} {r['output_len']:>7} {r['calls']:>5} {r['baseline_s']:>11.2f} "
              f"{r['parrot_s']:>9.2f} {r['ratio']:>5.2f}x")


def plot(rows: list[dict], path: Path, conditions: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    apps = sorted({r["app"] for r in rows})
    fig, axes = plt.subplots(1, len(apps), figsize=(6 * len(apps), 4), squeeze=False)
    for ax, app in zip(axes[0], apps):
        mine = [r for r in rows if r["app"] == app]
        labels = [f"{r['chunks']} ch\nlen {r['output_len']}" for r in mine]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r["baseline_s"] for r in mine], 0.4, label="baseline (per-call client)")
        ax.bar([x + 0.2 for x in xs], [r["parrot_s"] for r in mine], 0.4, label="parrot (semantic variables)")
        for x, r in zip(xs, mine):
            ax.annotate(f"{r['ratio']:.2f}x", (x + 0.2, r["parrot_s"]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("end-to-end latency (s)")
        ax.set_title(f"{app} summary")
        ax.legend(fontsize=8)
    fig.suptitle(f"latency {conditions['latency_ms']} ms/call, background {conditions['background']}, "
                 f"{conditions['chunk_words']} words/chunk", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=os.environ.get("PARROT_URL", "http://127.0.0.1:8000"))
    p.add_argument("--api-key", default=os.environ.get("PARROT_API_KEY"))
    p.add_argument("--local", action="store_true", help="start the service in-process (P.local) instead of --url")
    p.add_argument("--model", default=None, help="model for /v1/completions (default: first of /v1/models); "
                   "with --local also the model file")
    p.add_argument("--apps", nargs="+", default=list(APPS), choices=list(APPS))
    p.add_argument("--chunks", nargs="+", type=int, default=[8, 16])
    p.add_argument("--output-len", nargs="+", type=int, default=[25, 50])
    p.add_argument("--chunk-words", type=int, default=100)
    p.add_argument("--latency-ms", nargs=2, type=float, default=[200.0, 300.0], metavar=("LOW", "HIGH"))
    p.add_argument("--background", type=int, default=0, help="concurrent background completion clients")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode and configuration (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up runs of each app in both modes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--document", default=str(DEFAULT_DOCUMENT))
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    if min(args.chunks) < 1 or min(args.output_len) < 1 or args.repeats < 1 or min(args.background,
                                                                                      args.warmup) < 0:
        p.error("--chunks, --output-len and --repeats must be >= 1; --background and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    if args.local:
        from parrot.frontend.local import local

        session = local(args.model, api_key=args.api_key, make_default=False)
        args.model = None
    else:
        session = connect(args.url, args.api_key, make_default=False)
    url = session.url
    background = BackgroundLoad(url, args.api_key, args.background,
                                load_document(args.document)[:2000], max(args.output_len)).start()
    try:
        started = time.strftime("%Y%m%d-%H%M%S")
        rows = measure(args, session, url)
    finally:
        background.stop()
        session.close()
    conditions = {"url": "local" if args.local else url, "latency_ms": tuple(args.latency_ms),
                  "background": args.background, "background_completed": background.completed,
                  "chunk_words": args.chunk_words, "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed,
                  "document": Path(args.document).name, "parrot_round_trips_per_run": 1,
                  "baseline_round_trips_per_run": "one per call", **_engine_conditions(args)}
    print_table(rows, conditions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"app_bench-{started}"
    stem.with_suffix(".json").write_text(json.dumps({"conditions": conditions, "rows": rows,
                                                     "args": asdict_args(args)}, indent=2))
    plot(rows, stem.with_suffix(".png"), conditions)
    print(f"saved {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0


def asdict_args(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k != "api_key"}


if __name__ == "__main__":
    raise SystemExit(main())
