"""Screenshots of the live web view (/ui) during the map-reduce example, for docs/ui/*.png.

Starts ``parrot serve --engines 2 --policy parrot --prefix-min-tokens 8`` (a manager and two engine processes on
the default model; the maps' shared instruction is short, so prefix sharing needs the lower minimum) with an API key, runs the map-reduce app of examples/map_reduce_summary.py against it (its ``summarize`` and
``make_reduce``, on the example's document) and, with Debian's headless Chromium driven by playwright, saves:

* ``docs/ui/map_reduce_running.png``: while the maps run (some requests running, the reduce waiting);
* ``docs/ui/map_reduce_done.png``: once the final summary is ready (every node finished, engines and recent
  requests with their timings).

    .venv/bin/python scripts/ui_screenshots.py [--out docs/ui] [--chunks 6] [--max-tokens 40]

Needs /usr/bin/chromium (bash scripts/install-chromium.sh) and the test extra (playwright). Bounded: every wait
has a timeout and the server is stopped at the end, however the script ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from _common import document_chunks  # noqa: E402
from map_reduce_summary import make_reduce, summarize  # noqa: E402

import parrot as P  # noqa: E402

log = logging.getLogger("ui_screenshots")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "sk-ui-screenshots-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, engines: int) -> subprocess.Popen:
    env = dict(os.environ, PARROT_ENGINE_KV_CACHE_TOKENS="16384", PARROT_LOG_LEVEL="WARNING", PARROT_API_KEY=KEY)
    cmd = [sys.executable, "-m", "parrot.cli", "serve", "--port", str(port), "--policy", "parrot",
           "--engine-heartbeat-s", "0.5", "--prefix-min-tokens", "8"]  # the maps' shared instruction is ~10 tokens
    if engines > 1:
        cmd += ["--engines", str(engines)]
    return subprocess.Popen(cmd, env=env, cwd=ROOT)


def wait_ready(url: str, proc: subprocess.Popen, engines: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("parrot serve exited during startup")
        try:
            r = httpx.get(f"{url}/ready", timeout=2)
            if r.status_code == 200 and len(r.json()["engines"]) >= engines:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("parrot serve did not become ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "ui"))
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--engines", type=int, default=2)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, args.engines)
    try:
        wait_ready(url, proc, args.engines)
        log.info("server ready at %s", url)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.goto(f"{url}/ui")
            page.fill("#key", KEY)
            page.click("#keyform button[type=submit]")
            page.locator('#conn[data-state="live"]').wait_for(timeout=30_000)

            done = threading.Event()
            result: dict = {}
            session = P.connect(url, api_key=KEY)

            def run_app() -> None:
                try:
                    chunks = document_chunks(args.chunks, args.chunk_words)
                    mapper = summarize.options(max_tokens=args.max_tokens)
                    partial = [mapper(chunk, session=session) for chunk in chunks]
                    final = make_reduce(len(chunks), args.max_tokens)(*partial, session=session)
                    result["final"] = final.get(perf=P.LATENCY)
                except Exception as e:  # reported by the main thread
                    result["error"] = e
                finally:
                    done.set()

            worker = threading.Thread(target=run_app, daemon=True)
            worker.start()
            page.locator('g[data-node="request"][data-state="running"]').first.wait_for(timeout=120_000)
            # the reduce submitted and labeled (its final summary is fetched with the LATENCY objective)
            reduce = page.locator(f'g[data-node="request"][data-id="r_{args.chunks + 1}"]')
            reduce.and_(page.locator('[data-objective="latency"]')).wait_for(timeout=60_000)
            time.sleep(1.0)  # a heartbeat: the engine panels show the load
            page.screenshot(path=str(out / "map_reduce_running.png"), full_page=True)
            log.info("saved %s", out / "map_reduce_running.png")
            if not done.wait(600):
                raise SystemExit("the map-reduce app did not finish in 600 s")
            if "error" in result:
                raise SystemExit(f"the map-reduce app failed: {result['error']!r}")
            reduce.and_(page.locator('[data-state="finished"]')).wait_for(timeout=30_000)
            time.sleep(1.5)  # a heartbeat or two: engine panels settle
            page.screenshot(path=str(out / "map_reduce_done.png"), full_page=True)
            log.info("saved %s; final summary: %s", out / "map_reduce_done.png", result["final"].strip()[:120])
            session.close()
            browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
