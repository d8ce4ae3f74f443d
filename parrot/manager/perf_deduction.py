"""Performance-objective deduction (paper §5.2, Fig. 9): request-level scheduling labels from the criteria
that GETs record on variables (GetPerfObj), found by walking the DAG backwards (GetProducer).

    THROUGHPUT on v:  every request producing v, directly or transitively      -> throughput-preferred
    LATENCY on v:     S0 = the producers of v                                  -> latency-sensitive
                      S1 = the producers of S0's inputs (immediate predecessors) -> latency-sensitive
    task groups:      parallel requests of one stage, to be scheduled as a whole: the members of S0 of equal
                      depth, and the members of S1 of equal depth (e.g. the maps feeding a reduce; the coders,
                      and separately the reviewers, feeding the revisers of a multi-agent app)
    A request reached by both criteria is latency-sensitive (the stricter objective wins).

``depth`` is the length of the longest chain of requests above a request (0 = it reads only client-set
values); requests of equal depth can never depend on each other, which is what "parallel" means here.

Targets (the paper's named extension): a LATENCY fetch may carry a time-to-first-token, a time-per-output-token
and a deadline (:class:`~parrot.common.perf.PinnedTargets`, the deadline absolute on the manager's clock). The
producers of the fetched variable inherit all three; immediate predecessors inherit only the deadline (the
first token and the token pace of ``v`` are not theirs). The global scheduler orders by the earliest deadline
and turns a TPOT target into a tighter engine token cap.

:class:`PerfDeduction` keeps, per session, the recorded targets, request depths and the current labels. It
re-deduces when a GET changes an annotation (even while the fetched value is pending) and when a request is
submitted whose outputs feed something annotated or labeled, so late submits are labeled on arrival.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from parrot.common.perf import PerfCriteria, PinnedTargets
from parrot.manager.graph import Graph, RequestNode

NO_TARGETS = PinnedTargets()


@dataclass(frozen=True)
class RequestLabel:
    """The scheduling preference deduced for one request."""

    criteria: PerfCriteria
    task_group: str | None = None  # "g0", "g1", ... unique within the session
    targets: PinnedTargets = NO_TARGETS


@dataclass(frozen=True)
class SchedInfo:
    """What the global scheduler knows about a request beyond its DispatchRequest."""

    label: RequestLabel | None = None  # None: no criterion downstream (yet)
    depth: int = 0  # topological depth inside its app (Algorithm 1 sorts by it)
    app_order: float = 0.0  # when its app (session) submitted its first request: apps are kept in arrival order

    @property
    def criteria(self) -> PerfCriteria | None:
        return self.label.criteria if self.label is not None else None

    @property
    def task_group(self) -> str | None:
        return self.label.task_group if self.label is not None else None

    @property
    def targets(self) -> PinnedTargets:
        return self.label.targets if self.label is not None else NO_TARGETS


# ---- the pure deduction ---------------------------------------------------------------------------------------
def request_depths(graph: Graph) -> dict[str, int]:
    """Longest chain of requests above each request (iterative: deep chains do not recurse)."""
    depth: dict[str, int] = {}
    for root in graph.requests:
        stack = [root]
        while stack:
            rid = stack[-1]
            if rid in depth:
                stack.pop()
                continue
            parents = _producers(graph, graph.requests[rid])
            todo = [p for p in parents if p not in depth]
            if todo:
                stack.extend(todo)  # the graph is acyclic (Graph rejects cycles), so this terminates
                continue
            depth[rid] = 1 + max((depth[p] for p in parents), default=-1)
            stack.pop()
    return depth


def deduce(graph: Graph, targets: Mapping[str, PinnedTargets] | None = None,
           depths: Mapping[str, int] | None = None) -> dict[str, RequestLabel]:
    """Labels of every request that some annotated variable depends on (see the module docstring).

    ``targets``: var id -> targets recorded by LATENCY fetches; ``depths``: precomputed request depths.
    Groups are numbered in the order they are found (S0 groups first), so equal graphs get equal names."""
    targets = targets or {}
    depth = dict(depths) if depths is not None else request_depths(graph)
    criteria: dict[str, PerfCriteria] = {}
    goals: dict[str, PinnedTargets] = {}

    # THROUGHPUT: every producer, transitively
    stack = [v.producer for v in graph.variables.values()
             if v.perf is not None and v.perf.criteria is PerfCriteria.THROUGHPUT and v.producer is not None]
    while stack:
        rid = stack.pop()
        if rid in criteria:
            continue
        criteria[rid] = PerfCriteria.THROUGHPUT
        stack.extend(_producers(graph, graph.requests[rid]))

    # LATENCY: direct producers (S0) and their immediate predecessors (S1)
    s0: dict[str, None] = {}
    for v in graph.variables.values():
        if v.perf is None or v.perf.criteria is not PerfCriteria.LATENCY or v.producer is None:
            continue
        s0[v.producer] = None
        goals[v.producer] = goals.get(v.producer, NO_TARGETS).tightest(targets.get(v.var_id, NO_TARGETS))
    s1: dict[str, None] = {}
    for rid in s0:
        for p in _producers(graph, graph.requests[rid]):
            if p in s0:
                continue
            s1[p] = None
            goals[p] = goals.get(p, NO_TARGETS).tightest(goals[rid].deadline_only())
    for rid in (*s0, *s1):
        criteria[rid] = PerfCriteria.LATENCY

    # task groups: the parallel members of each stage
    groups = _split_by_depth(list(s0), depth) + _split_by_depth(list(s1), depth)
    group_of: dict[str, str] = {}
    for members in groups:
        if len(members) < 2:
            continue
        name = f"g{len(set(group_of.values()))}"
        for rid in members:
            group_of.setdefault(rid, name)

    return {rid: RequestLabel(c, group_of.get(rid) if c is PerfCriteria.LATENCY else None,
                              goals.get(rid, NO_TARGETS))
            for rid, c in sorted(criteria.items(), key=lambda kv: graph.requests[kv[0]].number)}


def _producers(graph: Graph, req: RequestNode) -> list[str]:
    """Distinct producers of ``req``'s inputs, in input order."""
    out: dict[str, None] = {}
    for vid in req.inputs:
        producer = graph.variables[vid].producer
        if producer is not None:
            out[producer] = None
    return list(out)


