"""Graceful shutdown (issue 19, item 5): `parrot serve` (a real process) on SIGTERM drains (new work 503
``server_draining``, /ready 503, /health 200), lets requests in flight run for at most ``--shutdown-grace-s``, then
cancels the rest and exits — a client holding a 60 s long poll, a backlog of submitted work, and hundreds of
completions whose clients went away do not keep it alive; `parrot engine` drains and exits in bounded time too."""

from __future__ import annotations

import logging
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


def test_engine_sigterm_drains_and_exits_in_bounded_time(tmp_path, default_model_path):
    """`parrot engine` on SIGTERM: new fills get 503 server_draining, a generation in flight finishes, and it
    exits within its grace even when that generation would run longer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "engine.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "parrot.cli", "engine", "--name", "d0", "--port", str(port),
                             "--shutdown-grace-s", "2", *TINY_ENGINE], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ok(f"{url}/health"), 120, "the engine")
        with httpx.Client(base_url=url, timeout=60) as c:
            c.post("/engine/v1/fill", json={"token_ids": [5, 6, 7], "context_id": "long"}).raise_for_status()
            done: list[int] = []
            t = threading.Thread(target=lambda: done.append(c.post("/engine/v1/generate", json={
                "context_id": "long", "sampling": {"max_tokens": 4000, "ignore_eos": True}}).status_code))
            t.start()
            time.sleep(0.5)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with httpx.Client(base_url=url, timeout=10) as c2:
                r = c2.post("/engine/v1/fill", json={"token_ids": [1], "context_id": "new"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining", r.text
            assert r.headers["retry-after"]
            proc.wait(15)
            took = time.monotonic() - t0
            t.join(15)
        assert took < 2 + 3, took  # the grace, then the generation is cut
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


def test_sigterm_drains_refuses_new_work_and_cancels_a_backlog_whose_clients_are_gone(tmp_path):
    """Hundreds of completions queued by clients that then went away, plus two whose clients wait: on SIGTERM the
    server answers new work with 503 ``server_draining`` (Retry-After), /ready with 503 and /health with 200 while
    it drains, cancels the abandoned backlog at once, lets the short waiting completion finish (200), cuts the long
    one at the grace, and exits within grace + 5 s by its own drain (not the SIGALRM backstop)."""
    from parrot.bench.load_bench import start_server
    from parrot.bench.shutdown_bench import send_abandoned_backlog

    grace, backlog = 4.0, 300
    proc, url = start_server(["--shutdown-grace-s", str(grace), *TINY_ENGINE], str(tmp_path / "serve.log"))
    answers: dict[str, object] = {}

    def wait_for(tag: str, max_tokens: int) -> None:
        try:
            answers[tag] = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": model, "prompt": tag, "max_tokens": max_tokens, "ignore_eos": True}).status_code
        except httpx.HTTPError as e:
            answers[tag] = type(e).__name__

    try:
        model = send_abandoned_backlog(url, backlog, settle_s=1.0)
        waiting = [threading.Thread(target=wait_for, args=(tag, n)) for tag, n in (("short", 4), ("long", 4000))]
        for t in waiting:
            t.start()
        time.sleep(0.5)  # both in flight
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # while it drains (the long completion keeps it draining): new work refused with a typed 503, probes answer
        draining = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "late", "max_tokens": 1},
                              timeout=10)
        ready, health = httpx.get(f"{url}/ready", timeout=10), httpx.get(f"{url}/health", timeout=10)
        proc.wait(timeout=grace + 20)
        took = time.monotonic() - t0
        for t in waiting:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert draining.status_code == 503, draining.text
    assert draining.json()["error"]["code"] == "server_draining" and int(draining.headers["retry-after"]) >= 1
    assert ready.status_code == 503 and ready.json()["draining"] is True and health.status_code == 200
    assert answers["short"] == 200 and answers["long"] != 200, answers  # in flight: finished / cut at the grace
    assert grace - 0.5 < took < grace + 5, f"exit took {took:.1f} s with a backlog of {backlog}"
    assert proc.returncode == -signal.SIGTERM  # the drain's own exit, not the SIGALRM backstop at grace + 5 s
    logging.getLogger(__name__).info("exit after SIGTERM with %d abandoned completions: %.2f s", backlog, took)
