"""Session: one connection to a Parrot server = one server-side session (an app instance), over HTTP.

The frontend's one deliberate global is the *default session*: :func:`connect` (and ``P.local``) set it, so
``write_code(task)`` needs no session argument; closing the session (or leaving its ``with`` block) restores
the previous default. Everything else is passed explicitly (``session=`` on calls).

Wire calls follow docs/api.md. Every non-2xx answer is rebuilt into its typed error with
:func:`parrot.common.errors.error_from_body`; a server that cannot be reached raises :class:`ServerUnreachable`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from parrot.common.errors import ParrotError, error_from_body

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"
MAX_POLL_S = 30.0  # long-poll chunk (the server caps a GET's timeout at 60 s)
_HTTP_SLACK_S = 15.0  # read timeout beyond the long-poll time


class ServerUnreachable(ParrotError):
    """The Parrot server could not be reached (connection refused, DNS, transport timeout). Client-side only."""

    status_code = 503
    error_type = "connection_error"
    code = "server_unreachable"


class NotConnected(ParrotError):
    """A function was called with no ``session=`` and no default session (call ``P.connect`` first)."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "not_connected"


def _raise_for(resp: httpx.Response) -> None:
    if resp.is_success:
        return
    try:
        body = resp.json()
    except ValueError:
        body = {"error": {"message": f"HTTP {resp.status_code}: {resp.text[:200]}"}}
    raise error_from_body(resp.status_code, body)


def _answer(resp: httpx.Response) -> dict:
    """The JSON body of a 2xx answer; any other status raises its typed error."""
    _raise_for(resp)
    return resp.json()


# a call whose connection failed is sent again (see _retryable) for up to RETRY_WINDOW_S: long enough to ride out a
# server restart (with --state-dir its sessions come back: a get waiting across the restart gets its value)
RETRY_WINDOW_S = 60.0
RETRY_BACKOFF_S = 0.1  # the first wait, doubled per attempt up to RETRY_MAX_BACKOFF_S
RETRY_MAX_BACKOFF_S = 2.0


class _Retry:
    """The retry policy of one call, as a state machine both drivers (:meth:`Session._request`,
    :meth:`Session._arequest`) run: they send; after a failed attempt :meth:`after` says how long to wait before
    sending again (exponential from RETRY_BACKOFF_S, capped at RETRY_MAX_BACKOFF_S, within ``window_s``), or gives
    up by raising ServerUnreachable (not retryable, or the window is over)."""

    def __init__(self, url: str, method: str, path: str, window_s: float) -> None:
        self._url, self._method, self._path = url, method, path
        self._deadline = time.monotonic() + window_s
        self._wait = RETRY_BACKOFF_S
        self.attempts = 0

    def after(self, err: httpx.TransportError) -> float:
        """Seconds to wait before sending again; raises ServerUnreachable (from ``err``) to give up."""
        left = self._deadline - time.monotonic()
        if not _retryable(self._method, err) or left <= 0:
            raise ServerUnreachable(f"cannot reach Parrot server at {self._url} ({self.attempts} "
                                    f"retries): {err!r}") from err
        wait, self._wait = min(self._wait, left), min(self._wait * 2, RETRY_MAX_BACKOFF_S)
        self.attempts += 1
        log.info("%s %s: %r; retry %d in %.1f s", self._method, self._path, err, self.attempts, wait)
        return wait


def _retryable(method: str, err: httpx.TransportError) -> bool:
    """Whether a call that failed with ``err`` may be sent again without doing its work twice: GET and DELETE
    always (reading a variable, dropping a session: repeating them changes nothing); any call whose connection was
    never made (the server cannot have seen it). A POST / PUT on a dropped connection may have been done, so it is
    reported, not repeated."""
    return method in ("GET", "DELETE") or isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout))


