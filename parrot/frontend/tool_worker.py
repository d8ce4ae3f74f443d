"""The flow API's session calls (docs/flows.md) and the client-tool worker: the thread that runs this client's
native functions for the flows' ``runs: "client"`` tool steps.

One worker per session (started lazily by the first flow with a client tool, kept in a weakly keyed registry): it
long-polls ``GET .../tool_calls`` for the tools it knows, runs each call in the session's native pool and answers
with the value (``PUT`` the call's variable) or the error (``POST .../tool_calls/{id}/error``); it stops once the
session is closed (within one poll).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from parrot.common.errors import ParrotError
from parrot.frontend.client import NotConnected, Session
from parrot.frontend.native import NativeFunction

log = logging.getLogger(__name__)

TOOL_POLL_S = 20.0  # the worker's long-poll (tests lower it: the worker notices a close within it)

# ---- the Session calls of the flow API (docs/flows.md) -------------------------------------------------------------
def submit_flow(session: Session, body: Mapping[str, Any]) -> dict:
    """``POST /api/v1/sessions/{sid}/flows``: ``{"flow_id", "outputs": {name: var_id}}``; a 400 raises its typed
    error (``param`` names the step path)."""
    return session._request("POST", f"{session._base}/flows", json=dict(body))


def flow_status(session: Session, flow_id: str) -> dict:
    """``GET .../flows/{flow_id}``: status, outputs, events and error of a flow."""
    return session._request("GET", f"{session._base}/flows/{flow_id}")


def tool_calls(session: Session, tools: Sequence[str], timeout_s: float) -> list[dict]:
    """One long-poll for client tool calls of ``tools``: ``[{"call_id", "tool", "args", "flow_id"}]`` (each call
    is handed out once)."""
    params = {"timeout": round(max(0.0, timeout_s), 3), "tools": ",".join(tools)}
    return session._request("GET", f"{session._base}/tool_calls", params=params)["calls"]


def tool_call_error(session: Session, call_id: str, message: str) -> None:
    """Fail a client tool call: its output (and what reads it) fails, or with ``on_error: "value"`` becomes
    ``"error: <message>"``."""
    session._request("POST", f"{session._base}/tool_calls/{call_id}/error", json={"message": message})



# ---- the client-tool worker ---------------------------------------------------------------------------------------------
class _ToolWorker:
    """Answers a session's client tool calls (one daemon thread, started on the first registration; it ends
    once the session is closed)."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._tools: dict[str, NativeFunction] = {}
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"parrot-flow-tools-{session.session_id}",
                                       daemon=True)

    def register(self, tools: Mapping[str, NativeFunction]) -> None:
        with self._lock:
            for name, nf in tools.items():
                known = self._tools.setdefault(name, nf)
                if known.fn is not nf.fn:
                    raise TypeError(f"tool name {name!r} already runs {known.name} in this session, not {nf.name}")
            if not self.thread.is_alive() and self.thread.ident is None:
                self.thread.start()

    def _run(self) -> None:
        wait = 0.1
        while not self._session.closed:
            with self._lock:
                names = sorted(self._tools)
            try:
                calls = tool_calls(self._session, names, TOOL_POLL_S)
            except NotConnected:
                break
            except ParrotError as e:
                if self._session.closed:
                    break
                log.warning("tool-call poll of session %s failed: %s; again in %.1f s", self._session.session_id,
                            e, wait)
                time.sleep(wait)
                wait = min(wait * 2, 5.0)
                continue
            except Exception as e:  # noqa: BLE001 -- the http client closed under a poll: the session is closing
                if self._session.closed:
                    break
                log.warning("tool-call poll of session %s broke: %r", self._session.session_id, e)
                time.sleep(wait)
                wait = min(wait * 2, 5.0)
                continue
            wait = 0.1
            for call in calls:
                try:
                    self._session.native_pool.submit(self._answer, call)
                except RuntimeError:  # the pool is shut down: the session is closing
                    return
        log.debug("tool worker of session %s stopped", self._session.session_id)

    def _answer(self, call: Mapping[str, Any]) -> None:
        """Run one call and send its value or its error. Never raises."""
        call_id, name = call["call_id"], call["tool"]
        with self._lock:
            nf = self._tools.get(name)
        try:
            if nf is None:
                raise LookupError(f"no native function for tool {name!r} in this client")
            result = nf.fn(**call.get("args", {}))
            if not isinstance(result, str):
                raise TypeError(f"tool {name!r} ({nf.name}) must return a str, got {type(result).__name__}")
        except Exception as e:  # noqa: BLE001 -- user code: its failure is the call's error
            log.info("client tool %s (%s) failed: %r", name, call_id, e)
            message = f"{type(e).__name__}: {e}"
            self._send(lambda: tool_call_error(self._session, call_id, message))
            return
        self._send(lambda: self._session.set_variable(call_id, result))

    def _send(self, send: Callable[[], None]) -> None:
        try:
            send()
        except ParrotError as e:
            log.warning("could not answer a tool call of session %s: %s", self._session.session_id, e)


_workers: weakref.WeakKeyDictionary[Session, _ToolWorker] = weakref.WeakKeyDictionary()
_workers_lock = threading.Lock()


def worker_for(session: Session) -> _ToolWorker:
    with _workers_lock:
        worker = _workers.get(session)
        if worker is None:
            worker = _workers[session] = _ToolWorker(session)
        return worker
