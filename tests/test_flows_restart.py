"""A flow's loop survives a manager SIGKILL: a real `parrot serve --state-dir D` (the tiny random engine) runs a
counting loop whose tool is a client tool; after iteration 0 is answered and iteration 1's call is listed, the
server is killed and started again on the same state dir and port. The restarted manager replays the flow from the
journal: iteration 0's generate is not run again, iteration 1's call is listed again, and the loop ends."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
from engine_procs import TINY_ENGINE, wait_until
from test_flows import counter_loop
from test_manager_restart import ROOT, _ready

from parrot.engine.server.procs import free_port


def _serve(port: int, state, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "parrot.cli", "serve", "--port", str(port), "--state-dir",
                             str(state), *TINY_ENGINE], cwd=ROOT, stdout=log, stderr=log)


def test_a_loop_continues_at_its_iteration_after_a_manager_kill(tmp_path):
    port = free_port()
    url, state = f"http://127.0.0.1:{port}", tmp_path / "state"
    logs = [open(tmp_path / f"serve-{i}.log", "w") for i in (1, 2)]
    procs = [_serve(port, state, logs[0])]
    try:
        wait_until(lambda: _ready(url), 60, "parrot serve to be ready")
        c = httpx.Client(base_url=url, timeout=30)
        sess = c.post("/api/v1/sessions", json={"ttl_s": 600}).json()
        base, h = f"/api/v1/sessions/{sess['session_id']}", {"X-Parrot-Session-Token": sess["token"]}
        start = c.post(f"{base}/variables", json={"value": "0"}, headers=h).json()["var_id"]
        flow = c.post(f"{base}/flows", json=counter_loop(start, tool_runs="client"), headers=h).json()

        def take() -> dict:
            calls = c.get(f"{base}/tool_calls", params={"timeout": 20}, headers=h).json()["calls"]
            assert len(calls) == 1, calls
            return calls[0]

        first = take()
        c.put(f"{base}/variables/{first['call_id']}", json={"value": "1"}, headers=h)
        second = take()
        assert second["args"] == {"expression": "1 + 1"}

        def iteration_0_done() -> bool:
            reqs = c.get(f"{base}/dag", headers=h).json()["requests"]
            return any(r["origin"] == "f_1/0.loop[0]/2.generate" and r["status"] == "finished" for r in reqs)

        wait_until(iteration_0_done, 60, "iteration 0's generate to finish")
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        procs.append(_serve(port, state, logs[1]))
        wait_until(lambda: _ready(url), 60, "the restarted parrot serve to be ready")

        again = take()  # the journaled flow was replayed: iteration 1's call is open again
        assert again["args"] == {"expression": "1 + 1"} and again["call_id"] == second["call_id"]
        c.put(f"{base}/variables/{again['call_id']}", json={"value": "2"}, headers=h)
        c.put(f"{base}/variables/{take()['call_id']}", json={"value": "3"}, headers=h)
        n2 = c.get(f"{base}/variables/{flow['outputs']['n2']}", params={"timeout": 60}, headers=h).json()
        assert n2["status"] == "ready" and n2["value"] == "3"
        said = c.get(f"{base}/variables/{flow['outputs']['said']}", params={"timeout": 60}, headers=h).json()
        assert said["status"] == "ready"
        reqs = c.get(f"{base}/dag", headers=h).json()["requests"]
        assert sorted(r["origin"] for r in reqs) == [f"f_1/0.loop[{i}]/2.generate" for i in range(3)]
        assert all(r["status"] == "finished" for r in reqs)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        for f in logs:
            f.close()
