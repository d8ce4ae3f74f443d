"""Abuse benchmark: does the manager's memory stay bounded when a key pushes every limit?

    python -m parrot.bench.abuse_bench [--rounds 3] [--state-mib 256] [--json PATH]

Starts ``parrot serve`` (a real process on 127.0.0.1, the tiny random engine) with two keys: ``attacker`` and
``probe``. Each round the attacker (1) opens sessions until refused, (2) submits requests that wait on a value
never set until ``max_pending``
answers 429, then fires OpenAI calls at that limit (each a 429), (3) stores 1 MiB values until
the server's ``--max-state-bytes`` refuses, then deletes its sessions.
Meanwhile the probe key keeps calling the OpenAI API and must be served. Reported per round: what was refused
and how (status / code), the probe's answers, and the server's RSS before, at the peak and after. Bounded: a
fixed number of rounds, every loop stops at the first refusal or at a cap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time

import httpx

from parrot.bench.load_bench import rss_mib, start_server
from parrot.common.report import format_conditions, format_table, save_json

ATTACKER, PROBE = "sk-attacker-0123456789", "sk-probe-0123456789"
VALUE = "v" * (1 << 20)  # 1 MiB per stored value
MAX_SESSIONS = 64
MAX_PENDING = 200


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def _probe(c: httpx.AsyncClient, model: str, stop: asyncio.Event, out: dict) -> None:
    while not stop.is_set():
        r = await c.post("/v1/completions", headers=_auth(PROBE),
                         json={"model": model, "prompt": f"probe {time.monotonic()}", "max_tokens": 2})
        out["probe_ok" if r.status_code == 200 else "probe_failed"] += 1
        await asyncio.sleep(0.05)


async def one_round(url: str, pid: int, out: dict) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        model = (await c.get("/v1/models", headers=_auth(PROBE))).json()["data"][0]["id"]
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe(c, model, stop, out))
        peak = rss_mib(pid) or 0.0
        sessions: list[tuple[str, dict]] = []
        for _ in range(10_000):  # (1) sessions until refused
            r = await c.post("/api/v1/sessions", headers=_auth(ATTACKER), json={})
            if r.status_code != 200:
                out["refusals"].append(("session", r.status_code, r.json()["error"]["param"]))
                break
            s = r.json()
            sessions.append((f"/api/v1/sessions/{s['session_id']}",
                             {**_auth(ATTACKER), "X-Parrot-Session-Token": s["token"]}))
        base, h = sessions[0]
        free = (await c.post(f"{base}/variables", headers=h, json={})).json()
        waiting = {"prompt": "{{input:a}} {{output:b}}", "placeholders": [
            {"name": "a", "is_output": False, "var_id": free.get("var_id")}, {"name": "b", "is_output": True}]}

        async def flood_openai() -> list[int]:
            calls = [c.post("/v1/completions", headers=_auth(ATTACKER),
                            json={"model": model, "prompt": "flood", "max_tokens": 4}) for _ in range(50)]
            return [r.status_code for r in await asyncio.gather(*calls)]

        for _ in range(10_000):  # (2) waiting requests until max_pending
            r = await c.post(f"{base}/submit", headers=h, json=waiting)
            if r.status_code != 200:
                out["refusals"].append(("submit", r.status_code, r.json()["error"]["code"]))
                break
        codes = await flood_openai()  # at the pending limit: each one a 429
        out["openai_429"].append(sum(1 for x in codes if x == 429))
        stored = 0
        for i in range(100_000):  # (3) 1 MiB values until the state budget refuses
            base, h = sessions[i % len(sessions)]
            r = await c.post(f"{base}/variables", headers=h, json={"value": VALUE})
            if r.status_code != 200:
                out["refusals"].append(("value", r.status_code, r.json()["error"]["param"]))
                break
            stored += 1
            if stored % 16 == 0:
                peak = max(peak, rss_mib(pid) or 0.0)
        out["stored_mib"].append(stored)
        peak = max(peak, rss_mib(pid) or 0.0)
        for base, h in sessions:  # (4) give everything back
            await c.delete(base, headers=h)
        stop.set()
        await probe
        out["peak_mib"].append(peak)
        await asyncio.sleep(1.0)
        out["after_mib"].append(rss_mib(pid))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--state-mib", type=int, default=256, help="the server's --max-state-bytes, in MiB")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    keys = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"keys": [{"name": "attacker", "key": ATTACKER, "max_sessions": MAX_SESSIONS,
                         "max_pending": MAX_PENDING},
                        {"name": "probe", "key": PROBE}]}, keys)
    keys.close()
    serve = ["--random-model", "tiny", "--dtype", "float32", "--weight-quant", "none", "--api-keys-file", keys.name,
             "--max-state-bytes", str(args.state_mib << 20), "--max-session-bytes", str(64 << 20),
             "--max-body-bytes", str(2 << 20)]
    proc, url = start_server(serve, os.path.join(tempfile.gettempdir(), "abuse_bench_serve.log"))
    out: dict = {"refusals": [], "stored_mib": [], "openai_429": [], "peak_mib": [], "after_mib": [],
                 "probe_ok": 0, "probe_failed": 0}
    try:
        out["before_mib"] = rss_mib(proc.pid)
        for _ in range(args.rounds):
            asyncio.run(one_round(url, proc.pid, out))
        alive = httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)
        os.unlink(keys.name)
    rows = [[f"round {i + 1}", out["stored_mib"][i], out["openai_429"][i], f"{out['peak_mib'][i]:.0f}",
             f"{out['after_mib'][i]:.0f}"] for i in range(args.rounds)]
    from parrot.bench.machine import describe_cpu, describe_machine

    refused = sorted({f"{what}: {status} {code}" for what, status, code in out["refusals"]})
    conditions = {**describe_machine(), **describe_cpu(), "server": "parrot serve " + " ".join(serve),
                  "attacker limits": f"max_sessions {MAX_SESSIONS}, max_pending {MAX_PENDING}",
                  "refused as": "; ".join(refused), "probe calls ok / failed": f"{out['probe_ok']} / "
                  f"{out['probe_failed']}", "server alive after": alive, "rss before MiB": out["before_mib"]}
    print(format_table(["", "values stored (MiB)", "openai 429s", "peak RSS MiB", "RSS after MiB"], rows,
                       title=f"Abuse (state budget {args.state_mib} MiB)"))
    print()
    print(format_conditions(conditions))
    if args.json:
        save_json(args.json, {"args": vars(args), "out": out, "conditions": conditions})


if __name__ == "__main__":
    main()