def _split_by_depth(members: list[str], depth: Mapping[str, int]) -> list[list[str]]:
    by_depth: dict[int, list[str]] = {}
    for rid in members:
        by_depth.setdefault(depth[rid], []).append(rid)
    return [by_depth[d] for d in sorted(by_depth)]


# ---- the manager-side state ----------------------------------------------------------------------------------
@dataclass
class _App:
    app_order: float
    targets: dict[str, PinnedTargets] = field(default_factory=dict)
    depth: dict[str, int] = field(default_factory=dict)
    labels: dict[str, RequestLabel] = field(default_factory=dict)
    annotated: bool = False  # some variable of the session carries a criterion
    # SchedInfo per request, built on first query; emptied whenever depth or labels change (the dispatcher
    # asks for every queued and placed request in every scheduling round)
    infos: dict[str, SchedInfo] = field(default_factory=dict)


class PerfDeduction:
    """Labels per session, kept current as GETs and submits arrive. Used from the event loop only; the
    manager owns one (no global state) and forgets a session when it closes."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._apps: dict[str, _App] = {}

    def _app(self, session_id: str) -> _App:
        app = self._apps.get(session_id)
        if app is None:
            app = self._apps[session_id] = _App(app_order=self._clock())
        return app

    def annotate(self, graph: Graph, var_id: str, criteria: PerfCriteria,
                 targets: PinnedTargets | None = None) -> bool:
        """A GET with a criterion (GetPerfObj): record it on the variable, re-deduce if anything changed.
        Returns True if the session's labels changed (the scheduler should look at its queue again)."""
        var = graph.variable(var_id)
        before = var.perf.criteria if var.perf is not None else None
        graph.set_perf_obj(var_id, criteria)
        app = self._app(graph.session_id)
        app.annotated = True
        changed = graph.get_perf_obj(var_id) is not before
        if targets is not None and not targets.empty:
            old = app.targets.get(var_id, NO_TARGETS)
            new = old.tightest(targets)
            if new != old:
                app.targets[var_id] = new
                changed = True
        return self._relabel(graph, app) if changed else False

    def submitted(self, graph: Graph, req: RequestNode) -> bool:
        """A request was added: record its depth; re-deduce if it feeds an annotated variable or a labeled
        request. Returns True if the session's labels changed."""
        app = self._app(graph.session_id)
        app.depth[req.request_id] = 1 + max((app.depth.get(p, 0) for p in _producers(graph, req)), default=-1)
        app.infos.pop(req.request_id, None)
        if not app.annotated:
            return False
        feeds = any(graph.variables[v].perf is not None or
                    any(c in app.labels for c in graph.variables[v].consumers) for v in req.outputs)
        return self._relabel(graph, app) if feeds else False

    def _relabel(self, graph: Graph, app: _App) -> bool:
        depths = request_depths(graph)
        labels = deduce(graph, app.targets, depths)
        app.depth = depths
        changed = labels != app.labels
        app.labels = labels
        app.infos.clear()
        return changed

    # ---- queries ------------------------------------------------------------------------------------------
    def info(self, session_id: str, request_id: str) -> SchedInfo:
        app = self._apps.get(session_id)
        if app is None:
            return SchedInfo(app_order=self._clock())
        info = app.infos.get(request_id)
        if info is None:
            info = app.infos[request_id] = SchedInfo(app.labels.get(request_id), app.depth.get(request_id, 0),
                                                     app.app_order)
        return info

    def label(self, session_id: str, request_id: str) -> RequestLabel | None:
        app = self._apps.get(session_id)
        return app.labels.get(request_id) if app is not None else None

    def labels(self, session_id: str) -> dict[str, RequestLabel]:
        app = self._apps.get(session_id)
        return dict(app.labels) if app is not None else {}

    def forget(self, session_id: str) -> None:
        self._apps.pop(session_id, None)
