"""``P.local()``: the whole Parrot service in this process, for notebooks, examples and tests.

Builds an in-process builtin engine (``parrot.engine.loader.builder.build_local_engine_client``), the server app
(``parrot.api.app.create_app``) on it, runs the app with uvicorn in a background thread on a free
127.0.0.1 port (the socket is bound first, so there is no port race), and opens a session on it. The
returned :class:`LocalSession` is a normal :class:`~parrot.frontend.client.Session` (and the default one);
closing it also stops the server and the engine.

Heavy imports (torch, fastapi, uvicorn) happen only when ``local()`` is called.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from parrot.frontend.client import Session, _default

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # model load + app startup
SHUTDOWN_TIMEOUT_S = 30.0


class LocalServer:
    """A uvicorn server for ``app`` on 127.0.0.1 in a daemon thread. ``stop()`` is idempotent."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        # IPPROTO_TCP, not 0: asyncio turns TCP_NODELAY on only for sockets whose protocol says TCP, and accepted
        # connections inherit the listening socket's. With protocol 0, Nagle's algorithm meets the client's delayed
        # ACKs and every small keep-alive call to this server waits out the delayed-ACK timer.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"parrot-local-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive():
                self._sock.close()
                raise RuntimeError(f"local Parrot server failed to start: {self._error!r}") from self._error
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"local Parrot server not started after {STARTUP_TIMEOUT_S} s")
            time.sleep(0.02)
        log.info("local Parrot server on %s", self.url)

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as e:  # noqa: BLE001 -- reported by the starter / stop()
            self._error = e
            log.exception("local Parrot server crashed")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            log.error("local Parrot server thread did not stop within %s s", SHUTDOWN_TIMEOUT_S)
        self._sock.close()


def _close_engines(engines: list[Any]) -> None:
    """Close engine clients (the app does not own them) from this thread, after the server loop is gone."""
    import asyncio

    for engine in engines:
        try:
            asyncio.run(engine.close())
        except Exception:  # noqa: BLE001 -- closing the others matters more; the failure is logged
            log.exception("closing engine %s failed", getattr(engine, "name", engine))


class LocalSession(Session):
    """A Session whose server (and engines) run in this process; ``close()`` stops them too."""

    def __init__(self, server: LocalServer, *, engines: list[Any] = (), api_key: str | None = None,
                 ttl_s: float | None = None) -> None:
        self.server = server
        self.engines = list(engines)
        try:
            super().__init__(server.url, api_key, ttl_s=ttl_s)
        except BaseException:
            server.stop()
            _close_engines(self.engines)
            raise

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()
        finally:
            self.server.stop()
            _close_engines(self.engines)


def local(model: str | None = None, *, api_key: str | None = None, server_settings: dict | None = None,
          log_level: str = "warning", make_default: bool = True, **engine_settings: Any) -> LocalSession:
    """Start engine + server in-process and connect (see module docstring).

    ``model`` is a GGUF file or HF directory (None = the default SmolLM2-135M); ``engine_settings`` are
    :class:`parrot.engine.settings.EngineSettings` fields (``dtype``, ``kv_cache_tokens``, ...);
    ``server_settings`` are the server's settings fields. Invalid settings raise ``ValueError`` naming the field.
    """
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.settings import EngineSettings

    settings = ServerSettings(**dict(server_settings or {}, **({"api_key": api_key} if api_key else {})))
    engine = build_local_engine_client(EngineSettings(model=model, **engine_settings))
    try:
        server = LocalServer(create_app(settings, [engine]), log_level=log_level)
    except BaseException:
        _close_engines([engine])
        raise
    session = LocalSession(server, engines=[engine], api_key=api_key)
    if make_default:
        session._previous_default = _default.session
        _default.session = session
    return session
