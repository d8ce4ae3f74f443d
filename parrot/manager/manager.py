"""The Parrot manager facade: sessions, variables, submit/get, DAG dumps, and its background tasks.

One instance per server, created in the app lifespan (no module globals). The HTTP layer authenticates a
session once (:meth:`Manager.session`) and passes the :class:`SessionState` to the other calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from parrot.common.errors import EngineUnavailable, InvalidRequestError, StepFailed
from parrot.common.perf import PerfCriteria, PinnedTargets
from parrot.common.template import Segment
from parrot.manager.dispatcher import Dispatcher, Policy
from parrot.manager.engine_registry import EngineRegistry
from parrot.manager.executor import GraphExecutor
from parrot.manager.flows.profile import FlowStats
from parrot.manager.flows.service import FlowService, FlowSettings, SubmittedFlow
from parrot.manager.graph import (
    Lookahead,
    PlaceholderBinding,
    RequestNode,
    RequestStatus,
    ToolDecl,
    Variable,
    VarStatus,
)
from parrot.manager.journal import Journal, open_journal
from parrot.manager.metrics import CancelReason, ManagerMetrics
from parrot.manager.perf_deduction import PerfDeduction
from parrot.manager.policies import POLICY_NAMES, CapacityConfig, make_policy
from parrot.manager.prefix_sharing import PrefixSharing, PrefixStats, SharingConfig
from parrot.manager.prefix_store import PrefixStore
from parrot.manager.recent import RecentRequests
from parrot.manager.restore import restore_sessions
from parrot.manager.session import SessionState, SessionStore
from parrot.manager.state_budget import StateBudget
from parrot.manager.submit import SubmitSpec, build_bindings
from parrot.manager.tool_predict import Predictors

logger = logging.getLogger(__name__)


class ManagerConfig(BaseModel):
    """The manager's settings: defaults, constraints and descriptions, defined once. The HTTP
    server's ``ServerSettings`` (in the API layer) extends this (env ``PARROT_<FIELD>``, CLI ``--<field>``).
    Invalid values raise a ValidationError (a ValueError) naming the field; unknown keywords are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_ttl_s: float = Field(600.0, gt=0, description="default idle time before a session expires")
    max_session_ttl_s: float = Field(86_400.0, gt=0, description="longest idle time a session may ask for")
    session_cleanup_interval_s: float = Field(5.0, gt=0, description="how often expired sessions are closed")
    max_sessions: int = Field(10_000, ge=1, description="open sessions at most")
    max_nodes_per_session: int = Field(10_000, ge=1, description="variables + requests per session")
    max_session_bytes: int = Field(64 * 2**20, ge=1024, description="bytes of values and prompts one session may "
                                   "hold (parrot.manager.state_budget); past it a set / submit is a 400")
    max_state_bytes: int = Field(2 * 2**30, ge=1024, description="bytes of values and prompts all sessions may hold "
                                 "together: bounds the manager's memory")
    max_long_poll_s: float = Field(60.0, gt=0, description="longest wait of one GET of a variable")
    engine_heartbeat_s: float = Field(2.0, ge=0, description="engine status refresh period (0 = off)")
    # prefix sharing (paper §5.3): fill a shared prompt prefix once into a prefix context and fork sharers
    prefix_sharing: bool = Field(True, description="fill prompt prefixes shared by requests once, fork the rest")
    prefix_min_tokens: int = Field(16, ge=1, description="shortest prefix worth a shared prefix context")
    prefix_grace_s: float = Field(30.0, ge=0, description="idle time before an unused prefix context is freed")
    max_prefix_contexts_per_engine: int = Field(16, ge=1, description="LRU bound on prefix contexts per engine")
    # global scheduling (paper §5.4) and failover
    policy: Literal[POLICY_NAMES] = Field(  # type: ignore[valid-type]  # the names of the policy table
        "least-loaded", description="global scheduler: parrot (app-centric, paper Alg. 1), fifo-latency / "
        "fifo-throughput (request-centric baselines), least-loaded (no caps, no queueing: the default), e2 (Preble's "
        "prefix-aware E2 by token ids), round-robin (data-parallel baseline)")
    latency_cap_tokens: int = Field(2048, ge=1, description="running tokens per engine while latency work runs there")
    throughput_cap_tokens: int = Field(65536, ge=1, description="running tokens per engine for throughput work "
                                       "(also bounded by its KV capacity)")
    share_slack: float = Field(0.10, gt=0, le=10, description="policy parrot: the share by which latency work's "
                               "step may grow while throughput work rides in it (the engine keeps the step within it)")
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="an engine silent this long is declared dead")
    max_attempts: int = Field(3, ge=1, description="runs of a request in all when its engine dies under it")
    state_dir: str | None = Field(None, description="journal sessions, their DAGs and values here (SQLite, WAL); "
                                  "on start, continue the sessions found there (parrot.manager.restore)")
    restore_wait_s: float = Field(60.0, ge=0, description="after a restart with no live engine, how long restored "
                                  "requests wait for one to register before they fail")
    # flows: branches and loops run server-side (docs/flows.md)
    flow_speculation: bool = Field(True, description="start a branch's likely case before its condition is ready")
    flow_speculation_min_prob: float = Field(0.75, gt=0, le=1, description="speculate on a case taken in at least "
                                             "this share of the branch's recent runs")
    flow_speculation_min_runs: int = Field(5, ge=1, description="recent runs a branch needs before speculation")
    flow_max_steps: int = Field(64, ge=1, le=10_000, description="largest max_steps a flow loop may declare")
    flow_tool_timeout_s: float = Field(300.0, gt=0, description="a client tool call not answered within this fails "
                                       "(cause tool_timeout)")

    @model_validator(mode="after")
    def _check_caps(self) -> ManagerConfig:
        self.capacity_config()  # ValueError if latency_cap_tokens > throughput_cap_tokens
        return self

    def capacity_config(self) -> CapacityConfig:
        return CapacityConfig(latency_cap_tokens=self.latency_cap_tokens,
                              throughput_cap_tokens=self.throughput_cap_tokens, share_slack=self.share_slack)

    def flow_settings(self) -> FlowSettings:
        return FlowSettings(speculation=self.flow_speculation, speculation_min_prob=self.flow_speculation_min_prob,
                            speculation_min_runs=self.flow_speculation_min_runs, max_steps=self.flow_max_steps,
                            tool_timeout_s=self.flow_tool_timeout_s)

    def sharing_config(self) -> SharingConfig:
        return SharingConfig(enabled=self.prefix_sharing, min_tokens=self.prefix_min_tokens,
                             grace_s=self.prefix_grace_s, max_per_engine=self.max_prefix_contexts_per_engine)


