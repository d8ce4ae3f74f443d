"""Load benchmark: many concurrent app sessions and OpenAI clients against one `parrot serve`.

    python -m parrot.bench.load_bench [--sessions 200] [--calls 10] [--openai 200] [--max-tokens 8]
                                      [--soak-s 0] [--url URL] [--json PATH] [-- serve flags...]

Without ``--url`` it starts ``parrot serve`` (a real process, 127.0.0.1, the tiny random engine unless serve
flags after ``--`` say otherwise) and measures that process's RSS. Each session is one asyncio task with its own
HTTP client: it creates a session and submits ``--calls`` semantic calls at once (independent ones, each a
``{{output}}`` over a distinct prompt), then long-polls every output; ``--openai`` chat completions run beside
them. Reported: calls answered / lost (an error) / hung (no answer within the bound), latency p50 / p99 / max of
the semantic calls (submit to value), throughput, fairness (the median latency of the first tenth of calls to
be submitted vs the last tenth: early work should finish early, not wait for the whole backlog), and the server's RSS
before, at the peak and after (``--soak-s``: repeat the load for that long and sample RSS every 10 s).
Every loop is bounded; the run stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

from parrot.common.report import format_conditions, format_table, save_json

log = logging.getLogger(__name__)
CALL_BOUND_S = 600.0  # a call not answered within this is "hung"
DEFAULT_SERVE = ["--random-model", "tiny", "--dtype", "float32", "--weight-quant", "none", "--kv-cache-tokens", "65536"]


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def one_session(url: str, index: int, calls: int, max_tokens: int, out: dict) -> None:
    """One app: a session, ``calls`` submits at once, then a long-poll GET of each output (bounded)."""
    answered = 0
    async with httpx.AsyncClient(base_url=url, timeout=90) as c:
        try:
            s = (await c.post("/api/v1/sessions", json={"ttl_s": 3600})).json()
            h = {"X-Parrot-Session-Token": s["token"]}
            base = f"/api/v1/sessions/{s['session_id']}"
            outputs = []
            for j in range(calls):
                r = await c.post(f"{base}/submit", headers=h, json={
                    "prompt": f"Session {index} call {j}: say something. {{{{output:o}}}}",
                    "placeholders": [{"name": "o", "is_output": True,
                                      "sampling": {"max_tokens": max_tokens, "ignore_eos": True}}]})
                r.raise_for_status()
                outputs.append((time.monotonic(), r.json()["outputs"]["o"]))
            for t0, vid in outputs:
                deadline = t0 + CALL_BOUND_S
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        out["hung"] += 1
                        break
                    r = await c.get(f"{base}/variables/{vid}", headers=h,
                                    params={"criteria": "latency", "timeout": min(60.0, left)})
                    if r.status_code != 200:
                        out["lost"] += 1
                        out["errors"].append(f"{r.status_code} {r.text[:120]}")
                        break
                    if r.json()["status"] == "ready":
                        out["latencies"].append((t0, time.monotonic() - t0))
                        answered += 1
                        break
            await c.delete(base, headers=h)
        except httpx.HTTPError as e:  # the calls of this session not yet answered are lost
            out["lost"] += calls - answered
            out["errors"].append(repr(e))


async def one_openai(url: str, index: int, max_tokens: int, out: dict) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=CALL_BOUND_S) as c:
        t0 = time.monotonic()
        try:
            model = (await c.get("/v1/models")).json()["data"][0]["id"]
            r = await c.post("/v1/completions", json={"model": model, "prompt": f"Client {index} says",
                                                      "max_tokens": max_tokens, "ignore_eos": True})
            if r.status_code == 200:
                out["openai_latencies"].append(time.monotonic() - t0)
            else:
                out["openai_lost"] += 1
                out["errors"].append(f"openai {r.status_code} {r.text[:120]}")
        except httpx.HTTPError as e:
            out["openai_lost"] += 1
            out["errors"].append(f"openai {e!r}")


async def run_load(url: str, args: argparse.Namespace) -> dict:
    out: dict = {"latencies": [], "lost": 0, "hung": 0, "errors": [], "openai_latencies": [], "openai_lost": 0}
    t0 = time.monotonic()
    tasks = [asyncio.create_task(one_session(url, i, args.calls, args.max_tokens, out)) for i in range(args.sessions)]
    tasks += [asyncio.create_task(one_openai(url, i, args.max_tokens, out)) for i in range(args.openai)]
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=CALL_BOUND_S * 2)
    out["wall_s"] = time.monotonic() - t0
    return out


def summarize(out: dict, args: argparse.Namespace) -> dict:
    lat = sorted(x for _, x in out["latencies"])
    by_start = sorted(out["latencies"])
    tenth = max(1, len(by_start) // 10)
    q = (lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None)
    return {"calls": args.sessions * args.calls, "answered": len(lat), "lost": out["lost"], "hung": out["hung"],
            "openai_calls": args.openai, "openai_answered": len(out["openai_latencies"]),
            "openai_lost": out["openai_lost"], "p50_s": q(lat, 0.5), "p99_s": q(lat, 0.99),
            "max_s": lat[-1] if lat else None, "wall_s": out["wall_s"],
            "calls_per_s": (len(lat) + len(out["openai_latencies"])) / out["wall_s"],
            "first_tenth_p50_s": statistics.median(x for _, x in by_start[:tenth]) if by_start else None,
            "last_tenth_p50_s": statistics.median(x for _, x in by_start[-tenth:]) if by_start else None,
            "errors": out["errors"][:20]}


def start_server(serve_flags: list[str], log_path: str, *, tree: str | None = None) -> tuple[subprocess.Popen, str]:
    """``parrot serve`` on a free 127.0.0.1 port, returned once /ready answers 200 (RuntimeError if it exits or
    takes over 300 s). ``tree``: another checkout of the project whose code the server runs (from that directory)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_file = open(log_path, "w")
    env = dict(os.environ)
    if tree is not None:  # `python -m` puts the working directory first on the path: run from the tree
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "parrot.cli", "serve", "--port", str(port), *serve_flags],
                            stdout=log_file, stderr=log_file, env=env, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"parrot serve exited; see {log_path}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("parrot serve did not become ready")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT_SERVE
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--openai", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--soak-s", type=float, default=0.0)
    p.add_argument("--url", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(serve_flags, os.path.join(os.environ.get("TMPDIR", "/tmp"), "load_bench_serve.log"))
    pid = proc.pid if proc else None
    try:
        rss = {"before_mib": rss_mib(pid) if pid else None, "samples_mib": []}
        rounds = []
        soak_end = time.monotonic() + args.soak_s
        while True:  # one round, or rounds until the soak time is over (bounded by --soak-s)
            rounds.append(summarize(asyncio.run(run_load(url, args)), args))
            if pid:
                rss["samples_mib"].append(rss_mib(pid))
            if time.monotonic() >= soak_end:
                break
        rss["after_mib"] = rss_mib(pid) if pid else None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    first = rounds[0]
    rows = [[f"round {i + 1}", r["answered"], r["lost"], r["hung"], r["openai_answered"], r["openai_lost"],
             r["p50_s"], r["p99_s"], r["first_tenth_p50_s"], r["last_tenth_p50_s"], r["calls_per_s"]]
            for i, r in enumerate(rounds)]
    from parrot.bench.machine import describe_cpu, describe_machine

    conditions = {**describe_machine(), **describe_cpu(), "server": url if args.url else "parrot serve " +
                  " ".join(serve_flags), "sessions": args.sessions, "calls per session": args.calls,
                  "openai calls": args.openai, "max_tokens": args.max_tokens, "rss MiB (before, per round, after)":
                  f"{rss['before_mib']}, {rss['samples_mib']}, {rss['after_mib']}"}
    print(format_table(["", "answered", "lost", "hung", "openai ok", "openai lost", "p50 s", "p99 s",
                        "first 10% p50 s", "last 10% p50 s", "calls/s"], rows, title="Load"))
    print()
    print(format_conditions(conditions))
    if first["errors"]:
        print("errors (first 20):", *first["errors"], sep="\n  ")
    if args.json:
        save_json(args.json, {"args": vars(args), "serve_flags": serve_flags, "rounds": rounds, "rss": rss})


if __name__ == "__main__":
    main()
