"""Real servers for the external-engine tests: `parrot serve` processes and llama.cpp's `llama-server`
(parrot.backends.llama_server), each on a free 127.0.0.1 port, waited for and stopped when its block ends."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from parrot.backends.llama_server import binary_path, running
from parrot.engine.server.procs import free_port
from parrot.backends.llama_server import llama_server as _llama_server

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def parrot_serve(*args: str, env: dict | None = None, timeout_s: float = 240) -> Iterator[tuple[str, object]]:
    """`parrot serve ARGS` on a free port; yields (url, process)."""
    port = free_port()
    full_env = dict(os.environ, PARROT_ENGINE_KV_CACHE_TOKENS="16384", PARROT_LOG_LEVEL="WARNING", **(env or {}))
    url = f"http://127.0.0.1:{port}"
    with running([sys.executable, "-m", "parrot.cli", "serve", "--port", str(port), *args], url, "parrot serve",
                 env=full_env, timeout_s=timeout_s, quiet=False) as proc:
        yield url, proc


def llama_server_or_skip() -> Path:
    """The llama-server binary built by scripts/install-llama-server.sh (the test suite's setup builds it)."""
    binary = binary_path()
    if not binary.exists():
        pytest.skip(f"llama-server not built: run `bash scripts/install-llama-server.sh` ({binary} missing)")
    return binary


@contextlib.contextmanager
def llama_server(model: str, **kw) -> Iterator[tuple[str, object]]:
    llama_server_or_skip()
    with _llama_server(model, **kw) as served:
        yield served
