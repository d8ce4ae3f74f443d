"""Abandoned-work benchmark: how fast the next request runs right after clients gave up on long generations.

    python -m parrot.bench.abandon_bench [--abandoned 4] [--tokens 2000] [--probes 3] [--before-tree DIR]
                                         [--json PATH] [-- serve flags]

Per tree (this checkout, and ``--before-tree``: another checkout of the project, e.g. a ``git worktree`` of the
commit before a change, run from its own directory): start ``parrot serve`` (a real process on 127.0.0.1; the
default model unless serve flags are given), time ``--probes`` completions of 128 tokens on the quiet server, then
open ``--abandoned`` raw connections that each ask a non-streaming ``/v1/completions`` of ``--tokens`` tokens
(``ignore_eos``), wait until the engine runs them, close the connections (the clients are gone) and time the same
probes at once. Reported per tree: the probes' tok/s quiet and after the abandonment, their ratio, and the ops
the engine still ran when the first probe started. Prompts differ per probe and per phase (no prefix-cache hits).
A server that keeps generating for gone clients shares its batch with them: the ratio drops below 1.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import httpx

from parrot.bench.load_bench import start_server
from parrot.bench.machine import describe_machine
from parrot.common.report import format_conditions, format_table, save_json

PROBE_TOKENS = 128


def running_ops(url: str) -> int:
    """The engine's running + waiting ops (the server's /metrics: the engine's last status)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(("parrot_engine_running_requests{", "parrot_engine_waiting_requests{")):
            total += float(line.split()[-1])
    return int(total)


def probe(url: str, model: str, tag: str, n: int) -> float:
    """tok/s of ``n`` sequential completions of PROBE_TOKENS tokens (whole wall time, each prompt distinct)."""
    start, tokens = time.perf_counter(), 0
    for i in range(n):
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": f"Probe {tag} {i}: write about the sea.", "max_tokens": PROBE_TOKENS,
            "ignore_eos": True, "temperature": 0})
        r.raise_for_status()
        tokens += r.json()["usage"]["completion_tokens"]
    return tokens / (time.perf_counter() - start)


def abandon(url: str, model: str, n: int, tokens: int, tag: str) -> None:
    """``n`` clients send a long non-streaming completion, wait until the engine runs them, and leave."""
    port = int(url.rsplit(":", 1)[1])
    socks = []
    try:
        for i in range(n):
            body = json.dumps({"model": model, "prompt": f"Abandoned {tag} {i}: tell a long story.",
                               "max_tokens": tokens, "ignore_eos": True}).encode()
            c = socket.create_connection(("127.0.0.1", port), timeout=30)
            socks.append(c)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 60
        while running_ops(url) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # decoding
    finally:
        for c in socks:
            c.close()


def one(tree: str | None, args: argparse.Namespace, serve_flags: list[str]) -> dict:
    log_path = os.path.join(tempfile.gettempdir(), f"abandon-bench-{os.getpid()}.log")
    proc, url = start_server(serve_flags, log_path, tree=tree)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        probe(url, model, "warm-up", 1)
        quiet = probe(url, model, "quiet", args.probes)
        abandon(url, model, args.abandoned, args.tokens, "a")
        time.sleep(0.2)
        still = running_ops(url)
        after = probe(url, model, "after", args.probes)
        return {"tree": tree or "this checkout", "quiet_tok_s": quiet, "after_tok_s": after,
                "ratio": after / quiet, "ops_left_at_probe": still}
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else ["--kv-cache-tokens", "32768",
                                                                     "--engine-heartbeat-s", "0.2"]
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--abandoned", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--probes", type=int, default=3)
    p.add_argument("--before-tree", default=None, help="another checkout to measure in the same run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [one(None, args, serve_flags)]
    if args.before_tree:
        rows.append(one(os.path.abspath(args.before_tree), args, serve_flags))
    conditions = {**describe_machine(), "abandoned": args.abandoned, "abandoned_tokens": args.tokens,
                  "probes": f"{args.probes} x {PROBE_TOKENS} tokens", "serve_flags": " ".join(serve_flags)}
    print(format_conditions(conditions))
    print(format_table(["tree", "quiet tok/s", "after tok/s", "after / quiet", "ops left at probe"],
                       [[r["tree"], r["quiet_tok_s"], r["after_tok_s"], r["ratio"], r["ops_left_at_probe"]]
                        for r in rows], title="the next request after clients gave up on long generations"))
    if args.json:
        save_json(args.json, {"conditions": conditions, "rows": rows})


if __name__ == "__main__":
    main()
