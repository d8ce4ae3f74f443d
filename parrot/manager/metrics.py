"""Prometheus metrics of the manager (``GET /metrics`` of ``parrot serve``). No torch.

One :class:`ManagerMetrics` per manager, with a :class:`~prometheus_client.CollectorRegistry` of its own (never the
module-global default registry: several apps live in one test process). Two kinds of metrics:

* **observed** at a few points, the only writers: requests by API / status / policy and their latencies (the graph
  executor for Parrot requests, the completion service for OpenAI ones), placements by reason (the dispatcher),
  cancellations by reason (whoever cancels: the HTTP edge when a client goes away, the manager when a session is
  deleted, expires or the server stops -- :class:`CancelReason`);
* **read at scrape time** from the state the manager already keeps (:class:`_StateCollector`): sessions, the
  manager's queue, what is placed on each engine, engine liveness, each engine's last reported
  :class:`~parrot.protocol.interface.EngineStatus` (its queue, running tokens, KV blocks, prefix-cache hit rate,
  shared-prefix decode rows: :mod:`parrot.protocol.metrics`, the same names an engine's own ``/metrics`` has),
  prefix sharing and failover counters. Engine values are as fresh as the last heartbeat.

Latencies, per request (``api`` label ``parrot`` for a DAG request, ``completions`` / ``chat`` for one OpenAI
request; ``/v1/responses`` runs as ``chat``), in seconds of the manager's clock::

    ready ---manager queue---> engine ---prefill---> first token ---decode---> finished
      |<------------------------ TTFT ------------->|                          |
      |<----------------------------------------- end-to-end ------------------>|

``ready`` is when a DAG request's inputs were all materialized (not its submission: upstream steps are not its
latency) or when an OpenAI request was planned. TPOT is per generation: (its last token - its first) / (tokens - 1).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from parrot.common.errors import ParrotError, StepFailed
from parrot.protocol.interface import GenerateResult
from parrot.protocol.metrics import status_families
from parrot.manager.graph import RequestNode, RequestStatus
from parrot.manager.policies.base import ClusterView, QueuedRequest

if TYPE_CHECKING:
    from parrot.manager.manager import Manager

logger = logging.getLogger(__name__)

# latency buckets (s): a CPU engine's TTFT ranges from milliseconds (cached prefix) to minutes (a long backlog)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# why an engine got a request, the first that applies (see placement_reason)
PLACEMENT_REASONS = ("only_candidate", "task_group", "prefix", "app", "least_loaded", "other")
STATUSES = ("finished", "failed", "cancelled")


class CancelReason(enum.Enum):
    """Why work was cancelled before it ended (the ``reason`` label of ``parrot_cancelled_requests_total``)."""

    CLIENT_DISCONNECTED = "client_disconnected"  # an OpenAI-side client went away (streaming or not)
    SESSION_DELETED = "session_deleted"  # DELETE /sessions/{id}: its pending requests go with it
    SESSION_EXPIRED = "session_expired"  # idle past its TTL: nobody can read its values any more
    SHUTDOWN = "shutdown"  # the server stopped with the request still running


def placement_reason(q: QueuedRequest, engine: str, cluster: ClusterView) -> str:
    """Why ``q`` went to ``engine``, as the round's view before its placements shows it (the first that holds):
    ``only_candidate`` (no choice), ``task_group`` (a member of its task group runs there), ``prefix`` (the engine
    holds a prefix of its prompt), ``app`` (a request of its session runs there), ``least_loaded`` (fewest placed
    tokens among its candidates), ``other`` (the policy's own trade-off: caps, cost model, load balance)."""
    if len(q.candidates) <= 1:
        return "only_candidate"
    view = cluster.engines.get(engine)
    placed = view.placed if view is not None else ()
    session = q.request.session_id
    if q.info.task_group is not None and any(p.session_id == session and p.task_group == q.info.task_group
                                             for p in placed):
        return "task_group"
    if view is not None and cluster.prefix_tokens(engine, q.request) > 0:
        return "prefix"
    if session is not None and any(p.session_id == session for p in placed):
        return "app"
    loads = {e: cluster.engine_tokens(e) for e in q.candidates if e in cluster.engines}
    if engine in loads and loads[engine] <= min(loads.values()):
        return "least_loaded"
    return "other"


def outcome_of(error: BaseException | None) -> tuple[str, str | None]:
    """(status label, error code) of a request that ended with ``error`` (None: finished)."""
    if error is None:
        return "finished", None
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled", None
    if isinstance(error, ParrotError):
        return "failed", error.cause_code if isinstance(error, StepFailed) else error.code
    return "failed", "internal_error"


class ManagerMetrics:
    """The manager's metrics. Observation methods are cheap and never raise into the request path."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("parrot_requests", "requests that ended, by API, status (finished / failed / "
                                "cancelled) and scheduling policy", ["api", "status", "policy"], registry=r)
        self.ttft = Histogram("parrot_time_to_first_token_seconds", "from ready (inputs materialized / planned) to "
                              "the first generated token", ["api"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("parrot_time_per_output_token_seconds", "mean time between tokens of one generation "
                              "after its first", ["api"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("parrot_e2e_request_latency_seconds", "from ready to the request's end, finished "
                             "requests only", ["api"], buckets=E2E_BUCKETS, registry=r)
        self.placements = Counter("parrot_placements", "requests placed on an engine by the global scheduler, by "
                                  "policy and reason (parrot.manager.metrics.placement_reason)",
                                  ["policy", "reason"], registry=r)
        self.cancellations = Counter("parrot_cancelled_requests", "requests cancelled before they ended, by API "
                                     "and reason (parrot.manager.metrics.CancelReason); their engine work is "
                                     "stopped and their contexts freed", ["api", "reason"], registry=r)
        self.flow_speculations = Counter("parrot_flow_speculations", "flow branches whose likely case was started "
                                         "before the condition was ready, by outcome (hit / miss)", ["outcome"],
                                         registry=r)
        self.flow_wasted_tokens = Counter("parrot_flow_speculated_tokens_wasted", "tokens generated by speculated "
                                          "flow steps whose case was not taken", registry=r)
        self.flow_iterations = Counter("parrot_flow_iterations", "flow loop iterations run", registry=r)
        for outcome in ("hit", "miss"):
            self.flow_speculations.labels(outcome)
        for reason in CancelReason:
            for api in ("completions", "chat", "responses", "parrot"):
                self.cancellations.labels(api, reason.value)  # every series exists from the start (rate() works)
        self._manager: Manager | None = None

    def watch(self, manager: "Manager") -> None:
        """Read ``manager``'s state at each scrape (once, by the manager that owns these metrics)."""
        if self._manager is not None:
            raise ValueError("these metrics already watch a manager")
        self._manager = manager
        self.registry.register(_StateCollector(manager))

    @property
    def policy(self) -> str:
        return self._manager.dispatcher.policy.name if self._manager is not None else "none"

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    # ---- observation points ---------------------------------------------------------------------------------
    def placed(self, policy: str, q: QueuedRequest, engine: str, cluster: ClusterView) -> None:
        """The dispatcher placed ``q`` on ``engine`` (called during the round, before the view is updated)."""
        try:
            reason = placement_reason(q, engine, cluster)
        except Exception:  # a metrics bug must never fail a scheduling round
            logger.exception("placement reason failed")
            reason = "other"
        self.placements.labels(policy, reason).inc()

    def flow_speculation(self, hit: bool, wasted_tokens: int) -> None:
        self.flow_speculations.labels("hit" if hit else "miss").inc()
        self.flow_wasted_tokens.inc(wasted_tokens)

    def flow_iteration(self) -> None:
        self.flow_iterations.inc()

    def cancelled(self, api: str, reason: CancelReason, count: int = 1) -> None:
        """``count`` requests of ``api`` were cancelled for ``reason`` (their own status counts them as well)."""
        if count > 0:
            self.cancellations.labels(api, reason.value).inc(count)
            logger.info("cancelled %d %s request(s): %s", count, api, reason.value)

    def generated(self, api: str, result: GenerateResult) -> None:
        """One whole generation: its TPOT from the engine's own timing (time after the first token / the rest)."""
        n = len(result.token_ids)
        if n > 1 and result.latency_s >= result.ttft_s:
            self.tpot.labels(api).observe((result.latency_s - result.ttft_s) / (n - 1))

    def stream_tpot(self, api: str, first_s: float, last_s: float, tokens: int) -> None:
        """One streamed generation: ``tokens`` arrived between ``first_s`` and ``last_s`` (any clock)."""
        if tokens > 1 and last_s >= first_s:
            self.tpot.labels(api).observe((last_s - first_s) / (tokens - 1))

    def request_done(self, api: str, error: BaseException | None, *, ready: float, first_token: float | None,
                     finished: float) -> None:
        """A request ended (``error`` None = finished); times on one clock."""
        status, code = outcome_of(error)
        self.requests.labels(api, status, self.policy).inc()
        if first_token is not None and first_token >= ready:
            self.ttft.labels(api).observe(first_token - ready)
        if status == "finished":
            self.e2e.labels(api).observe(max(0.0, finished - ready))
        logger.debug("request done: api=%s status=%s%s ttft=%s e2e=%.3f s", api, status,
                     f" code={code}" if code else "",
                     "-" if first_token is None else f"{first_token - ready:.3f} s", finished - ready)

    def timer(self, api: str) -> "RequestTimer":
        """Time one OpenAI-side request from now (ready = planned) until :meth:`RequestTimer.done`."""
        return RequestTimer(self, api)

    def dag_request_done(self, req: RequestNode, ready: float, now: float) -> None:
        """A DAG request's task ended (FINISHED, FAILED, or cancelled with any other status)."""
        if req.status is RequestStatus.FINISHED:
            error: BaseException | None = None
        elif req.status is RequestStatus.FAILED:
            error = req.error or StepFailed("failed", cause_code="internal_error")
        else:
            error = asyncio.CancelledError()
        self.request_done("parrot", error, ready=ready, first_token=req.times.first_token,
                          finished=req.times.finished if req.times.finished is not None else now)


class RequestTimer:
    """The latencies of one OpenAI-side request (all its prompts and choices), on the monotonic clock: the first
    token of any choice is its first token; each choice's generation gives one TPOT."""

    def __init__(self, metrics: ManagerMetrics, api: str) -> None:
        self._metrics = metrics
        self.api = api
        self.ready = time.monotonic()
        self.first_token: float | None = None
        self._streams: dict[int, list] = {}  # choice index -> [first token time, last token time, tokens]

    def result(self, result: GenerateResult, called_at: float) -> None:
        """A whole generation whose call started at ``called_at`` (monotonic)."""
        if result.token_ids:
            first = called_at + result.ttft_s
            self.first_token = first if self.first_token is None else min(self.first_token, first)
        self._metrics.generated(self.api, result)

    def chunk(self, index: int, tokens: int, final: bool) -> None:
        """A streamed chunk of choice ``index`` with ``tokens`` tokens arrived now (``final``: the choice ended)."""
        now = time.monotonic()
        if tokens:
            if self.first_token is None:
                self.first_token = now
            state = self._streams.setdefault(index, [now, now, 0])
            state[1] = now
            state[2] += tokens
        if final and index in self._streams:
            first, last, n = self._streams.pop(index)
            self._metrics.stream_tpot(self.api, first, last, n)

    def done(self, error: BaseException | None) -> None:
        self._metrics.request_done(self.api, error, ready=self.ready, first_token=self.first_token,
                                   finished=time.monotonic())


class _StateCollector(Collector):
    """Gauges and counters read from the manager's state at scrape time (see the module docstring)."""

    def __init__(self, manager: "Manager") -> None:
        self._m = manager

    def describe(self) -> Iterable[Metric]:
        return []  # the families depend on the engines registered at scrape time

    def collect(self) -> Iterable[Metric]:
        m = self._m
        policy = m.dispatcher.policy.name
        stats = m.dispatcher.stats()
        g = GaugeMetricFamily("parrot_sessions", "open Parrot API sessions")
        g.add_metric([], len(m.sessions))
        yield g
        g = GaugeMetricFamily("parrot_queue_length", "requests waiting in the manager's queue for an engine",
                              labels=["policy"])
        g.add_metric([policy], stats["queued"])
        yield g
        placed = GaugeMetricFamily("parrot_placed_requests", "requests the manager has placed on each engine (running "
                                   "there)", labels=["engine"])
        tokens = GaugeMetricFamily("parrot_placed_tokens", "tokens the manager counts on each engine (prompt + "
                                   "max new tokens; a shared prefix once where the engine shares it)",
                                   labels=["engine"])
        for name, e in sorted(stats["engines"].items()):
            placed.add_metric([name], e["requests"])
            tokens.add_metric([name], e["tokens"])
        yield placed
        yield tokens
        up = GaugeMetricFamily("parrot_engine_up", "1 while the manager believes the engine alive (0: dead or not "
                               "probed yet)", labels=["engine", "model"])
        entries = m.registry.entries()
        for e in entries:
            up.add_metric([e.name, e.info.name if e.info is not None else ""], 1.0 if e.healthy else 0.0)
        yield up
        decisions = CounterMetricFamily("parrot_policy_decisions", "the global policy's decisions by kind (E2: "
                                        "exploit, explore, rebalance, replicate, pd-balance, eviction-notices)",
                                        labels=["policy", "kind"])
        for kind, n in sorted(stats["decisions"].items()):
            decisions.add_metric([policy, kind], n)
        yield decisions
        yield from status_families([e.status for e in entries if e.status is not None])
        sharing = m.sharing.stats()
        for name, doc, value in (
                ("parrot_prefix_sharing_forks", "requests run as forks of a shared prefix context", sharing.forks),
                ("parrot_prefix_sharing_tokens_shared", "prefix tokens forks inherited instead of filling them",
                 sharing.tokens_shared),
                ("parrot_prefix_sharing_tokens_prefilled", "tokens filled into shared prefix contexts",
                 sharing.tokens_prefilled),
                ("parrot_requests_rescheduled", "Parrot requests restarted on another engine after theirs died",
                 m.executor.num_rescheduled),
                ("parrot_engine_deaths", "engines declared dead", m.registry.num_deaths)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        yield from _tool_families(m)


def _tool_families(m: "Manager") -> Iterable[Metric]:
    """LAMPS predictions (parrot.manager.tool_predict): output-length accuracy, tool durations, pauses asked."""
    p = m.predictors
    acc = p.output_length.accuracy()
    c = CounterMetricFamily("parrot_output_length_predictions", "generates whose output length was predicted and "
                            "then observed (the predictor's accuracy is measured on them)")
    c.add_metric([], acc.observations)
    yield c
    for name, doc, value in (
            ("parrot_output_length_prediction_mae_tokens", "mean absolute error of output-length predictions (tokens)",
             acc.mean_abs_error),
            ("parrot_output_length_prediction_within_bin_ratio", "share of output-length predictions in the actual "
             "length's 10-token bin", acc.within_bin_rate)):
        if value is not None:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
    mean = GaugeMetricFamily("parrot_tool_duration_mean_seconds", "mean observed duration per tool", labels=["tool"])
    calls = CounterMetricFamily("parrot_tool_calls_observed", "tool calls whose duration was observed",
                                labels=["tool"])
    for t in p.tool_durations.all():
        mean.add_metric([t.name], t.mean_s)
        calls.add_metric([t.name], t.count)
    yield mean
    yield calls
    pauses = CounterMetricFamily("parrot_tool_pauses_requested", "contexts the manager handed to an engine for a "
                                 "tool call, by the handling the engine chose (free: the engine has none)",
                                 labels=["handling"])
    for handling, n in sorted(p.pauses.items()):
        pauses.add_metric([handling], n)
    yield pauses