@dataclass(frozen=True)
class VariableView:
    """What a GET answers (a snapshot; never the live node)."""

    var_id: str
    name: str | None
    status: VarStatus
    value: str | None


@dataclass(frozen=True)
class DagDump:
    text: str
    requests: list[dict]
    variables: list[dict]


class Manager:
    """``clock`` is the one clock of every timestamp the manager keeps: session TTLs, app and queue order,
    latency deadlines, DAG milestones, prefix-context grace periods. It is handed to each component at
    construction. Wall-clock seconds (``time.time``) in a server, where deadlines and DAG timestamps are
    absolute; the simulator passes its virtual clock, so every one of them is simulated time."""

    def __init__(self, registry: EngineRegistry, *, policy: Policy | None = None,
                 config: ManagerConfig | None = None, clock: Callable[[], float] = time.time,
                 journal: Journal | None = None) -> None:
        """``journal``: where sessions are made durable; None opens the one of ``config.state_dir`` (none: a
        NullJournal). Raises JournalError for a state dir that cannot be used."""
        self.config = config or ManagerConfig()
        self.journal = journal if journal is not None else open_journal(self.config.state_dir)
        self.registry = registry
        self.clock = clock
        self.prefix_store = PrefixStore()
        self.deduction = PerfDeduction(clock=clock)
        self.metrics = ManagerMetrics()  # this manager's Prometheus registry (GET /metrics); watch() below
        self.predictors = Predictors()  # output lengths and tool durations (LAMPS), shared with the OpenAI path
        self.dispatcher = Dispatcher(registry, policy or make_policy(self.config.policy, self.config.capacity_config()),
                                     prefix_lookup=self._prefix_tokens,
                                     info_lookup=self.deduction.info, clock=clock, on_placed=self.metrics.placed)
        self.sharing = PrefixSharing(self.prefix_store, registry, self.config.sharing_config(), clock=clock)
        self.sessions = SessionStore(default_ttl_s=self.config.session_ttl_s,
                                     max_ttl_s=self.config.max_session_ttl_s, max_sessions=self.config.max_sessions,
                                     max_nodes_per_session=self.config.max_nodes_per_session, clock=clock,
                                     journal=self.journal, budget=StateBudget(self.config.max_session_bytes,
                                                                              self.config.max_state_bytes))
        self.recent = RecentRequests(clock=clock)  # finished requests with timings, for the web view (/ui)
        self.executor = GraphExecutor(self.dispatcher, self.prefix_store, sharing=self.sharing,
                                      on_activity=self.sessions.touch, clock=clock, recent=self.recent,
                                      max_attempts=self.config.max_attempts, metrics=self.metrics,
                                      predictors=self.predictors)
        self.flows = FlowService(self.executor, self._add_flow_request, clock=clock,
                                 settings=self.config.flow_settings(), journal=self.journal,
                                 stats=FlowStats(on_speculation=self.metrics.flow_speculation,
                                                 on_iteration=self.metrics.flow_iteration))
        self.metrics.watch(self)
        self._background: list[asyncio.Task] = []

    def _prefix_tokens(self, engine: str, prefix_hashes: Sequence[str]) -> int:
        """The dispatcher's prefix affinity: live contexts and prefix contexts (PrefixStore) and contexts paused
        for a tool call (their follow-up should run where their KV is)."""
        return max(self.prefix_store.engine_prefix_tokens(engine, prefix_hashes),
                   self.executor.tools.prefix_tokens(engine, prefix_hashes))

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe the engines and start the cleanup (and heartbeat) tasks."""
        await self.registry.refresh()
        restore_sessions(self)  # sessions of a previous run in the journal continue (none without --state-dir)
        self._background.append(asyncio.create_task(self._cleanup_loop(), name="parrot-session-cleanup"))
        if self.config.engine_heartbeat_s > 0:
            self._background.append(asyncio.create_task(
                self.registry.heartbeat_loop(self.config.engine_heartbeat_s, self.config.heartbeat_timeout_s),
                name="parrot-heartbeat"))

    async def stop(self) -> None:
        """Cancel background tasks and close every session (freeing engine contexts). The journal is closed first:
        closing a session fails its pending variables in memory only; in the journal they stay pending and resume
        at the next start."""
        self.journal.close()
        for t in self._background:
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        sessions = self.sessions.all()
        for session in sessions:
            self.sessions.pop(session.session_id)
        # all at once: closing one by one waited for each session's engine frees in turn (slow exits under backlog)
        await asyncio.gather(*(self._close(s, CancelReason.SHUTDOWN) for s in sessions), return_exceptions=True)
        await self.sharing.close()
        await self.dispatcher.close()

    async def _close(self, session: SessionState, reason: CancelReason) -> None:
        await self.flows.close_session(session)  # first: its steps must not make nodes while the session closes
        await self.executor.close_session(session, reason)
        self.deduction.forget(session.session_id)

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.session_cleanup_interval_s)
            try:
                await self.expire_sessions()
                await self.sharing.collect()
            except Exception:  # keep the loop alive; a bug here must not stop future cleanups
                logger.exception("session cleanup failed")

    async def expire_sessions(self) -> int:
        """Close every expired session now; returns how many were closed."""
        expired = self.sessions.pop_expired()
        for session in expired:
            self.journal.session_deleted(session.session_id)
            logger.info("session %s expired (idle > %.0f s)", session.session_id, session.ttl_s)
            await self._close(session, CancelReason.SESSION_EXPIRED)
        return len(expired)

    # ---- sessions -------------------------------------------------------------------------------------------
    def create_session(self, ttl_s: float | None = None, *, owner: str = "anonymous",
                       owner_limit: int | None = None) -> SessionState:
        return self.sessions.create(ttl_s, owner=owner, owner_limit=owner_limit)

    def session(self, session_id: str, token: str | None, owner: str = "anonymous") -> SessionState:
        """Authenticate; raises UnknownSession (404: unknown, or another tenant's) or InvalidSessionToken (401)."""
        return self.sessions.authenticate(session_id, token, owner)

    async def delete_session(self, session: SessionState) -> None:
        self.sessions.pop(session.session_id)
        self.journal.session_deleted(session.session_id)
        await self._close(session, CancelReason.SESSION_DELETED)

    # ---- variables ------------------------------------------------------------------------------------------
    def create_variable(self, session: SessionState, name: str | None = None, value: str | None = None, *,
                        tool: ToolDecl | None = None) -> Variable:
        """A free variable; ``tool``: the client will set it from that tool call on ``tool.inputs`` (the generates
        producing those inputs then pause their contexts for it: parrot.manager.executor)."""
        return session.graph.add_variable(name, value, tool=tool)

    def set_variable(self, session: SessionState, var_id: str, value: str) -> Variable:
        var = self.executor.set_value(session, var_id, value)
        self.flows.answered(session, var_id)  # a client tool call's answer
        return var

    async def get_variable(self, session: SessionState, var_id: str, *, criteria: str | PerfCriteria | None = None,
                           timeout_s: float = 0.0, targets: PinnedTargets | None = None) -> VariableView:
        """The variable's value, waiting up to ``timeout_s`` (capped) for it. Records ``criteria`` first
        (GetPerfObj), even if the value stays pending, and re-deduces the request labels (§5.2); latency
        ``targets`` (TTFT / TPOT / deadline) imply the LATENCY criterion. Raises the StepFailed of a failed
        producer (424)."""
        if timeout_s < 0:
            raise InvalidRequestError(f"timeout must be >= 0, got {timeout_s}", param="timeout")
        graph = session.graph
        var = graph.variable(var_id)
        perf = PerfCriteria.parse(criteria)
        if perf is None and targets is not None and not targets.empty:
            perf = PerfCriteria.LATENCY
        if perf is not None and self.deduction.annotate(graph, var_id, perf, targets):
            self.dispatcher.kick()
        if perf is not None and var.origin is not None and self._flow_criteria(session, var, perf):
            self.dispatcher.kick()  # queued requests of this app may be placed differently now
        timeout_s = min(timeout_s, self.config.max_long_poll_s)
        if not var.done and timeout_s > 0:
            session.waiting_gets += 1
            try:
                await asyncio.wait_for(var.wait(), timeout_s)
            except TimeoutError:
                pass
            finally:  # also when the client went away mid-wait: its producer keeps running for the session
                session.waiting_gets -= 1
                self.sessions.touch(session)
        if var.status is VarStatus.FAILED:
            assert var.error is not None
            # a fresh exception per get (the stored one is shared by every waiter)
            raise StepFailed(var.error.message, cause_code=var.error.cause_code, param="var_id")
        return VariableView(var.var_id, var.name, var.status, var.value)

    # ---- requests -------------------------------------------------------------------------------------------
    def submit(self, session: SessionState, spec: SubmitSpec) -> RequestNode:
        """Validate and insert a request; it starts as soon as its inputs are materialized."""
        segments, bindings = build_bindings(spec)
        if spec.models:
            try:
                self.registry.candidates(tuple(spec.models))  # 404 now for a model nobody serves
            except EngineUnavailable:
                pass  # served but unhealthy right now: the request may still run after a heartbeat
        req = session.graph.add_request(spec.name, segments, bindings, tuple(spec.models))
        relabeled = self.deduction.submitted(session.graph, req)  # labeled on arrival if it feeds a criterion
        self.executor.submitted(session, req)
        if relabeled:
            self.dispatcher.kick()
        return req

    def _add_flow_request(self, session: SessionState, name: str | None, segments: Sequence[Segment],
                          bindings: Sequence[PlaceholderBinding], models: Sequence[str], origin: str,
                          lookahead: Lookahead | None = None) -> RequestNode:
        """A flow's generate step: inserted and started like a submit (deduction, dispatcher), with its origin and
        what the flow expects after it (sent to the engine with its generate: DagTools.hint)."""
        req = session.graph.add_request(name, segments, bindings, tuple(models), origin=origin)
        req.lookahead = lookahead
        run = session.flows.get(origin.split("/", 1)[0])
        relabeled = self.deduction.submitted(session.graph, req)
        if run is not None and run.criteria is not None:  # a GET of the flow's outputs asked for this
            relabeled = self.deduction.annotate(session.graph, req.outputs[0], run.criteria) or relabeled
        self.executor.submitted(session, req)
        if relabeled:
            self.dispatcher.kick()
        return req

    def _flow_criteria(self, session: SessionState, var: Variable, perf: PerfCriteria) -> bool:
        """A GET of a flow's export with a criterion: the flow's steps are what produces it, but they reach the
        export through the flow (not DAG edges), so each unfinished one is annotated here, and the ones the flow
        makes later when they are made (``_add_flow_request``). Returns True if labels changed."""
        if var.origin is None or "/" in var.origin:
            return False  # not an export (an inner step's value: its DAG edges already carry the criterion)
        run = session.flows.get(var.origin.split(":", 1)[0])
        if run is None or run.criteria is perf:
            return False
        run.criteria = perf
        changed = False
        for req in session.graph.requests.values():
            if req.origin is not None and req.origin.startswith(run.flow_id + "/") and req.outputs and \
                    req.status not in (RequestStatus.FINISHED, RequestStatus.FAILED):
                changed = self.deduction.annotate(session.graph, req.outputs[0], perf) or changed
        return changed

    def submit_flow(self, session: SessionState, body: dict) -> SubmittedFlow:
        """Check and start a flow (docs/flows.md): branches and loops the manager runs itself."""
        return self.flows.submit(session, body)

    def flow_status(self, session: SessionState, flow_id: str) -> dict:
        return self.flows.status(session, flow_id)

    def prefix_stats(self) -> PrefixStats:
        """Prefix-sharing counters (contexts created/freed, forks, tokens shared and saved)."""
        return self.sharing.stats()

    def stats(self) -> dict:
        """Manager-wide counters for ``GET /api/v1/stats``."""
        engine_pauses = [e.status.extra.get("tool_pauses") for e in self.registry.entries() if e.status is not None]
        return {"sessions": len(self.sessions), "prefix_sharing": self.sharing.stats().to_dict(),
                "scheduler": self.dispatcher.stats(),
                "failover": {"rescheduled": self.executor.num_rescheduled, "engine_deaths": self.registry.num_deaths},
                "tools": self.predictors.stats(p for p in engine_pauses if isinstance(p, dict)),
                "flows": {**self.flows.stats.to_dict(), "branch_frequencies": self.flows.profile.frequencies()}}

    def dag(self, session: SessionState) -> DagDump:
        """The session's DAG; requests carry their deduced ``sched`` labels, and the text ends with one
        ``# r_3: latency, group g0`` line per labeled request."""
        graph = session.graph
        data = graph.to_json()
        labels = self.deduction.labels(session.session_id)
        lines = [graph.dump_text()]
        for r in data["requests"]:
            label = labels.get(r["request_id"])
            r["sched"] = None if label is None else {
                "criteria": label.criteria.value, "task_group": label.task_group,
                "targets": {k: v for k, v in vars(label.targets).items() if v is not None}}
            if label is not None:
                notes = [label.criteria.value] + ([f"group {label.task_group}"] if label.task_group else [])
                lines.append(f"# {r['request_id']}: {', '.join(notes)}")
        return DagDump(text="\n".join(lines), requests=data["requests"], variables=data["variables"])
