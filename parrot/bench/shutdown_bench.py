"""Shutdown benchmark: how long `parrot serve` takes to exit on SIGTERM under a backlog whose clients are gone.

    python -m parrot.bench.shutdown_bench [--backlog 300 1760] [--grace 10] [--json PATH] [-- serve flags]

Per backlog size: start ``parrot serve`` (a real process on 127.0.0.1; the tiny random engine in-process unless
serve flags are given), open that many raw connections that each send one ``/v1/completions`` (``max_tokens``
400, ``ignore_eos``), wait until they are queued, close every connection (the clients are gone), send SIGTERM and
time the exit. Reported: seconds to exit, the exit status (-15: the drain's own exit; -14: the SIGALRM backstop
at grace + 5 s), and what the drain logged (requests cancelled because their clients were gone). The issue this
answers: with ~1,760 such queued ops the server took 20-60 s to exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import signal
import socket
import sys
import tempfile
import time

import httpx

from parrot.bench.load_bench import start_server
from parrot.bench.machine import describe_machine
from parrot.common.report import format_conditions, format_table, save_json

TINY_SERVE = ["--random-model", "tiny", "--dtype", "float32", "--weight-quant", "none", "--num-threads", "1",
              "--kv-cache-tokens", "16384"]
log = logging.getLogger(__name__)


def send_abandoned_backlog(url: str, n: int, *, settle_s: float = 3.0) -> str:
    """Open ``n`` raw connections to ``url`` that each send one ``/v1/completions`` (400 tokens, ``ignore_eos``),
    wait ``settle_s`` for the server to read and queue them, then close them all: ``n`` requests whose clients are
    gone. Returns the model name."""
    port = int(url.rsplit(":", 1)[1])
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    clients: list[socket.socket] = []
    try:
        for i in range(n):
            body = json.dumps({"model": model, "prompt": f"request {i} of {n}", "max_tokens": 400,
                               "ignore_eos": True}).encode()
            c = socket.create_connection(("127.0.0.1", port), timeout=30)
            clients.append(c)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(settle_s)
    finally:
        for c in clients:
            c.close()
    return model


def one(backlog: int, grace_s: float, serve_flags: list[str], log_path: str) -> dict:
    proc, url = start_server(["--shutdown-grace-s", str(grace_s), *serve_flags], log_path)
    try:
        send_abandoned_backlog(url, backlog)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(grace_s + 60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    with open(log_path) as f:
        text = f.read()
    drained = re.search(r"drained \((\d+) request\(s\) still in flight, (\d+) cancelled", text)
    return {"backlog": backlog, "grace_s": grace_s, "exit_s": round(took, 2), "exit_status": proc.returncode,
            "cancelled_client_gone": int(drained.group(2)) if drained else None,
            "still_in_flight_at_stop": int(drained.group(1)) if drained else None}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else TINY_SERVE
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backlog", type=int, nargs="+", default=[300, 1760])
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one socket per queued client
    need = max(ns.backlog) + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    conditions = {**describe_machine(), "serve_flags": " ".join(serve_flags), "grace_s": ns.grace,
                  "load_average": os.getloadavg()[0]}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in ns.backlog:
            r = one(n, ns.grace, serve_flags, os.path.join(tmp, f"serve-{n}.log"))
            log.info("backlog %d: exit %.2f s after SIGTERM (status %s)", n, r["exit_s"], r["exit_status"])
            rows.append(r)
    print(format_conditions(conditions))
    print(format_table(["backlog", "grace s", "exit s", "status", "cancelled (client gone)"],
                       [[r["backlog"], r["grace_s"], r["exit_s"], str(r["exit_status"]),
                         str(r["cancelled_client_gone"])] for r in rows], title="SIGTERM under an abandoned backlog"))
    if ns.json:
        save_json(ns.json, {"conditions": conditions, "rows": rows})


if __name__ == "__main__":
    main()
