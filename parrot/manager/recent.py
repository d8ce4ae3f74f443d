"""The most recent finished requests, with their timings: a bounded ring the live web view (``/ui``) reads.

Two producers add one record each time a request ends, however it ends:

* the graph executor, for a DAG request (Semantic Variables): one record per request, from its node;
* the completion service, for one prompt of an OpenAI-side request: :meth:`RecentRequests.span` around the
  prompt's dispatch + run, told the engine when one is leased.

Timings are on the manager's clock (the DAG's milestones are too)::

    submitted ---queue---> dispatched ---prefill---> first_token ---decode---> finished
              (wait_s)                 (ttft_s counts from submitted)          (total_s)

A record carries its owner: the tenant of the session for a DAG request. The completion service does not know
the tenant of a prompt (the OpenAI routes hand it a plan only), so those records have ``owner=None``; readers
decide what an unowned record may show (the web view shows them to every tenant without ids, like engine load).
Only metadata is kept: never prompt or output text. Not thread-safe: written and read on the event loop.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from parrot.common.errors import ParrotError, StepFailed
from parrot.manager.graph import RequestNode, RequestStatus


class RequestKind(str, enum.Enum):
    DAG = "dag"  # a request of a session's graph (Parrot API)
    OPENAI = "openai"  # one prompt of a /v1/completions, /v1/chat/completions or /v1/responses request


class Outcome(str, enum.Enum):
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"  # the client went away or the session was closed first


_OUTCOMES = {RequestStatus.FINISHED: Outcome.FINISHED, RequestStatus.FAILED: Outcome.FAILED}


@dataclass(frozen=True)
class RequestRecord:
    seq: int  # position in the stream of records (strictly increasing; readers ask for records after one)
    kind: RequestKind
    request_id: str  # "s_.../r_3" for a DAG request, "<completion id>/<prompt index>" for an OpenAI prompt
    label: str  # what ran: "summarize(summary)" for a DAG request, the model for an OpenAI prompt
    owner: str | None  # the tenant; None when the producer does not know it (see the module docstring)
    session_id: str | None
    engine: str | None  # the engine of its last run (None if it never got one)
    outcome: Outcome
    error_code: str | None  # the cause code of a failure
    submitted: float
    dispatched: float | None
    first_token: float | None
    finished: float
    prompt_tokens: int | None = None
    prefix_context: str | None = None  # the prefix context it forked from (prefix sharing), if any
    shared_tokens: int = 0

    def to_json(self) -> dict:
        def since(t: float | None) -> float | None:
            return None if t is None else round(max(0.0, t - self.submitted), 4)

        return {"seq": self.seq, "kind": self.kind.value, "request_id": self.request_id, "label": self.label,
                "session_id": self.session_id, "engine": self.engine, "outcome": self.outcome.value,
                "error_code": self.error_code, "submitted": self.submitted, "finished": self.finished,
                "wait_s": since(self.dispatched), "ttft_s": since(self.first_token), "total_s": since(self.finished),
                "prompt_tokens": self.prompt_tokens, "prefix_context": self.prefix_context,
                "shared_tokens": self.shared_tokens}


@dataclass
class Span:
    """One OpenAI-side prompt being timed by :meth:`RecentRequests.span`; the caller stamps what it learns."""

    submitted: float
    engine: str | None = None
    dispatched: float | None = None
    first_token: float | None = None


class RecentRequests:
    """The last ``capacity`` records, oldest first."""

    def __init__(self, capacity: int = 500, *, clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self._clock = clock
        self._ring: deque[RequestRecord] = deque(maxlen=capacity)
        self._seq = 0

    @property
    def last_seq(self) -> int:
        """The seq of the newest record (0 before the first): changes whenever a record is added."""
        return self._seq

    def add(self, **fields) -> RequestRecord:
        """Append a record (the fields of :class:`RequestRecord` but ``seq``); the oldest falls out when full."""
        self._seq += 1
        record = RequestRecord(seq=self._seq, **fields)
        self._ring.append(record)
        return record

    def dag_request_done(self, session_id: str, owner: str, req: RequestNode) -> RequestRecord:
        """Record a DAG request that just ended: FINISHED and FAILED are themselves, anything else (its task was
        cancelled) is CANCELLED."""
        outcome = _OUTCOMES.get(req.status, Outcome.CANCELLED)
        err = req.error
        return self.add(kind=RequestKind.DAG, request_id=f"{session_id}/{req.request_id}", label=req.label,
                        owner=owner, session_id=session_id, engine=req.engine, outcome=outcome,
                        error_code=err.cause_code if err is not None else None, submitted=req.times.submitted,
                        dispatched=req.times.dispatched, first_token=req.times.first_token,
                        finished=req.times.finished if req.times.finished is not None else self._clock(),
                        prefix_context=req.prefix_context, shared_tokens=req.num_shared_tokens)

    @contextmanager
    def span(self, request_id: str, label: str, *, prompt_tokens: int | None = None) -> Iterator[Span]:
        """Time the body as one OpenAI-side prompt and record it when the body ends (its outcome from how)."""
        span = Span(submitted=self._clock())
        outcome, code = Outcome.FINISHED, None
        try:
            yield span
        except (asyncio.CancelledError, GeneratorExit):
            outcome = Outcome.CANCELLED
            raise
        except BaseException as e:
            outcome = Outcome.FAILED
            code = (e.cause_code if isinstance(e, StepFailed) else e.code) if isinstance(e, ParrotError) \
                else "internal_error"
            raise
        finally:
            self.add(kind=RequestKind.OPENAI, request_id=request_id, label=label, owner=None, session_id=None,
                     engine=span.engine, outcome=outcome, error_code=code, submitted=span.submitted,
                     dispatched=span.dispatched, first_token=span.first_token, finished=self._clock(),
                     prompt_tokens=prompt_tokens)

    def dispatched(self, span: Span, engine: str) -> None:
        """The prompt got ``engine`` (again, after a failover: the last one counts)."""
        span.engine, span.dispatched = engine, self._clock()

    def visible_to(self, owner: str | None, *, limit: int = 100) -> list[RequestRecord]:
        """The newest ``limit`` records ``owner`` may see, newest first: its own and the unowned ones
        (``owner=None``: everything, an operator's view)."""
        out: list[RequestRecord] = []
        for record in reversed(self._ring):
            if owner is None or record.owner is None or record.owner == owner:
                out.append(record)
                if len(out) >= limit:
                    break
        return out
