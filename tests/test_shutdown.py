"""Graceful shutdown (issue 19, item 5): `parrot serve` (a real process) on SIGTERM stops accepting, lets requests in
flight run for at most ``--shutdown-grace-s``, then cancels the rest and exits — a client holding a 60 s long poll
and a backlog of submitted work do not keep it alive."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from engine_procs import TINY_ENGINE, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sigterm_exits_within_the_grace_period_despite_long_polls_and_a_backlog(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    flags = [f for f in TINY_ENGINE if f not in ("--kv-cache-tokens", "16384")] + ["--kv-cache-tokens", "2048"]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "parrot.cli", "serve", "--port", str(port), "--shutdown-grace-s",
                             "2", *flags], cwd=ROOT, stdout=log, stderr=log)
    try:
        wait_until(lambda: _ok(f"{url}/ready"), 120, "parrot serve to be ready")
        sid = httpx.post(f"{url}/api/v1/sessions", json={}).json()
        h = {"X-Parrot-Session-Token": sid["token"]}
        base = f"{url}/api/v1/sessions/{sid['session_id']}"
        never = httpx.post(f"{base}/variables", json={"name": "never"}, headers=h).json()["var_id"]
        # a backlog: many long generations queued on the one engine
        for i in range(60):
            r = httpx.post(f"{base}/submit", headers=h, json={"prompt": f"{i} {{{{output:o}}}}", "placeholders": [
                {"name": "o", "is_output": True, "sampling": {"max_tokens": 400, "ignore_eos": True}}]})
            assert r.status_code == 200, r.text
        answers: list[object] = []

        def long_poll() -> None:
            try:
                answers.append(httpx.get(f"{base}/variables/{never}", params={"timeout": 60}, headers=h,
                                         timeout=90).status_code)
            except httpx.HTTPError as e:
                answers.append(type(e).__name__)

        poller = threading.Thread(target=long_poll)
        poller.start()
        time.sleep(0.5)  # the poll is in flight
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - t0
        poller.join(30)
        assert took < 2 + 8, f"exit took {took:.1f} s"  # the grace, plus closing sessions and the engine
        assert answers and answers[0] != 200  # the long poll was cut, not answered with a value
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