class Session:
    """A server-side session plus the HTTP clients that talk to it; also runs native functions.

    Create with :func:`connect`. ``close()`` deletes the server session (freeing its engine contexts), waits
    for running native functions and closes the HTTP clients. Thread-safe: semantic calls and ``get`` may be
    issued from any thread (native functions run in this session's thread pool).
    """

    def __init__(self, url: str | None = None, api_key: str | None = None, *, ttl_s: float | None = None,
                 native_workers: int = 8, transport: httpx.BaseTransport | None = None,
                 retry_window_s: float = RETRY_WINDOW_S) -> None:
        """``transport`` replaces the network (tests pass an ``httpx.MockTransport``, used sync and async);
        ``retry_window_s``: how long a call whose connection failed is retried (see RETRY_WINDOW_S)."""
        self.url = (url or os.environ.get("PARROT_URL") or DEFAULT_URL).rstrip("/")
        self.retry_window_s = retry_window_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=MAX_POLL_S + _HTTP_SLACK_S,
                                  transport=transport)
        # the async client of the event loop that used it last (httpx connection pools are bound to a loop)
        self._aclient_of: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None
        self._lock = threading.Lock()
        self.native_pool = ThreadPoolExecutor(max_workers=native_workers, thread_name_prefix="parrot-native")
        self.session_id: str | None = None
        self.closed = False
        self._previous_default: Session | None = None
        body: dict[str, Any] = {} if ttl_s is None else {"ttl_s": ttl_s}
        try:
            answer = self._request("POST", "/api/v1/sessions", json=body)
        except BaseException:
            self._http.close()
            self.native_pool.shutdown(wait=False)
            raise
        self.session_id = answer["session_id"]
        self._http.headers["X-Parrot-Session-Token"] = answer["token"]
        self._token = answer["token"]
        log.info("parrot session %s on %s", self.session_id, self.url)

    # ---- plumbing -------------------------------------------------------------------------------------------
    def _retry(self, method: str, path: str) -> _Retry:
        """The retry state of a new call; NotConnected once the session is closed."""
        if self.closed:
            raise NotConnected(f"session {self.session_id} is closed")
        return _Retry(self.url, method, path, self.retry_window_s)

    def _request(self, method: str, path: str, **kwargs: Any) -> dict:
        retry = self._retry(method, path)
        while True:
            try:
                resp = self._http.request(method, path, **kwargs)
            except httpx.TransportError as e:
                time.sleep(retry.after(e))
            else:
                return _answer(resp)

    def _aclient(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._aclient_of is None or self._aclient_of[0] is not loop:
                headers = dict(self._headers, **{"X-Parrot-Session-Token": self._token})
                client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=MAX_POLL_S + _HTTP_SLACK_S,
                                           transport=self._transport)  # type: ignore[arg-type]
                self._aclient_of = (loop, client)  # a previous loop's client is dropped with that loop
            return self._aclient_of[1]

    async def _arequest(self, method: str, path: str, **kwargs: Any) -> dict:
        retry = self._retry(method, path)
        while True:
            try:
                resp = await self._aclient().request(method, path, **kwargs)
            except httpx.TransportError as e:
                await asyncio.sleep(retry.after(e))
            else:
                return _answer(resp)

    @property
    def _base(self) -> str:
        return f"/api/v1/sessions/{self.session_id}"

    # ---- the Parrot API -------------------------------------------------------------------------------------
    def create_variable(self, name: str | None = None, value: str | None = None, *,
                        tool: Mapping[str, Any] | None = None) -> str:
        """Create a server variable (ready when ``value`` is given); returns its var_id. ``tool``: it is the output
        of a tool call (``{"name", "inputs": [var ids], "expected_duration_s"}``, docs/api.md)."""
        body = {k: v for k, v in (("name", name), ("value", value), ("tool", tool)) if v is not None}
        return self._request("POST", f"{self._base}/variables", json=body)["var_id"]

    def set_variable(self, var_id: str, value: str) -> None:
        self._request("PUT", f"{self._base}/variables/{var_id}", json={"value": value})

    def poll_variable(self, var_id: str, criteria: str | None, timeout_s: float, *,
                      targets: Mapping[str, float] | None = None) -> str | None:
        """One long-poll GET: the value, or None if still pending after ``timeout_s`` (<= MAX_POLL_S).
        ``criteria`` and latency ``targets`` (the GET's ``ttft_ms`` / ``tpot_ms`` / ``deadline_s`` parameters, sent
        as given) are recorded on the variable (GetPerfObj)."""
        answer = self._request("GET", f"{self._base}/variables/{var_id}",
                               params=_poll_params(criteria, timeout_s, targets))
        return answer["value"] if answer["status"] == "ready" else None

    async def apoll_variable(self, var_id: str, criteria: str | None, timeout_s: float, *,
                             targets: Mapping[str, float] | None = None) -> str | None:
        answer = await self._arequest("GET", f"{self._base}/variables/{var_id}",
                                      params=_poll_params(criteria, timeout_s, targets))
        return answer["value"] if answer["status"] == "ready" else None

    def stream_variable(self, var_id: str, params: Mapping[str, Any]) -> Iterator[dict]:
        """``GET .../variables/{var_id}/stream``: the stream's JSON events (docs/api.md) up to the last one;
        ``params`` are its query (``criteria``, latency targets). An error event raises its typed error."""
        if self.closed:
            raise NotConnected(f"session {self.session_id} is closed")
        try:
            with self._http.stream("GET", f"{self._base}/variables/{var_id}/stream", params=dict(params)) as resp:
                if not resp.is_success:
                    resp.read()
                    _raise_for(resp)
                yield from _sse_events(resp.iter_lines())
        except httpx.TransportError as e:
            raise ServerUnreachable(f"stream of {var_id} from {self.url} broke: {e!r}") from e

    async def astream_variable(self, var_id: str, params: Mapping[str, Any]) -> AsyncIterator[dict]:
        """``async`` version of :meth:`stream_variable`."""
        if self.closed:
            raise NotConnected(f"session {self.session_id} is closed")
        try:
            async with self._aclient().stream("GET", f"{self._base}/variables/{var_id}/stream",
                                              params=dict(params)) as resp:
                if not resp.is_success:
                    await resp.aread()
                    _raise_for(resp)
                async for line in resp.aiter_lines():
                    event = _sse_event(line)
                    if event is _DONE:
                        return
                    if event is not None:
                        yield event
        except httpx.TransportError as e:
            raise ServerUnreachable(f"stream of {var_id} from {self.url} broke: {e!r}") from e
        raise ServerUnreachable(f"stream of {var_id} from {self.url} ended without [DONE]")

    def submit(self, prompt: str, placeholders: list[dict], models: list[str] | None = None,
               name: str | None = None) -> dict[str, str]:
        """Submit one semantic call (``name`` labels it in DAG dumps); returns {output name: var_id}."""
        body = {"prompt": prompt, "placeholders": placeholders, "models": list(models or [])}
        if name:
            body["name"] = name
        return self._request("POST", f"{self._base}/submit", json=body)["outputs"]

    def dag(self) -> dict:
        """The session's request DAG (``text`` holds the numbered-lines dump)."""
        return self._request("GET", f"{self._base}/dag")

    # ---- lifetime -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Delete the server session and release clients. Idempotent."""
        if self.closed:
            return
        self.native_pool.shutdown(wait=True, cancel_futures=True)
        try:
            self._request("DELETE", self._base)
        except ParrotError as e:  # the server may be gone already; the session then expires by TTL
            log.warning("could not delete parrot session %s: %s", self.session_id, e)
        self.closed = True
        self._http.close()
        self._aclient_of = None  # an async client belongs to its loop; it holds no pending work
        if _default.session is self:
            _default.session = self._previous_default

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({self.session_id!r} on {self.url}{', closed' if self.closed else ''})"


