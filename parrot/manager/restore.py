"""Rebuilding sessions from the journal when a manager starts on an existing ``--state-dir``
(:mod:`parrot.manager.journal` says what is recorded).

What a restart keeps and what it does not::

    journaled                          after the restart
    ---------------------------------  -------------------------------------------------------------------
    session (owner, token digest)      same id; the client's token still authenticates; TTL starts again
    variable ready (value)             ready, same value: GETs answer at once
    variable failed (error)            failed, same error (424 with the same cause)
    variable pending                   pending; its producer runs again (below)
    request finished / failed          as it was
    request waiting / ready / running  waiting, then started as usual when its inputs are ready: it runs from its
                                       head on a fresh engine context (prefix contexts are re-created as
                                       needed); outputs it had materialized are filled back from their raw
                                       text, never generated twice
    perf criteria recorded by GETs     recorded again, labels re-deduced (latency targets are not kept)
    flow (declaration, exports)        running flows run again over the restored graph, meeting the nodes they had
                                       made by origin: a loop continues at its iteration (parrot.manager.flows)
    engine contexts, prefix store      gone (engines re-register or are rebuilt; contexts are refilled)

Engines that register over HTTP come back on their own schedule (their heartbeat backoff), so when no engine is
live at start the unfinished requests are held until the first one is (``restore_wait_s`` at most; then they are
submitted anyway and fail with ``engine_unavailable`` like any request with no engine: never a hang).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from parrot.common.errors import StepFailed
from parrot.common.perf import PerfCriteria
from parrot.common.sampling import SamplingParams
from parrot.common.template import PlaceholderSegment, Segment, TextSegment
from parrot.common.transforms import validate_transform
from parrot.manager.graph import (PlaceholderBinding, RequestNode, RequestStatus, RequestTimes, Variable,
                                  VarStatus)
from parrot.manager.journal import ErrorRecord, JournalError, RequestRecord, SessionRecord, VariableRecord
from parrot.manager.perf import PerfAnnotation
from parrot.manager.session import SessionState

if TYPE_CHECKING:
    from parrot.manager.manager import Manager

logger = logging.getLogger(__name__)


def _error(rec: ErrorRecord | None) -> StepFailed | None:
    return None if rec is None else StepFailed(rec.message, cause_code=rec.code)


def rebuild_variable(rec: VariableRecord) -> Variable:
    var = Variable(var_id=rec.var_id, number=rec.number, name=rec.name, status=VarStatus(rec.status),
                   value=rec.value, error=_error(rec.error), origin=rec.origin, client_tool=rec.client_tool)
    if rec.perf is not None:
        var.perf = PerfAnnotation(PerfCriteria(rec.perf), rec.perf_at if rec.perf_at is not None else 0.0)
    return var


def rebuild_request(rec: RequestRecord) -> RequestNode:
    """The node of a journaled request (see journal.request_spec), in the status it was journaled with."""
    spec = rec.spec
    segments: list[Segment] = [TextSegment(s["text"]) if "text" in s else PlaceholderSegment(s["name"], s["is_output"])
                               for s in spec["segments"]]
    bindings = {
        b["name"]: PlaceholderBinding(
            b["name"], b["is_output"], b["var_id"],
            SamplingParams.from_dict(b["sampling"]) if b["sampling"] is not None else None,
            tuple(validate_transform(t) for t in b["transforms"]))
        for b in spec["bindings"]}
    return RequestNode(
        request_id=rec.request_id, number=rec.number, name=spec["name"], segments=tuple(segments),
        bindings=bindings, inputs=tuple(dict.fromkeys(b.var_id for b in bindings.values() if not b.is_output)),
        outputs=tuple(b.var_id for b in bindings.values() if b.is_output), models=tuple(spec["models"]),
        times=RequestTimes(submitted=spec["submitted"]), status=RequestStatus(rec.status), error=_error(rec.error),
        origin=spec.get("origin"))


def _settle(req: RequestNode, variables: dict[str, Variable]) -> None:
    """A request journaled as unfinished whose outputs are all done ended just before the crash (its final status
    did not reach the journal): give it the status its outputs imply instead of running it again."""
    if req.status is not RequestStatus.WAITING:
        return
    outs = [variables[v] for v in req.outputs]
    failed = next((v for v in outs if v.status is VarStatus.FAILED), None)
    if failed is not None:
        req.status, req.error = RequestStatus.FAILED, failed.error
    elif outs and all(v.status is VarStatus.READY for v in outs):
        req.status = RequestStatus.FINISHED


def rebuild_session(manager: Manager, rec: SessionRecord) -> tuple[SessionState, list[RequestNode]]:
    """The session with its graph, adopted by the manager's store; returns it with its unfinished requests."""
    variables = {v.var_id: rebuild_variable(v) for v in rec.variables}
    requests = [rebuild_request(r) for r in rec.requests]
    for req in requests:
        for vid in (*req.inputs, *req.outputs):
            if vid not in variables:
                raise JournalError(f"journal: request {req.request_id} of session {rec.session_id} names variable "
                                   f"{vid!r}, which the journal does not hold")
        for vid in req.outputs:
            variables[vid].producer = req.request_id
        for vid in req.inputs:
            variables[vid].consumers.append(req.request_id)
        _settle(req, variables)
    graph = manager.sessions.new_graph(rec.session_id)
    graph.load(variables.values(), requests)
    session = SessionState(session_id=rec.session_id, token=None, token_digest=rec.token_sha256, ttl_s=rec.ttl_s,
                           graph=graph, last_access=manager.clock(), created_at=rec.created_at, owner=rec.owner)
    manager.sessions.adopt(session)
    return session, [r for r in requests if r.status is RequestStatus.WAITING]


