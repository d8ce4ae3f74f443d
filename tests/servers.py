"""A real uvicorn server for an ASGI app on a free 127.0.0.1 port, in a thread of the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL (http://127.0.0.1:PORT)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(400):  # bounded: 10 s
        if srv.started:
            break
        time.sleep(0.025)
    assert srv.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(15)
        sock.close()


def parrot_serve_default_model() -> Iterator[str]:
    """`parrot serve` on the default model in a subprocess (the test skips when the model is missing); yields its
    URL until the generator is closed (a module fixture does ``yield from`` it)."""
    import os
    import subprocess
    import sys

    import pytest

    from parrot.common.errors import ModelNotFound
    from parrot.engine.files.model_files import default_model_path
    from parrot.engine.server.procs import free_port, wait_healthy

    try:
        default_model_path()
    except ModelNotFound as e:
        pytest.skip(str(e))
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PARROT_ENGINE_KV_CACHE_TOKENS="16384", PARROT_LOG_LEVEL="WARNING")
    proc = subprocess.Popen([sys.executable, "-m", "parrot.cli", "serve", "--port", str(port)], env=env, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 240, "parrot serve")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