def _poll_params(criteria: str | None, timeout_s: float, targets: Mapping[str, float] | None) -> dict[str, Any]:
    params: dict[str, Any] = {"timeout": round(max(0.0, min(timeout_s, MAX_POLL_S)), 3)}
    if criteria:
        params["criteria"] = criteria
    if targets:
        params.update(targets)
    return params


_DONE = object()  # the [DONE] line of a stream


def _sse_event(line: str) -> dict | object | None:
    """One SSE line: its JSON event, _DONE, or None (blank / comment / non-data lines). An error event (the
    typed error body of docs/api.md) raises that error."""
    if not line.startswith("data: "):
        return None
    data = line[6:]
    if data == "[DONE]":
        return _DONE
    event = json.loads(data)
    if "error" in event:
        raise error_from_body(500, event)  # the body's code names the error (step_failed with its cause, ...)
    return event


def _sse_events(lines: Iterator[str]) -> Iterator[dict]:
    for line in lines:
        event = _sse_event(line)
        if event is _DONE:
            return
        if event is not None:
            yield event  # type: ignore[misc]
    raise ServerUnreachable("the stream ended without [DONE]")


class _DefaultSession:
    """Holder of the default session (the frontend's single, documented global)."""

    def __init__(self) -> None:
        self.session: Session | None = None


_default = _DefaultSession()


def default_session() -> Session | None:
    """The session used by calls without ``session=`` (set by ``connect`` / ``local``), or None."""
    return _default.session


def set_default_session(session: Session | None) -> None:
    _default.session = session


def resolve_session(session: Session | None) -> Session:
    """``session`` if given, else the default one; raises NotConnected when there is none."""
    s = session or _default.session
    if s is None:
        raise NotConnected("no Parrot session: call P.connect(url) or P.local() first, or pass session=")
    if s.closed:
        raise NotConnected(f"session {s.session_id} is closed")
    return s


def connect(url: str | None = None, api_key: str | None = None, *, ttl_s: float | None = None,
            make_default: bool = True, retry_window_s: float = RETRY_WINDOW_S) -> Session:
    """Open a session on the server at ``url`` (default: $PARROT_URL, else http://127.0.0.1:8000).

    ``api_key`` defaults to $PARROT_API_KEY. With ``make_default`` (the default) the session becomes the
    default used by semantic/native function calls until it is closed. ``retry_window_s``: how long a call whose
    connection failed is retried before it raises ServerUnreachable (0: fail at once). Usable as a context manager.
    """
    session = Session(url, api_key if api_key is not None else os.environ.get("PARROT_API_KEY"), ttl_s=ttl_s,
                      retry_window_s=retry_window_s)
    if make_default:
        session._previous_default = _default.session
        _default.session = session
    return session
