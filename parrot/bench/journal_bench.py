"""What the session journal (``--state-dir``) costs per call: one app workload on an in-process manager and
builtin engine, run without and with the journal in alternating rounds of one run.

Each round is ``--apps`` concurrent apps (one session each) of a three-step chain, every step a semantic call::

    x = "topic <round>-<app>"   a = f(x)   b = g(a)   c = h(a, b)   get(a), get(b), get(c); delete the session

Prompts differ per app and round (the prefix cache cannot serve repeats). Reported per mode: wall time of the
rounds and calls/s; with the journal also the time the event loop spent inside journal hooks and commits (measured
around each, so it is the journal's own cost, free of the noise of the end-to-end comparison), writes and commits
per call, and the file size at the end of a round. The manager is driven in-process (no HTTP), which makes the
journal's share of a call larger than it is behind the HTTP server.

    .venv/bin/python -m parrot.bench.journal_bench --json bench_out/journal.json
    .venv/bin/python -m parrot.bench.journal_bench --tiny      # the tiny random engine: calls of ~ms
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import statistics
import tempfile
import time
from pathlib import Path

from parrot.common.report import format_conditions, format_table, ratio, save_json
from parrot.manager import EngineRegistry, Manager, ManagerConfig
from parrot.manager.journal import Journal, NullJournal, SqliteJournal
from parrot.manager.submit import PlaceholderSpec, SubmitSpec

STEPS = (
    ("Topic: {{input:x}}. A one-line title about it: {{output:a}}", ("x",)),
    ("Title: {{input:a}}\nFirst sentence of the article: {{output:b}}", ("a",)),
    ("Title: {{input:a}}\nOpening: {{input:b}}\nA closing sentence: {{output:c}}", ("a", "b")),
)
HOOKS = ("session_created", "session_deleted", "variable_added", "variable_done", "output_text", "perf_recorded",
         "request_added", "request_status")


class TimedJournal(SqliteJournal):
    """The SQLite journal with a stopwatch around every hook and commit (event-loop time spent journaling)."""

    def __init__(self, state_dir: str | Path) -> None:
        super().__init__(state_dir)
        self.seconds = 0.0
        self.hook_calls = 0
        self.commits = 0
        self.longest_commit_s = 0.0  # the longest the loop waited on one commit (a WAL checkpoint's fsync lands here)

    def _commit(self) -> None:
        t0 = time.perf_counter()
        busy = self._in_txn
        super()._commit()
        took = time.perf_counter() - t0
        self.seconds += took
        self.commits += busy
        self.longest_commit_s = max(self.longest_commit_s, took)


def _timed(name: str):
    inner = getattr(SqliteJournal, name)

    @functools.wraps(inner)
    def hook(self: TimedJournal, *args):
        t0 = time.perf_counter()
        inner(self, *args)
        self.seconds += time.perf_counter() - t0
        self.hook_calls += 1

    return hook


for _name in HOOKS:
    setattr(TimedJournal, _name, _timed(_name))


TOPICS = ("parrots", "rivers", "engines", "cities")


async def _app(mgr: Manager, tag: str, index: int, max_tokens: int) -> None:
    s = mgr.create_session()
    ids = {"x": mgr.create_variable(s, "x", f"topic {tag}: {TOPICS[index % len(TOPICS)]}").var_id}
    for prompt, inputs in STEPS:
        out = prompt.rsplit("{{output:", 1)[1][:-2]
        spec = SubmitSpec(prompt, [*(PlaceholderSpec(n, False, ids[n]) for n in inputs),
                                   PlaceholderSpec(out, True, sampling={"max_tokens": max_tokens})])
        ids[out] = mgr.submit(s, spec).outputs[0]
    for name in ("a", "b", "c"):
        await mgr.get_variable(s, ids[name], criteria="latency", timeout_s=60)
    await mgr.delete_session(s)


async def _round(engine, journal: Journal, apps: int, tag: str, max_tokens: int) -> float:
    mgr = Manager(EngineRegistry([engine]), config=ManagerConfig(engine_heartbeat_s=0), journal=journal)
    await mgr.start()
    t0 = time.perf_counter()
    await asyncio.gather(*(_app(mgr, f"{tag}-{i}", i, max_tokens) for i in range(apps)))
    wall = time.perf_counter() - t0
    await mgr.stop()
    return wall


async def run(args: argparse.Namespace) -> dict:
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.settings import EngineSettings

    settings = EngineSettings(random_model="tiny", dtype="float32", weight_quant="none") if args.tiny \
        else EngineSettings()
    engine = build_local_engine_client(settings)
    calls = args.apps * len(STEPS)
    out: dict = {"off": [], "on": []}
    try:
        await _round(engine, NullJournal(), args.apps, "warmup", args.max_tokens)
        with tempfile.TemporaryDirectory(prefix="journal-bench-") as tmp:
            for r in range(args.rounds):
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):  # ABBA: drift hits both alike
                    journal = TimedJournal(Path(tmp) / f"{r}") if mode == "on" else NullJournal()
                    wall = await _round(engine, journal, args.apps, f"{r}{mode}", args.max_tokens)
                    row = {"wall_s": wall, "calls": calls}
                    if isinstance(journal, TimedJournal):
                        row.update(journal_s=journal.seconds, hook_calls=journal.hook_calls,
                                   commits=journal.commits, file_bytes=journal.size_bytes(),
                                   longest_commit_ms=journal.longest_commit_s * 1e3)
                    out[mode].append(row)
    finally:
        await engine.close()
    return out


def summarize(out: dict) -> dict:
    off = [r["wall_s"] for r in out["off"]]
    on = [r["wall_s"] for r in out["on"]]
    calls = out["on"][0]["calls"]
    per_call_ms = [r["journal_s"] / r["calls"] * 1e3 for r in out["on"]]
    return {
        "calls_per_round": calls,
        "off_wall_s_median": statistics.median(off), "on_wall_s_median": statistics.median(on),
        "on_over_off": ratio(statistics.median(on), statistics.median(off)),
        "end_to_end_overhead_ms_per_call": (statistics.median(on) - statistics.median(off)) / calls * 1e3,
        "journal_ms_per_call_median": statistics.median(per_call_ms),
        "journal_share_of_on_wall": statistics.median(r["journal_s"] / r["wall_s"] for r in out["on"]),
        "hook_calls_per_call": out["on"][0]["hook_calls"] / calls,
        "commits_per_call": statistics.median(r["commits"] / r["calls"] for r in out["on"]),
        "file_bytes_after_round": statistics.median(r["file_bytes"] for r in out["on"]),
        "longest_commit_ms": max(r["longest_commit_ms"] for r in out["on"]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--apps", type=int, default=8, help="concurrent apps per round (3 semantic calls each)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per mode (alternating off / on)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="the tiny random engine instead of the default model")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = asyncio.run(run(args))
    s = summarize(out)
    rows = [["without journal", s["off_wall_s_median"], s["calls_per_round"] / s["off_wall_s_median"], None, None],
            ["with --state-dir", s["on_wall_s_median"], s["calls_per_round"] / s["on_wall_s_median"],
             s["journal_ms_per_call_median"] * 1e3, s["commits_per_call"]]]
    print(format_table(["", "round wall s (median)", "calls/s", "journal µs/call", "commits/call"], rows,
                       title=f"Journal cost: {args.apps} apps x {len(STEPS)} calls per round, {args.rounds} rounds "
                             "per mode"))
    print(f"\non / off wall: {s['on_over_off']:.3f}x; end-to-end difference {s['end_to_end_overhead_ms_per_call']:.3f}"
          f" ms per call (noise included); journal's own time {s['journal_ms_per_call_median'] * 1e3:.0f} µs per "
          f"call = {s['journal_share_of_on_wall'] * 100:.2f} % of the wall time; {s['hook_calls_per_call']:.1f} "
          f"journal writes per call; longest commit {s['longest_commit_ms']:.2f} ms; file after a round "
          f"{s['file_bytes_after_round'] / 1024:.0f} KiB\n")
    from parrot.bench.machine import describe_cpu, describe_machine

    conditions = {**describe_machine(), **describe_cpu(), "engine": "tiny random (fp32)" if args.tiny else
                  "default model (SmolLM2-135M Q4_1)", "max_tokens": args.max_tokens,
                  "journal": "SQLite WAL, synchronous=NORMAL, one commit per event-loop iteration",
                  "driver": "in-process Manager (no HTTP)"}
    print(format_conditions(conditions))
    if args.json:
        save_json(args.json, {"args": vars(args), "conditions": conditions, "summary": s, "rounds": out})


if __name__ == "__main__":
    main()
