"""`parrot engine` child processes: start N engines on free 127.0.0.1 ports that register with a manager.

Used by ``parrot serve --engines N``, the cluster benchmark and the failover tests. Children die with their
parent: on Linux each child asks the kernel for SIGTERM when the parent thread that spawned it exits
(``PR_SET_PDEATHSIG``), and :meth:`EngineProcess.stop` terminates (then kills) them on a clean shutdown.
No torch here: the children import it, the parent does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO

import httpx

from parrot.common.errors import EngineUnavailable

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, what: str, path: str = "/health") -> None:
    """Poll ``url + path`` until it answers 200; EngineUnavailable if ``proc`` exits or ``timeout_s`` passes
    first (a server process we started: an engine, a manager, llama.cpp's server)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineUnavailable(f"{what} exited during startup (code {proc.returncode})")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise EngineUnavailable(f"{what} at {url} not healthy after {timeout_s} s")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


MANAGER_SECRET_ENV = "PARROT_ENGINE_SERVER_MANAGER_SECRET"  # EngineServerSettings.manager_secret


class EngineProcess:
    """One `parrot engine --manager-url URL` process. ``secret``: the manager's engine secret, handed over in the
    child's environment (never on its command line, which other users of the machine can read)."""

    def __init__(self, name: str, manager_url: str, *, secret: str | None = None, port: int | None = None,
                 engine_args: Sequence[str] = (), heartbeat_s: float | None = None, output: IO | int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "parrot.cli", "engine", "--name", name, "--host", "127.0.0.1",
               "--port", str(self.port), "--manager-url", manager_url, *engine_args]
        if heartbeat_s is not None:
            cmd += ["--heartbeat-s", str(heartbeat_s)]
        self.cmd = cmd
        child_env = {**os.environ, **(env or {})}
        if secret is not None:
            child_env[MANAGER_SECRET_ENV] = secret
        self._proc = subprocess.Popen(cmd, stdout=output, stderr=output, preexec_fn=_die_with_parent, env=child_env)
        log.info("started engine %s (pid %d) on %s", name, self._proc.pid, self.url)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, no cleanup (what a crash looks like to the manager)."""
        if self.alive:
            self._proc.kill()
        self._proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        if not self.alive:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine %s did not stop within %.0f s; killing it", self.name, timeout_s)
            self.kill()


def start_engines(n: int, manager_url: str, *, secret: str | None = None, engine_args: Sequence[str] = (),
                  prefix: str = "engine", heartbeat_s: float | None = None,
                  output: IO | int | None = None) -> list[EngineProcess]:
    """``n`` engine processes named ``{prefix}-0`` ... registering with ``manager_url`` (engine secret ``secret``)."""
    procs: list[EngineProcess] = []
    try:
        for i in range(n):
            procs.append(EngineProcess(f"{prefix}-{i}", manager_url, secret=secret, engine_args=engine_args,
                                       heartbeat_s=heartbeat_s, output=output))
    except BaseException:
        stop_all(procs)
        raise
    return procs


def stop_all(procs: Sequence[EngineProcess]) -> None:
    for p in procs:
        try:
            p.stop()
        except Exception:  # noqa: BLE001 -- stopping the others matters more; logged
            log.exception("stopping engine %s failed", p.name)
