"""The Parrot manager facade: sessions, variables, submit/get, DAG dumps, and its background tasks.

One instance per server, created in the app lifespan (no module globals). The HTTP layer authenticates a
session once (:meth:`Manager.session`) and passes the :class:`Session` to the other calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from parrot.common.errors import EngineUnavailable, InvalidRequestError, StepFailed
from parrot.manager.dispatcher import Dispatcher, Policy
from parrot.manager.engine_registry import EngineRegistry
from parrot.manager.executor import GraphExecutor
from parrot.manager.graph import RequestNode, Variable, VarStatus
from parrot.manager.perf import PerfCriteria
from parrot.manager.perf_deduction import PerfDeduction, PerfTargets
from parrot.manager.policies import POLICY_NAMES, CapacityConfig, make_policy
from parrot.manager.prefix_sharing import PrefixSharing, PrefixStats, SharingConfig
from parrot.manager.prefix_store import PrefixStore
from parrot.manager.session import Session, SessionStore
from parrot.manager.submit import SubmitSpec, build_bindings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ManagerConfig:
    session_ttl_s: float = 600.0
    max_session_ttl_s: float = 86_400.0
    max_sessions: int = 10_000
    max_nodes_per_session: int = 10_000
    cleanup_interval_s: float = 5.0
    heartbeat_interval_s: float = 2.0  # 0 disables periodic engine status refresh
    max_long_poll_s: float = 60.0
    # prefix sharing (paper §5.3): fill a shared prompt prefix once into a prefix context and fork sharers
    prefix_sharing: bool = True
    prefix_min_tokens: int = 16  # shortest prefix worth a context (one KV block by default)
    prefix_grace_s: float = 30.0  # an idle prefix context is freed this long after its last child finished
    max_prefix_contexts_per_engine: int = 16
    # global scheduling (paper §5.4) and failover
    policy: str = "least-loaded"  # one of parrot.manager.policies.POLICY_NAMES (parrot = app-centric, Alg. 1)
    latency_cap_tokens: int = 2048  # running tokens an engine may hold while latency-sensitive work runs on it
    throughput_cap_tokens: int = 65536  # ... while only throughput work runs (also bounded by its KV capacity)
    heartbeat_timeout_s: float = 10.0  # an engine without a successful heartbeat for this long is dead
    max_attempts: int = 3  # runs of a request in all when its engine dies under it (restarts on another)

    def __post_init__(self) -> None:
        for name in ("session_ttl_s", "max_session_ttl_s", "cleanup_interval_s", "max_long_poll_s",
                     "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        self.capacity_config()  # validates the caps
        for name in ("heartbeat_interval_s", "prefix_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_sessions", "max_nodes_per_session", "prefix_min_tokens", "max_prefix_contexts_per_engine"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    def capacity_config(self) -> CapacityConfig:
        return CapacityConfig(latency_cap_tokens=self.latency_cap_tokens,
                              throughput_cap_tokens=self.throughput_cap_tokens)

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
                 config: ManagerConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config or ManagerConfig()
        self.registry = registry
        self.clock = clock
        self.prefix_store = PrefixStore()
        self.deduction = PerfDeduction(clock=clock)
        self.dispatcher = Dispatcher(registry, policy or make_policy(self.config.policy, self.config.capacity_config()),
                                     prefix_lookup=self.prefix_store.engine_prefix_tokens,
                                     info_lookup=self.deduction.info, clock=clock)
        self.sharing = PrefixSharing(self.prefix_store, registry, self.config.sharing_config(), clock=clock)
        self.sessions = SessionStore(default_ttl_s=self.config.session_ttl_s,
                                     max_ttl_s=self.config.max_session_ttl_s, max_sessions=self.config.max_sessions,
                                     max_nodes_per_session=self.config.max_nodes_per_session, clock=clock)
        self.executor = GraphExecutor(self.dispatcher, self.prefix_store, sharing=self.sharing,
                                      on_activity=self.sessions.touch, clock=clock,
                                      max_attempts=self.config.max_attempts)
        self._background: list[asyncio.Task] = []

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe the engines and start the cleanup (and heartbeat) tasks."""
        await self.registry.refresh()
        self._background.append(asyncio.create_task(self._cleanup_loop(), name="parrot-session-cleanup"))
        if self.config.heartbeat_interval_s > 0:
            self._background.append(asyncio.create_task(
                self.registry.heartbeat_loop(self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s),
                name="parrot-heartbeat"))

    async def stop(self) -> None:
        """Cancel background tasks and close every session (freeing engine contexts)."""
        for t in self._background:
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        for session in self.sessions.all():
            self.sessions.pop(session.session_id)
            await self._close(session)
        await self.sharing.close()
        await self.dispatcher.close()

    async def _close(self, session: Session) -> None:
        await self.executor.close_session(session)
        self.deduction.forget(session.session_id)

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.cleanup_interval_s)
            try:
                await self.expire_sessions()
                await self.sharing.collect()
            except Exception:  # keep the loop alive; a bug here must not stop future cleanups
                logger.exception("session cleanup failed")

    async def expire_sessions(self) -> int:
        """Close every expired session now; returns how many were closed."""
        expired = self.sessions.pop_expired()
        for session in expired:
            logger.info("session %s expired (idle > %.0f s)", session.session_id, session.ttl_s)
            await self._close(session)
        return len(expired)

    # ---- sessions -------------------------------------------------------------------------------------------
    def create_session(self, ttl_s: float | None = None) -> Session:
        return self.sessions.create(ttl_s)

    def session(self, session_id: str, token: str | None) -> Session:
        """Authenticate; raises UnknownSession (404) or InvalidSessionToken (401)."""
        return self.sessions.authenticate(session_id, token)

    async def delete_session(self, session: Session) -> None:
        self.sessions.pop(session.session_id)
        await self._close(session)

    # ---- variables ------------------------------------------------------------------------------------------
    def create_variable(self, session: Session, name: str | None = None, value: str | None = None) -> Variable:
        return session.graph.add_variable(name, value)

    def set_variable(self, session: Session, var_id: str, value: str) -> Variable:
        return self.executor.set_value(session, var_id, value)

    async def get_variable(self, session: Session, var_id: str, *, criteria: str | PerfCriteria | None = None,
                           timeout_s: float = 0.0, targets: PerfTargets | None = None) -> VariableView:
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
            self.dispatcher.kick()  # queued requests of this app may be placed differently now
        timeout_s = min(timeout_s, self.config.max_long_poll_s)
        if not var.done and timeout_s > 0:
            try:
                await asyncio.wait_for(var.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
            self.sessions.touch(session)
        if var.status is VarStatus.FAILED:
            assert var.error is not None
            # a fresh exception per get (the stored one is shared by every waiter)
            raise StepFailed(var.error.message, cause_code=var.error.cause_code, param="var_id")
        return VariableView(var.var_id, var.name, var.status, var.value)

    # ---- requests -------------------------------------------------------------------------------------------
    def submit(self, session: Session, spec: SubmitSpec) -> RequestNode:
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

    def prefix_stats(self) -> PrefixStats:
        """Prefix-sharing counters (contexts created/freed, forks, tokens shared and saved)."""
        return self.sharing.stats()

    def stats(self) -> dict:
        """Manager-wide counters for ``GET /api/v1/stats``."""
        return {"sessions": len(self.sessions), "prefix_sharing": self.sharing.stats().to_dict(),
                "scheduler": self.dispatcher.stats(),
                "failover": {"rescheduled": self.executor.num_rescheduled, "engine_deaths": self.registry.num_deaths}}

    def dag(self, session: Session) -> DagDump:
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