def restore_sessions(manager: Manager) -> int:
    """Rebuild every journaled session into ``manager`` and resubmit their unfinished requests (they start as soon
    as an engine takes them). Returns how many sessions were restored. Raises JournalError for a journal whose
    rows contradict each other."""
    records = manager.sessions.journal.load()
    work: list[tuple[SessionState, RequestNode, dict[str, str]]] = []
    for rec in records:
        raws = {v.var_id: v.raw for v in rec.variables}
        session, unfinished = rebuild_session(manager, rec)
        graph = session.graph
        for req in graph.requests.values():  # request depths, in submit order
            manager.deduction.submitted(graph, req)
        for var in graph.variables.values():
            if var.perf is not None:
                manager.deduction.annotate(graph, var.var_id, var.perf.criteria)
        for req in unfinished:
            generated = {v: raws[v] if raws[v] is not None else graph.variables[v].value or ""
                         for v in req.outputs if graph.variables[v].status is VarStatus.READY}
            work.append((session, req, generated))
        manager.flows.restore(session, rec.flows)
    if records:
        logger.info("restored %d session(s) from the journal; %d unfinished request(s) run again", len(records),
                    len(work))
    if work:
        _resubmit_when_an_engine_lives(manager, work)
    return len(records)


def _resubmit_when_an_engine_lives(manager: Manager, work: list[tuple[SessionState, RequestNode, dict[str, str]]]
                                   ) -> None:
    """Hand the unfinished requests to the executor now if an engine is live, else when the first one comes alive
    (a registry listener) or after ``restore_wait_s``, whichever is first. Needs the running event loop."""
    registry = manager.registry
    submitted = False

    def submit(entry=None) -> None:
        nonlocal submitted
        if submitted or (entry is not None and not entry.healthy):
            return
        submitted = True
        timer.cancel()
        for session, req, generated in work:
            if not session.closed:  # deleted or expired while it waited
                manager.executor.submitted(session, req, generated=generated)
        manager.dispatcher.kick()

    timer = asyncio.get_running_loop().call_later(manager.config.restore_wait_s, submit)
    if any(e.healthy for e in registry.entries()):
        submit()
        return
    logger.info("no live engine yet: %d restored request(s) wait up to %.0f s for one to register", len(work),
                manager.config.restore_wait_s)
    registry.add_listener(submit)
