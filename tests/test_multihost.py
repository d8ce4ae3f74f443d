"""Several hosts (issue 18 item 3) on this machine: a manager and builtin engines in separate network namespaces,
joined by veth pairs on a bridge over a private 10.x subnet, each a real process started with `ip netns exec`:

    root ns (this test, 10.213.N.254 on the bridge) --- bridge --- ns pm-*: parrot serve --no-local-engine
                                                          |        --host 10.213.N.1 --engine-networks 10.213.N.0/24
                                                          +------- ns pe1-*: parrot engine --host 0.0.0.0
                                                          |        --advertise-url http://10.213.N.2:9001
                                                          +------- ns pe2-*: the same on 10.213.N.3

A real app runs end to end on both engines; an engine with a wrong secret is refused (it never registers), and a
URL outside the manager's engine networks is a 400. Everything is torn down in ``finally`` (processes killed,
namespaces and the bridge deleted) even when a step fails. Needs root and `ip netns`; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from engine_procs import SECRET, TINY_ENGINE, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _netns_usable() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"parrot-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_WHY_NOT = _netns_usable()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"multi-host test: {_WHY_NOT}")


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}: {r.stderr.strip()}"


class Hosts:
    """Namespaces ``names`` on 10.213.<net>.0/24 (the i-th at .i+1), a bridge at .254 in the root namespace."""

    def __init__(self, names: list[str]) -> None:
        tag = os.getpid() % 100_000
        self.net = f"10.213.{tag % 250}"
        self.bridge = f"pbr{tag}"
        self.names = [f"{n}-{tag}" for n in names]
        self.made: list[str] = []
        self.bridge_made = False

    def ip_of(self, i: int) -> str:
        return f"{self.net}.{i + 1}"

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.bridge_made = True
        _ip("addr", "add", f"{self.net}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self.made.append(ns)
            host_end, ns_end = f"vh{i}{self.bridge[3:]}", f"vn{i}{self.bridge[3:]}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", ns_end, "netns", ns)
            _ip("link", "set", host_end, "master", self.bridge)
            _ip("link", "set", host_end, "up")
            _ip("addr", "add", f"{self.ip_of(i)}/24", "dev", ns_end, ns=ns)
            _ip("link", "set", ns_end, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)

    def down(self) -> None:
        for ns in self.made:  # deleting a namespace deletes its veth end, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.bridge_made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def start(self, i: int, args: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
        cmd = ["ip", "netns", "exec", self.names[i], sys.executable, "-m", "parrot.cli", *args]
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, env={**os.environ, **(env or {})})


def _engines(url: str) -> dict[str, bool]:
    try:
        return {e["name"]: e["healthy"] for e in httpx.get(f"{url}/api/v1/engines", timeout=3).json()["engines"]}
    except httpx.HTTPError:
        return {}


def test_manager_and_engines_on_separate_hosts(tmp_path, default_model_path):
    from parrot.frontend.client import connect
    from parrot.frontend.function import Output, SemanticFunction

    hosts = Hosts(["pm", "pe1", "pe2"])
    procs: list[subprocess.Popen] = []
    log = open(tmp_path / "hosts.log", "w")
    session = None
    try:
        hosts.up()
        manager_ip = hosts.ip_of(0)
        url = f"http://{manager_ip}:8000"
        procs.append(hosts.start(0, ["serve", "--no-local-engine", "--host", manager_ip, "--port", "8000",
                                     "--engine-networks", f"{hosts.net}.0/24", "--policy", "round-robin",
                                     "--engine-heartbeat-s", "0.5", "--shutdown-grace-s", "2"], log,
                                 env={"PARROT_ENGINE_SECRET": SECRET}))

        def engine(i: int, name: str, secret: str) -> subprocess.Popen:
            ip = hosts.ip_of(i)
            return hosts.start(i, ["engine", "--name", name, "--host", "0.0.0.0", "--port", "9001",
                                   "--advertise-url", f"http://{ip}:9001", "--manager-url", url,
                                   "--heartbeat-s", "0.3", "--manager-max-backoff-s", "1", *TINY_ENGINE], log,
                               env={"PARROT_ENGINE_SERVER_MANAGER_SECRET": secret})

        procs.append(engine(1, "e1", SECRET))
        intruder = engine(2, "e2", "a-wrong-secret-0123456789")
        procs.append(intruder)
        wait_until(lambda: _engines(url).get("e1"), 180, "e1 to register across hosts")
        # the wrong secret: e2's process runs and keeps trying, and the manager never lists it
        wait_until(lambda: _reachable(f"http://{hosts.ip_of(2)}:9001/health"), 120, "the intruder to run")
        time.sleep(1.0)  # several of its registration attempts
        assert "e2" not in _engines(url)
        wrong = httpx.post(f"{url}/api/v1/engines/register", json={"name": "e9", "url": f"http://{hosts.ip_of(2)}:9001",
                           "instance": "x" * 16}, headers={"X-Parrot-Engine-Secret": "nope-nope-nope-nope"}, timeout=5)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_engine_secret"
        outside = httpx.post(f"{url}/api/v1/engines/register", json={"name": "e9", "url": "http://192.0.2.7:9001",
                             "instance": "x" * 16}, headers={"X-Parrot-Engine-Secret": SECRET}, timeout=5)
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "url"
        intruder.kill()
        intruder.wait(10)
        procs.append(engine(2, "e2", SECRET))
        wait_until(lambda: _engines(url) == {"e1": True, "e2": True}, 180, "both engines across hosts")
        urls = {e["name"]: e for e in httpx.get(f"{url}/api/v1/engines", timeout=5).json()["engines"]}
        assert set(urls) == {"e1", "e2"}

        # a real app end to end: four map steps and a reduce, spread over both engines by round-robin
        session = connect(url, make_default=False)
        out = Output(max_tokens=24, ignore_eos=True, temperature=0.0, stop=[])
        summarize = SemanticFunction("Summarize part {{input:n}}: {{output:s}}", name="map", defaults=out)
        combine = SemanticFunction("Combine {{input:a}} | {{input:b}} | {{input:c}} | {{input:d}} => {{output:s}}",
                                   name="reduce", defaults=out)
        maps = [summarize(str(i), session=session) for i in range(4)]
        final = combine(*maps, session=session)
        values = [m.get(timeout=120) for m in maps] + [final.get(timeout=120)]
        assert all(isinstance(v, str) and v for v in values)
        dag = session.dag()
        assert {r["engine"] for r in dag["requests"]} == {"e1", "e2"}
        assert httpx.get(f"{url}/ready", timeout=5).json()["ready"] is True
    finally:
        if session is not None:
            try:
                session.close()
            except Exception:  # noqa: BLE001 -- teardown goes on
                pass
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        hosts.down()
        log.close()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in left for ns in hosts.names)


def _reachable(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
