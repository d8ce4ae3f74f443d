"""What streaming Semantic Variables cost: the paper's summary apps with the executor streaming outputs or not.

    python -m parrot.bench.stream_bench [--apps chain map_reduce] [--chunks 8] [--output-len 50] [--repeats 3] \\
        [--engine-procs 0]

One in-process server (the real app, uvicorn on 127.0.0.1) with the default builtin engine in the same process
(``--engine-procs 0``) or in N ``parrot engine`` processes reached over HTTP, and one session. Each
configuration runs in three modes, back to back, the order rotating between repeats:

* ``off``: the executor generates with ``EngineClient.generate`` (``GraphExecutor.stream_outputs = False``):
  the code path before streaming existed;
* ``on``: it generates through ``generate_stream`` into the variables' piece logs (the default), nobody reads;
* ``on+reader``: as ``on``, and the client reads the final value with ``var.stream()`` instead of ``get()``
  (also reports when its first piece arrived).

Every run tags its prompts (prefix cache off the table). Prints medians, the ratios ``off / on`` and
``off / on+reader`` (1.00x = no cost; below 1 = streaming is slower) of the medians and of the best runs (the
least disturbed on a shared machine), and the conditions; saves JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import statistics
import time
from pathlib import Path

import httpx

from parrot.bench.apps import _functions, run_parrot
from parrot.bench.machine import describe_cpu, describe_machine
from parrot.frontend.variable import LATENCY
from parrot.workloads.apps import APPS, DEFAULT_DOCUMENT, Const, load_document, split_words
from parrot.workloads.baseline_client import EmulatedLatency

log = logging.getLogger(__name__)

MODES = ("off", "on", "on+reader")


def _run_reader(app, session) -> tuple[float, float, str]:
    """Submit every step, stream the final value; (end-to-end s, first piece s, text)."""
    funcs = _functions(app)
    t0 = time.perf_counter()
    outputs = {}
    for step in app.steps:
        args = {k: ref.text if isinstance(ref, Const) else outputs[ref.step] for k, ref in step.inputs}
        outputs[step.name] = funcs[step.template](session=session, **args)
    first = None
    pieces = []
    for piece in outputs[app.final].stream(perf=LATENCY):
        if first is None:
            first = time.perf_counter() - t0
        pieces.append(piece)
    return time.perf_counter() - t0, first or 0.0, "".join(pieces)


def measure(args: argparse.Namespace, session, executor) -> list[dict]:
    text = load_document(args.document)
    none = EmulatedLatency((0.0, 0.0))
    rows = []
    run_no = 0
    for w in range(args.warmup):
        app = APPS[args.apps[0]](split_words(text, min(args.chunks), args.chunk_words), min(args.output_len),
                                 tag=f"[warmup {w}] ")
        run_parrot(app, session, none)
    for app_name in args.apps:
        for chunks in args.chunks:
            for out_len in args.output_len:
                pieces = split_words(text, chunks, args.chunk_words)
                times: dict[str, list[float]] = {m: [] for m in MODES}
                firsts: list[float] = []
                for rep in range(args.repeats):
                    order = MODES[rep % 3:] + MODES[:rep % 3]
                    for mode in order:
                        run_no += 1
                        app = APPS[app_name](pieces, out_len, tag=f"[job {run_no}] ")
                        executor.stream_outputs = mode != "off"
                        if mode == "on+reader":
                            e2e, first, _ = _run_reader(app, session)
                            firsts.append(first)
                        else:
                            e2e = run_parrot(app, session, none).e2e_s
                        times[mode].append(e2e)
                        log.info("%s x%d len%d %s: %.2f s", app_name, chunks, out_len, mode, e2e)
                med = {m: statistics.median(v) for m, v in times.items()}
                rows.append({"app": app_name, "chunks": chunks, "output_len": out_len, "calls": app.num_calls,
                             "off_s": med["off"], "on_s": med["on"], "reader_s": med["on+reader"],
                             "reader_first_piece_s": statistics.median(firsts),
                             "ratio_on": med["off"] / med["on"], "ratio_reader": med["off"] / med["on+reader"],
                             # best runs: the least disturbed by other load on a shared machine
                             "ratio_on_best": min(times["off"]) / min(times["on"]),
                             "ratio_reader_best": min(times["off"]) / min(times["on+reader"]),
                             "runs_s": times, "first_piece_runs_s": firsts})
    executor.stream_outputs = True
    return rows


def print_table(rows: list[dict], conditions: dict) -> None:
    print("conditions: " + ", ".join(f"{k}={v}" for k, v in conditions.items()))
    header = (f"{'app':<11} {'chunks':>6} {'out len':>7} {'off s':>7} {'on s':>7} {'reader s':>9} "
              f"{'1st piece s':>11} {'off/on':>7} {'off/reader':>10} {'best off/on':>11} {'best off/reader':>15}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['app']:<11} {r['chunks']:>6} {r['output_len']:>7} {r['off_s']:>7.2f} {r['on_s']:>7.2f} "
              f"{r['reader_s']:>9.2f} {r['reader_first_piece_s']:>11.2f} {r['ratio_on']:>6.2f}x "
              f"{r['ratio_reader']:>9.2f}x {r['ratio_on_best']:>10.2f}x {r['ratio_reader_best']:>14.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--apps", nargs="+", default=["chain", "map_reduce"], choices=sorted(APPS))
    p.add_argument("--chunks", nargs="+", type=int, default=[8])
    p.add_argument("--output-len", nargs="+", type=int, default=[50])
    p.add_argument("--chunk-words", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--document", default=str(DEFAULT_DOCUMENT))
    p.add_argument("--engine-procs", type=int, default=0, help="engine processes over HTTP (0: one in-process)")
    p.add_argument("--out", default="bench_out")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.settings import EngineSettings
    from parrot.frontend.client import connect
    from parrot.frontend.local import LocalServer, _close_engines

    from parrot.engine.server.procs import start_engines, stop_all

    secret = secrets.token_urlsafe(24)
    engines = [] if args.engine_procs else [build_local_engine_client(EngineSettings())]
    app = create_app(ServerSettings(engine_secret=secret), engines)
    server = LocalServer(app)
    procs = []
    try:
        if args.engine_procs:  # engine processes behind HTTP: the executor reads their SSE streams
            procs = start_engines(args.engine_procs, server.url, secret=secret, prefix="sb")
            deadline = time.monotonic() + 600
            while len(httpx.get(f"{server.url}/ready", timeout=5).json()["engines"]) < args.engine_procs:
                if time.monotonic() > deadline:
                    raise TimeoutError("engine processes did not register within 600 s")
                time.sleep(0.5)
        with connect(server.url, make_default=False) as session:
            rows = measure(args, session, app.state.manager.executor)
    finally:
        server.stop()
        stop_all(procs)
        _close_engines(engines)
    conditions = {**describe_machine(), **describe_cpu(), "code": "parrot.manager.value_stream via "
                  "GraphExecutor.stream_outputs", "engines": f"{args.engine_procs} processes (HTTP)"
                  if args.engine_procs else "1 in-process", "chunk_words": args.chunk_words, "repeats": args.repeats}
    print_table(rows, conditions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"stream_bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=2))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
