"""The manager's flow service: submit, status, client tool calls, session close, journal and restart.

One per manager. It owns what is shared by the flows of all sessions (the branch profile, the counters, the
per-session tool-call queues); each session's :class:`~parrot.manager.flows.runner.FlowRun` s live in
``SessionState.flows``. With a journal, a flow's declaration is written when it is submitted and its end when it
ends; at start the unfinished ones are re-run over the restored graph (:meth:`FlowService.restore`), meeting
their nodes by origin (see parrot.manager.flows.runner).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parrot.common.errors import (
    InvalidRequestError,
    StepFailed,
    UnknownFlow,
    UnknownToolCall,
    UnknownVariable,
)
from parrot.manager.flows.profile import BranchProfile, FlowStats
from parrot.manager.flows.runner import FlowEnv, FlowEvent, FlowRun, FlowStatus
from parrot.manager.flows.spec import parse_flow
from parrot.manager.flows.tool_calls import ToolCallQueue
from parrot.manager.graph import RequestNode
from parrot.manager.journal import FlowRecord, Journal
from parrot.manager.session import SessionState

if TYPE_CHECKING:
    from parrot.manager.executor import GraphExecutor

logger = logging.getLogger(__name__)

MAX_POLL_S = 60.0


@dataclass(frozen=True)
class FlowSettings:
    speculation: bool = True
    speculation_min_prob: float = 0.75
    speculation_min_runs: int = 5
    max_steps: int = 64
    tool_timeout_s: float = 300.0


@dataclass(frozen=True)
class SubmittedFlow:
    flow_id: str
    outputs: dict[str, str]  # exported name -> var id


class FlowService:
    def __init__(self, executor: GraphExecutor, add_request: Callable[..., RequestNode], *,
                 clock: Callable[[], float],
                 settings: FlowSettings, journal: Journal, stats: FlowStats | None = None) -> None:
        self.executor = executor
        self.add_request = add_request
        self.clock = clock
        self.settings = settings
        self.journal = journal
        self.profile = BranchProfile()
        self.stats = stats or FlowStats()
        self._queues: dict[str, ToolCallQueue] = {}

    def _env(self, session: SessionState) -> FlowEnv:
        s = self.settings
        return FlowEnv(executor=self.executor, add_request=self.add_request, clock=self.clock,
                       calls=self.queue(session), profile=self.profile, stats=self.stats,
                       speculation_min_prob=s.speculation_min_prob, speculation_min_runs=s.speculation_min_runs,
                       tool_timeout_s=s.tool_timeout_s, on_event=self._on_event)

    def _on_event(self, run: FlowRun, ev: FlowEvent) -> None:
        if ev.event in ("finished", "failed") and ev.path == run.flow_id:
            self.journal.flow_status(run.session.session_id, run.flow_id, run.status.value)

    def queue(self, session: SessionState) -> ToolCallQueue:
        return self._queues.setdefault(session.session_id, ToolCallQueue())

    # ---- API --------------------------------------------------------------------------------------------------
    def submit(self, session: SessionState, body: dict) -> SubmittedFlow:
        """Check and start a flow (docs/flows.md); InvalidRequestError / UnknownVariable name what is wrong."""
        spec = parse_flow(body, max_loop_steps=self.settings.max_steps)
        graph = session.graph
        for name, vid in spec.inputs.items():
            if vid not in graph.variables:
                raise UnknownVariable(f"flow input {name!r}: unknown variable {vid!r} in session "
                                      f"{session.session_id!r}", param=f"inputs.{name}")
        number = len(session.flows) + 1
        flow_id = f"f_{number}"
        outputs = {n: graph.add_variable(n, origin=f"{flow_id}:{n}").var_id for n in spec.outputs}
        speculate = self.settings.speculation if spec.speculate is None else spec.speculate
        run = FlowRun(flow_id, number, spec, body, session, self._env(session), outputs, speculate)
        session.flows[flow_id] = run
        self.journal.flow_added(session.session_id, FlowRecord(flow_id, number, body, outputs, "running"))
        self.stats.flow_started()
        run.start()
        logger.info("session %s: flow %s (%s) started, outputs %s", session.session_id, flow_id, spec.name, outputs)
        return SubmittedFlow(flow_id, outputs)

    def run(self, session: SessionState, flow_id: str) -> FlowRun:
        run = session.flows.get(flow_id)
        if run is None:
            raise UnknownFlow(f"unknown flow {flow_id!r} in session {session.session_id!r}", param="flow_id")
        return run

    def status(self, session: SessionState, flow_id: str) -> dict:
        run = self.run(session, flow_id)
        err = run.error
        return {"flow_id": run.flow_id, "name": run.spec.name, "status": run.status.value,
                "outputs": dict(run.outputs), "events": [e.to_json() for e in run.events],
                "error": None if err is None else {"code": err.code, "cause": err.cause_code, "message": err.message}}

    async def take_calls(self, session: SessionState, tools: Collection[str] | None, timeout_s: float) -> list[dict]:
        if timeout_s < 0:
            raise InvalidRequestError(f"timeout must be >= 0, got {timeout_s}", param="timeout")
        calls = await self.queue(session).take(tools, min(timeout_s, MAX_POLL_S))
        return [c.to_json() for c in calls]

    def answered(self, session: SessionState, var_id: str) -> None:
        """The client set ``var_id``: if it was a tool call, it is no longer listed."""
        q = self._queues.get(session.session_id)
        if q is not None:
            q.answered(var_id)

    def call_error(self, session: SessionState, call_id: str, message: str) -> None:
        """The client's worker reports that tool call ``call_id`` failed: its output fails (cause ``tool_failed``)
        or, for a step declared ``on_error: value``, becomes ``error: <message>``."""
        q = self._queues.get(session.session_id)
        call = q.find(call_id) if q is not None else None
        if call is None or q is None:
            raise UnknownToolCall(f"no open tool call {call_id!r} in session {session.session_id!r}",
                                  param="call_id")
        q.answered(call_id)
        if call.on_error == "value":
            self.executor.materialize_free(session, call_id, f"error: {message}")
        else:
            self.executor.fail_free_variable(session, call_id, StepFailed(
                f"client tool {call.tool!r} failed: {message}", cause_code="tool_failed"))

    async def close_session(self, session: SessionState) -> None:
        for run in list(session.flows.values()):
            await run.cancel()
        self._queues.pop(session.session_id, None)

    # ---- restart ----------------------------------------------------------------------------------------------
    def restore(self, session: SessionState, records: Collection[FlowRecord]) -> int:
        """Re-run the session's journaled flows over its restored graph; returns how many were still running."""
        resumed = 0
        for rec in sorted(records, key=lambda r: r.number):
            spec = parse_flow(rec.body, max_loop_steps=10**6)  # checked against the limit when submitted
            speculate = self.settings.speculation if spec.speculate is None else spec.speculate
            run = FlowRun(rec.flow_id, rec.number, spec, rec.body, session, self._env(session), dict(rec.outputs),
                          speculate, status=FlowStatus(rec.status))
            session.flows[rec.flow_id] = run
            if run.status is FlowStatus.RUNNING:
                run.start()
                resumed += 1
        return resumed
