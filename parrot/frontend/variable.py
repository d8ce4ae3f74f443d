"""SemanticVariable: a future for a string value living in a Parrot session (paper §4.1).

A variable has one of three origins:

* **user**: ``SemanticVariable("a snake game")`` or empty and ``.set()`` later;
* **semantic output**: returned by a semantic-function call; the server produces it;
* **native output**: returned by a native-function call; this client produces it (in a worker thread) and
  pushes the value to the server if the variable was ever passed to a semantic function.

A variable is bound lazily to one session (created on the server the first time a call needs its id).
``stream`` / ``astream`` (``async for piece in var``) yield the value in pieces while the server generates it.
``get`` / ``aget`` long-poll the server in chunks and annotate the fetch with a performance criterion
(the paper's GetPerfObj): ``LATENCY`` / ``THROUGHPUT``, or :class:`Latency` with targets (time to first token,
time per output token, a deadline), which the scheduler orders and caps by (docs/api.md). A failed producer
raises its typed error (``StepFailed`` from the server; a native function's own exception for its outputs;
``StepFailed`` with cause ``native_function_failed`` for semantic outputs that depend on a failed native
function).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Generator, Iterator
from typing import TYPE_CHECKING

from parrot.common.errors import InvalidRequestError, ParrotError, StepFailed, VariableAlreadySet
from parrot.common.perf import LatencyTargets, PerfCriteria
from parrot.frontend.client import MAX_POLL_S, resolve_session
from parrot.frontend.conditions import ConditionMethods

if TYPE_CHECKING:
    from parrot.frontend.client import Session

log = logging.getLogger(__name__)

NATIVE_POLL_S = 0.5  # poll chunk while a client-side (native) ancestor is pending: its failure must surface

LATENCY = PerfCriteria.LATENCY
THROUGHPUT = PerfCriteria.THROUGHPUT


class Latency(LatencyTargets):
    """The LATENCY criterion with targets (the extension the paper names): ``ttft_s`` -- first token within
    this, ``tpot_s`` -- at most this per output token (the scheduler caps the engine's batch to keep it),
    ``deadline_s`` -- the value wanted within this many seconds of the ``get``. Each is optional, > 0 and
    finite (:class:`~parrot.common.perf.LatencyTargets` validates them and writes the GET parameters)::

        answer.get(perf=Latency(tpot_s=0.05, deadline_s=10))

    The producers of the fetched variable inherit all three, their predecessors only the deadline."""


Perf = PerfCriteria | str | Latency


def _criteria(perf: Perf) -> tuple[str, Latency | None]:
    """(criterion name, targets) of a ``perf`` argument; InvalidRequestError for anything else."""
    if isinstance(perf, Latency):
        return PerfCriteria.LATENCY.value, perf
    try:
        return PerfCriteria(perf).value, None
    except ValueError:
        known = ", ".join(c.value for c in PerfCriteria)
        raise InvalidRequestError(f"unknown perf criterion {perf!r} (known: {known}, or Latency(...))",
                                  param="perf") from None


def _fetch_params(perf: Perf, ttft_ms: float | None, tpot_ms: float | None,
                  deadline_s: float | None) -> tuple[str, dict[str, float]]:
    """(criterion name, latency-target query parameters) of a get / stream.

    The keyword targets are the HTTP API's own GET parameters and are sent exactly as given (so the manager's
    deduction sees what a raw ``GET ...?ttft_ms=`` would give it); ``Latency(...)`` is converted by its
    :meth:`~parrot.common.perf.LatencyTargets.query`. Each is None or a positive finite number; targets need the
    LATENCY criterion and come one way or the other, not both (InvalidRequestError naming the argument)."""
    criteria, latency = _criteria(perf)
    given = {k: v for k, v in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms), ("deadline_s", deadline_s))
             if v is not None}
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
            raise InvalidRequestError(f"{name} must be a positive finite number, got {value!r}", param=name)
    if not given:
        return criteria, latency.query() if latency is not None else {}
    if latency is not None:
        raise InvalidRequestError("give latency targets either as perf=Latency(...) or as ttft_ms / tpot_ms / "
                                  "deadline_s, not both", param="perf")
    if criteria != PerfCriteria.LATENCY.value:
        raise InvalidRequestError(f"latency targets ({', '.join(given)}) need perf=LATENCY, got {criteria!r}",
                                  param="perf")
    return criteria, given


class _Origin(enum.Enum):
    USER = "user"
    SEMANTIC = "semantic"
    NATIVE = "native"


class SemanticVariable(ConditionMethods):
    """A string value that may not exist yet. See the module docstring for origins and errors."""

    def __init__(self, value: str | None = None, name: str | None = None, *, session: "Session | None" = None):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"SemanticVariable value must be str, got {type(value).__name__}")
        self.name = name
        self._lock = threading.RLock()
        self._value = value
        self._error: BaseException | None = None
        self._session = session
        self._var_id: str | None = None
        self._pushed = False  # whether the server variable holds ``_value``
        self._origin = _Origin.USER
        self._inputs: tuple[SemanticVariable, ...] = ()  # client-known producer inputs (failure propagation)
        self._native: concurrent.futures.Future[str] | None = None
        self._producer = ""  # description of the producer, for error messages

    # ---- construction by calls ------------------------------------------------------------------------------
    @classmethod
    def _semantic_output(cls, name: str, session: "Session", var_id: str, inputs: tuple["SemanticVariable", ...],
                         producer: str) -> "SemanticVariable":
        v = cls(name=name, session=session)
        v._var_id, v._origin, v._inputs, v._producer = var_id, _Origin.SEMANTIC, inputs, producer
        return v

    @classmethod
    def _native_output(cls, name: str, session: "Session", future: "concurrent.futures.Future[str]",
                       inputs: tuple["SemanticVariable", ...], producer: str) -> "SemanticVariable":
        v = cls(name=name, session=session)
        v._origin, v._inputs, v._native, v._producer = _Origin.NATIVE, inputs, future, producer
        future.add_done_callback(v._on_native_done)
        return v

    # ---- identity and binding -------------------------------------------------------------------------------
    @property
    def id(self) -> str:
        """The server var_id (binds the variable to its / the default session on first use)."""
        return self._bind(self._session)

    @property
    def session(self) -> "Session | None":
        return self._session

    def _bind(self, session: "Session | None") -> str:
        """Make sure the variable exists in ``session`` on the server and return its var_id."""
        with self._lock:
            session = resolve_session(session or self._session)
            if self._session is not None and self._session is not session:
                raise InvalidRequestError(f"variable {self!r} belongs to session {self._session.session_id}, "
                                          f"not {session.session_id}", param="session")
            if self._var_id is None:
                value = self._value
                if self._native is not None and self._native.done() and self._native.exception() is None:
                    value = self._native.result()
                self._var_id = session.create_variable(self.name, value)
                self._session = session
                self._pushed = value is not None
            return self._var_id

    def _bind_tool_output(self, session: "Session", tool: dict) -> str:
        """Create this native output on the server now, declared as the output of ``tool`` (a ToolDecl's wire
        form: name, inputs, expected_duration_s); its value is pushed when the native function returns."""
        with self._lock:
            if self._var_id is None:
                value = None
                if self._native is not None and self._native.done() and self._native.exception() is None:
                    value = self._native.result()
                self._var_id = session.create_variable(self.name, tool=tool)
                self._session = session
                if value is not None:
                    session.set_variable(self._var_id, value)
                    self._pushed = True
            return self._var_id

    def _on_native_done(self, future: "concurrent.futures.Future[str]") -> None:
        """Runs in the native worker: record the outcome; push the value if the server already knows us."""
        with self._lock:
            if future.cancelled() or future.exception() is not None:
                self._error = future.exception() or concurrent.futures.CancelledError()
                return
            self._value = future.result()
            if self._var_id is not None and not self._pushed and self._session is not None:
                try:
                    self._session.set_variable(self._var_id, self._value)
                    self._pushed = True
                except ParrotError as e:
                    log.error("could not push native output %s to the server: %s", self, e)
                    self._error = e

    # ---- value ----------------------------------------------------------------------------------------------
    def set(self, value: str) -> None:
        """Give a user variable its value (once). Produced variables and set ones raise VariableAlreadySet."""
        if not isinstance(value, str):
            raise TypeError(f"SemanticVariable value must be str, got {type(value).__name__}")
        with self._lock:
            if self._origin is not _Origin.USER:
                raise VariableAlreadySet(f"variable {self!r} is produced by {self._producer}; it cannot be set")
            if self._value is not None:
                raise VariableAlreadySet(f"variable {self!r} is already set")
            if self._var_id is not None and self._session is not None:
                self._session.set_variable(self._var_id, value)
                self._pushed = True
            self._value = value

    @property
    def ready(self) -> bool:
        """True when ``get`` would return (or raise) without waiting. Asks the server without waiting."""
        with self._lock:
            if self._value is not None or self._error is not None:
                return True
            if self._native is not None:
                return self._native.done()
            if self._var_id is None:
                return False
            session, var_id = self._session, self._var_id
        if self._failed_ancestor() is not None:
            return True
        try:
            value = session.poll_variable(var_id, None, 0.0)
        except StepFailed as e:
            self._error = e
            return True
        if value is not None:
            self._value = value
        return value is not None

    def get(self, perf: Perf = LATENCY, timeout: float | None = None, *, ttft_ms: float | None = None,
            tpot_ms: float | None = None, deadline_s: float | None = None) -> str:
        """Block until the value exists and return it. ``perf`` annotates the fetch: LATENCY, THROUGHPUT or
        :class:`Latency` with targets; or LATENCY with the HTTP API's target parameters as keywords
        (``ttft_ms``, ``tpot_ms``, ``deadline_s``, sent as given). Targets go with the first poll; the server
        keeps them for the variable.

        Raises the producer's typed error (see module docstring); TimeoutError after ``timeout`` seconds;
        InvalidRequestError for a bad criterion or target.
        """
        criteria, targets = _fetch_params(perf, ttft_ms, tpot_ms, deadline_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        fetched = self._fetched()
        if fetched is not None:
            return fetched
        if self._native is not None:
            return self._native.result(timeout=timeout)  # raises the native function's own exception
        var_id = self._bind(self._session)
        polls = self._polls(targets, deadline, timeout)
        with self._keeping_failure():
            try:
                chunk, targets = next(polls)
                while True:
                    chunk, targets = polls.send(self._session.poll_variable(var_id, criteria, chunk, targets=targets))
            except StopIteration as done:
                return done.value

    async def aget(self, perf: Perf = LATENCY, timeout: float | None = None, *, ttft_ms: float | None = None,
                   tpot_ms: float | None = None, deadline_s: float | None = None) -> str:
        """``await`` version of :meth:`get` (uses the session's async HTTP client)."""
        criteria, targets = _fetch_params(perf, ttft_ms, tpot_ms, deadline_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        fetched = self._fetched()
        if fetched is not None:
            return fetched
        if self._native is not None:
            done, _ = await asyncio.wait([asyncio.wrap_future(self._native)], timeout=timeout)
            if not done:
                raise TimeoutError(f"{self!r} not ready after {timeout} s")
            return done.pop().result()
        var_id = self._var_id or await asyncio.to_thread(self._bind, self._session)
        polls = self._polls(targets, deadline, timeout)
        with self._keeping_failure():
            try:
                chunk, targets = next(polls)
                while True:
                    chunk, targets = polls.send(
                        await self._session.apoll_variable(var_id, criteria, chunk, targets=targets))
            except StopIteration as done:
                return done.value

    def _polls(self, targets: dict[str, float], deadline: float | None,
               timeout: float | None) -> Generator[tuple[float, dict[str, float]], str | None, str]:
        """The long-polls of one get / aget, the policy both drivers share: yields each poll's (seconds, latency
        targets) and is sent its answer (the value, or None while pending); returns the value and keeps it.
        Raises TimeoutError once ``deadline`` (``timeout`` after the call) has passed, and StepFailed (via
        :meth:`_poll_chunk`) when a native ancestor failed."""
        while True:
            chunk = self._poll_chunk()
            if deadline is not None:
                chunk = min(chunk, max(0.0, deadline - time.monotonic()))
            value = yield chunk, targets
            targets = {}  # recorded by the first poll (a relative deadline re-sent later would move)
            if value is not None:
                self._value = value
                return value
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self!r} not ready after {timeout} s")

    @contextlib.contextmanager
    def _keeping_failure(self) -> Iterator[None]:
        """A StepFailed raised inside is kept: later gets and streams raise it without asking the server."""
        try:
            yield
        except StepFailed as e:
            self._error = e
            raise

    # ---- streaming --------------------------------------------------------------------------------------------
    def stream(self, perf: Perf = LATENCY, *, ttft_ms: float | None = None, tpot_ms: float | None = None,
               deadline_s: float | None = None) -> Iterator[str]:
        """The value in pieces as the server generates it (``GET .../stream``, docs/api.md)::

            for piece in answer.stream():
                print(piece, end="", flush=True)

        Counts as a :meth:`get` with the same ``perf`` / targets (validated now, not at the first ``next``). The
        pieces are the generated text (stop strings never in it); they join to the value unless the output has
        transforms (then they are the text before the transforms; :meth:`get` answers the value at once after
        the stream). A variable that is not generated (set by the client, a native function's output) yields its
        value as one piece. A failed producer or upstream step raises its typed error where the stream is."""
        criteria, targets = _fetch_params(perf, ttft_ms, tpot_ms, deadline_s)
        return self._stream(criteria, targets)

    def _stream(self, criteria: str, targets: dict[str, float]) -> Iterator[str]:
        if self._value is None and self._error is None and self._native is not None:
            concurrent.futures.wait([self._native])  # the native function's outcome is read below
        known = self._known_outcome()
        if known is not None:
            if known:
                yield known
            return
        # a semantic output waits server-side for its native inputs: a failed one would never arrive
        concurrent.futures.wait(self._native_ancestors())
        self._check_native_ancestors()
        var_id = self._bind(self._session)
        with self._keeping_failure():
            for event in self._session.stream_variable(var_id, {"criteria": criteria, **targets}):
                piece = self._take(event)
                if piece is not None:
                    yield piece

    def astream(self, perf: Perf = LATENCY, *, ttft_ms: float | None = None, tpot_ms: float | None = None,
                deadline_s: float | None = None) -> AsyncIterator[str]:
        """``async for`` version of :meth:`stream` (the session's async HTTP client); ``async for piece in var``
        is ``var.astream()`` with LATENCY."""
        criteria, targets = _fetch_params(perf, ttft_ms, tpot_ms, deadline_s)
        return self._astream(criteria, targets)

    def __aiter__(self) -> AsyncIterator[str]:
        return self.astream()

    async def _astream(self, criteria: str, targets: dict[str, float]) -> AsyncIterator[str]:
        if self._value is None and self._error is None and self._native is not None:
            await asyncio.wait([asyncio.wrap_future(self._native)])
        known = self._known_outcome()
        if known is not None:
            if known:
                yield known
            return
        pending = [asyncio.wrap_future(f) for f in self._native_ancestors()]
        if pending:
            await asyncio.wait(pending)
        self._check_native_ancestors()
        var_id = self._var_id or await asyncio.to_thread(self._bind, self._session)
        with self._keeping_failure():
            async for event in self._session.astream_variable(var_id, {"criteria": criteria, **targets}):
                piece = self._take(event)
                if piece is not None:
                    yield piece

    def _take(self, event: dict) -> str | None:
        """One stream event: a piece's text, or None (``done``: its value is kept for ``get``; a keepalive)."""
        if event["type"] == "piece":
            return event["text"]
        if event["type"] == "done":
            self._value = event["value"]
        return None

    def _known_outcome(self) -> str | None:
        """The value if this client already has it (user-set, fetched, a finished native function); raises a
        known failure; None when the server must be asked."""
        fetched = self._fetched()
        if fetched is None and self._native is not None and self._native.done():
            return self._native.result()  # raises the native function's own exception
        return fetched

    def _fetched(self) -> str | None:
        """The value if this client holds it (user-set, fetched, pushed by a native function); raises a kept
        failure; None otherwise."""
        if self._value is not None:
            return self._value
        if self._error is not None:
            raise self._error
        return None

    def _native_ancestors(self) -> list["concurrent.futures.Future[str]"]:
        return [v._native for v in self._ancestors() if v._native is not None]

    def _check_native_ancestors(self) -> None:
        """Raise (and keep) a StepFailed if a native function upstream failed (its outputs never reach the server)."""
        for v in self._ancestors():
            if v._native is not None and v._native.done() and (v._native.cancelled()
                                                               or v._native.exception() is not None):
                self._error = StepFailed(f"{self!r} depends on {v!r}, whose {v._producer} failed: "
                                         f"{v._native.exception() if not v._native.cancelled() else 'cancelled'!r}",
                                         cause_code="native_function_failed")
                raise self._error

    def _poll_chunk(self) -> float:
        """Long-poll length; short while a native ancestor is pending. Raises if a native ancestor failed."""
        failed = self._failed_ancestor()
        if failed is not None:
            self._error = StepFailed(f"{self!r} depends on {failed!r}, whose {failed._producer} failed: "
                                     f"{failed._error!r}", cause_code="native_function_failed")
            raise self._error
        return NATIVE_POLL_S if self._pending_native_ancestor() else MAX_POLL_S

    def _ancestors(self) -> list["SemanticVariable"]:
        seen: dict[int, SemanticVariable] = {}
        stack = list(self._inputs)
        while stack:
            v = stack.pop()
            if id(v) not in seen:
                seen[id(v)] = v
                stack.extend(v._inputs)
        return list(seen.values())

    def _failed_ancestor(self) -> "SemanticVariable | None":
        return next((v for v in self._ancestors() if v._native is not None and v._error is not None), None)

    def _pending_native_ancestor(self) -> bool:
        return any(v._native is not None and not v._native.done() for v in self._ancestors())

    def __repr__(self) -> str:
        state = "ready" if self._value is not None else "failed" if self._error is not None else "pending"
        return f"SemanticVariable({self.name or '?'}, id={self._var_id}, {self._origin.value}, {state})"
