"""Running llama.cpp's own server locally (the binary scripts/install-llama-server.sh builds), and waiting for
servers to come up: shared by the external-engine benchmark and tests. Not used by `parrot serve`, which only
talks to servers started by someone else."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from parrot.engine.server.procs import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BINARY = ROOT / ".venv" / "llama.cpp" / "bin" / "llama-server"


def binary_path() -> Path:
    """Where the binary is expected: ``$PARROT_LLAMA_SERVER``, else .venv/llama.cpp/bin/llama-server."""
    return Path(os.environ.get("PARROT_LLAMA_SERVER") or DEFAULT_BINARY)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def running(cmd: list[str], url: str, what: str, *, env: dict | None = None, timeout_s: float = 240,
            quiet: bool = True) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` (a server answering ``url/health``), wait until healthy, stop it when the block ends."""
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)
    try:
        wait_healthy(url, proc, timeout_s, what)
        yield proc
    finally:
        stop_process(proc)


@contextlib.contextmanager
def llama_server(model: str, *, binary: Path | None = None, ctx: int = 8192, slots: int = 4, threads: int = 1,
                 timeout_s: float = 120) -> Iterator[tuple[str, subprocess.Popen]]:
    """llama-server on ``model`` (a GGUF) on a free 127.0.0.1 port, ``slots`` slots sharing one unified
    ``ctx``-token KV cache; yields (url, process)."""
    binary = binary or binary_path()
    if not binary.exists():
        raise FileNotFoundError(f"{binary} missing: run `bash scripts/install-llama-server.sh`")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx), "-np", str(slots),
           "--kv-unified", "-t", str(threads), "-tb", str(threads), "--no-webui"]
    with running(cmd, url, "llama-server", timeout_s=timeout_s) as proc:
        yield url, proc
