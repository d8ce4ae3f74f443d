"""Cost-model-aware FindEngine: what the app-centric policy decides in seconds when it knows how an engine's
iteration time grows with its batch (the engines' step statistics, :mod:`parrot.common.step_cost`).

Tokens are a proxy for time. On a GPU a decode step mostly streams the weights, so a cap in tokens is a cap in
time and batching is nearly free: Algorithm 1's token rules are right there. On a CPU engine every sequence and
every prompt token costs a visible share of a step, and then three decisions need the time itself:

(a) **split or keep whole.** A throughput task group (or a lone throughput request) is assigned member by member
    to the engine where it would finish earliest (:meth:`CostLedger.finish_s`: the pending prefill plus
    ``max_new`` decode steps of the batch it joins), among the engine Algorithm 1 picks for the whole group and
    engines already running work (never another idle engine: Algorithm 1 keeps those for the other kind of
    work), and that split is used only if it finishes the group at least ``SPLIT_GAIN`` sooner than the whole
    group on Algorithm 1's engine. With batching nearly free that rarely pays.
(b) **latency budget.** An engine running latency work has a per-step time budget: the step time of that
    engine filled with its latency work up to its latency cap (:meth:`CostLedger.budget_s`, the cap turned into
    seconds with the engine's own cost). A TPOT target turns into a cap with the same cost
    (:func:`cap_for_tpot`), not a fixed profile.
(c) **spare capacity of a latency engine.** Throughput work may join an engine running latency work if it
    fits under the engine's token cap (Algorithm 1's room, kept for latency work arriving later) and the
    estimated step time there, with the pending prefill amortized over the latency requests' generation (a
    prompt prefilled in the batch stalls every decode row once), stays within the budget
    (:meth:`CostLedger.admits`), and if it finishes there sooner than elsewhere by more than the seconds it
    adds to the latency requests' latencies (:meth:`CostLedger.latency_harm_s`). Latency work joins an engine
    running throughput work on Algorithm 1's token rule, as before: a time budget admitted more there, and on
    the GPU models it made chats wait behind prefills the estimate under-counted (mixed experiment, seeds 0-5).

Token accounting is the policies' (a request's tokens = prompt estimate + max new tokens, a shared prefix counted
once); the decode step uses those tokens as its context (the end of the requests' lives, a conservative
estimate). Pending prefill is this round's prompts plus the *backlog* of earlier ones, and the decode steps an
earlier request has left are estimated from its placement time (:class:`CostLedger`), so an engine still
prefilling a task group it just received looks as slow as it is, and one about to finish its batch as free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from parrot.common.step_cost import StepCost
from parrot.manager.policies.base import ClusterView, Demand, DispatchRequest, Occupancy, WorkKind

SPLIT_GAIN = 0.1  # a split must finish a throughput group >= 10% sooner than keeping it whole


def cap_for_tpot(cost: StepCost, tpot_s: float, mean_tokens: int, *, min_cap: int, max_cap: int) -> int:
    """Running tokens of requests of ``mean_tokens`` each at which a decode step of ``cost`` takes ``tpot_s``,
    clamped to [min_cap, max_cap]."""
    per_token = cost.decode_ctx_s + cost.decode_row_s / max(1, mean_tokens)
    room = tpot_s - cost.base_s
    tokens = int(room / per_token) if per_token > 0 else max_cap
    return max(min_cap, min(max_cap, tokens))


@dataclass
class _Latency:
    """The latency work placed on one engine (the budget's inputs)."""

    rows: int = 0
    tokens: int = 0
    new_tokens: int = 0  # sum of max_new_tokens: how many steps the latency work still decodes
    cap: int | None = None

    def add(self, tokens: int, new_tokens: int, cap: int | None) -> None:
        self.rows += 1
        self.tokens += tokens
        self.new_tokens += new_tokens
        if cap is not None:
            self.cap = cap if self.cap is None else min(self.cap, cap)


@dataclass
class CostLedger:
    """Per-engine time estimates for one scheduling round, kept next to the round's :class:`Occupancy` (for KV
    room); :meth:`add` must be called with every placement the policy makes.

    Each engine's work is a list of (decode steps left, tokens) per request. For a request placed earlier the
    steps left are estimated from its placement time: its prompt is prefilled after those placed before it
    (FCFS at the engine's prefill rate), then it decodes one token per step at the engine's current step time.
    Work over a horizon of ``h`` steps counts each request for the share of the horizon it is still there
    (``min(1, steps_left / h)``): an engine about to finish its batch is nearly free for a newcomer."""

    cluster: ClusterView
    occ: Occupancy
    latency: dict[str, _Latency] = field(default_factory=dict)
    prefill: dict[str, float] = field(default_factory=dict)  # prompt tokens not yet prefilled, per engine
    work: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # (decode steps left, tokens)

    def __post_init__(self) -> None:
        for name, view in self.cluster.engines.items():
            lat = _Latency()
            for p in view.placed:
                if p.demand.kind is WorkKind.LATENCY:
                    lat.add(p.tokens, p.tokens - p.prompt_tokens, p.demand.cap)
            self.latency[name] = lat
            self.prefill[name], self.work[name] = self._progress(name)

    def _progress(self, engine: str) -> tuple[float, list[tuple[float, int]]]:
        """(prompt tokens still to prefill, work list) of what is placed on ``engine`` (see the class docstring).
        Without a cost, a clock or placement times every request is taken as just placed."""
        placed = self.cluster.engines[engine].placed
        cost, now = self.cost(engine), self.cluster.now
        if cost is None or now is None or cost.prefill_token_s <= 0 or any(p.placed_at is None for p in placed):
            return float(sum(p.prompt_tokens for p in placed)), [(p.tokens - p.prompt_tokens, p.tokens) for p in placed]
        step = cost.step_s(len(placed), sum(p.tokens for p in placed))
        backlog, t, work = 0.0, None, []
        for p in sorted(placed, key=lambda p: p.placed_at):  # type: ignore[arg-type, return-value]
            assert p.placed_at is not None
            if t is not None:
                backlog = max(0.0, backlog - (p.placed_at - t) / cost.prefill_token_s)
            backlog, t = backlog + p.prompt_tokens, p.placed_at
            prefilled_at = p.placed_at + backlog * cost.prefill_token_s
            decoded = max(0.0, now - prefilled_at) / step if step > 0 else 0.0
            work.append((max(0.0, (p.tokens - p.prompt_tokens) - decoded), p.tokens))
        if t is not None:
            backlog = max(0.0, backlog - (now - t) / cost.prefill_token_s)
        return backlog, work

    def copy(self, occ: Occupancy) -> "CostLedger":
        """An independent copy kept next to ``occ`` (a copy of this ledger's Occupancy)."""
        out = object.__new__(CostLedger)
        out.cluster, out.occ = self.cluster, occ
        out.latency = {n: _Latency(**vars(lat)) for n, lat in self.latency.items()}
        out.prefill = dict(self.prefill)
        out.work = {n: list(w) for n, w in self.work.items()}
        return out

    def cost(self, engine: str) -> StepCost | None:
        return self.cluster.engines[engine].step_cost

    def add(self, engine: str, request: DispatchRequest, demand: Demand, extra_tokens: int) -> None:
        """Record a placement (``extra_tokens``: what it adds to the engine, as Occupancy counted it before)."""
        self.prefill[engine] += max(0, extra_tokens - request.max_new_tokens)
        self.work[engine].append((float(request.max_new_tokens), extra_tokens))
        if demand.kind is WorkKind.LATENCY:
            self.latency[engine].add(request.tokens, request.max_new_tokens, demand.cap)

    def batch(self, engine: str, horizon: float) -> tuple[float, float]:
        """(rows, tokens) of ``engine``'s work averaged over the next ``horizon`` decode steps."""
        rows = tokens = 0.0
        h = max(1.0, horizon)
        for left, tok in self.work[engine]:
            share = min(1.0, left / h)
            rows += share
            tokens += share * tok
        return rows, tokens

    # ---- (b) the latency budget -----------------------------------------------------------------------------
    def budget_s(self, engine: str, lat: _Latency) -> float | None:
        """The step time ``engine`` may reach while running latency work ``lat``: filled with such work up to
        its cap. None if ``lat`` is empty or uncapped, or the cost is unknown (no time limit)."""
        cost = self.cost(engine)
        if cost is None or lat.rows == 0 or lat.cap is None:
            return None
        mean = max(1, lat.tokens // lat.rows)
        return cost.step_s(max(lat.rows, math.ceil(lat.cap / mean)), lat.cap)

    # ---- (c) mixing kinds under the budget -------------------------------------------------------------------
    def admits(self, engine: str, requests: Sequence[DispatchRequest], demands: Sequence[Demand],
               extra_tokens: int) -> bool:
        """Whether ``requests`` (adding ``extra_tokens``) may join ``engine`` under the latency budget of the
        latency work there and among them, and within the engine's KV. The step time is averaged over the
        latency work's generation (its mean max new tokens), pending prefill included as a stall spread over
        it. False if the cost is unknown."""
        cost = self.cost(engine)
        if cost is None:
            return False
        kv = self.cluster.engines[engine].capacity_tokens
        if kv is not None and self.occ.tokens[engine] + extra_tokens > kv:
            return False
        lat = _Latency(**vars(self.latency[engine]))
        for r, d in zip(requests, demands):
            if d.kind is WorkKind.LATENCY:
                lat.add(r.tokens, r.max_new_tokens, d.cap)
        budget = self.budget_s(engine, lat)
        if budget is None:
            return True
        steps = max(1.0, lat.new_tokens / lat.rows)
        rows, tokens = self.batch(engine, steps)
        for r in requests:
            share = min(1.0, r.max_new_tokens / steps)
            rows += share
            tokens += share * r.tokens
        prefill = self.prefill[engine] + max(0, extra_tokens - sum(r.max_new_tokens for r in requests))
        est = cost.step_s(round(rows), int(tokens)) + cost.prefill_token_s * prefill / steps
        return est <= budget

    def latency_harm_s(self, engine: str, request: DispatchRequest, extra_tokens: int) -> float:
        """Seconds of latency ``request`` (adding ``extra_tokens``) adds to the latency requests on ``engine``
        in all: each waits once for its prompt's prefill and decodes its remaining steps (at most as many as
        ``request`` decodes) one sequence slower."""
        cost, lat = self.cost(engine), self.latency[engine]
        if cost is None or lat.rows == 0:
            return 0.0
        steps = min(lat.new_tokens / lat.rows, request.max_new_tokens)
        per_step = cost.decode_row_s + cost.decode_ctx_s * extra_tokens
        stall = cost.prefill_token_s * max(0, extra_tokens - request.max_new_tokens)
        return lat.rows * (per_step * steps + stall)

    # ---- (a) how long a throughput set takes where ---------------------------------------------------------
    def finish_s(self, engine: str, new_tokens: int, extra_rows: int = 0, extra_tokens: int = 0,
                 extra_prefill: int = 0) -> float:
        """Seconds until newcomers generating ``new_tokens`` (plus ``extra_*`` not yet added) finish on
        ``engine``: the pending prefill, then ``new_tokens`` decode steps of the batch over that horizon."""
        cost = self.cost(engine)
        assert cost is not None
        rows, tokens = self.batch(engine, new_tokens)
        return cost.prefill_token_s * (self.prefill[engine] + extra_prefill) + new_tokens * cost.step_s(
            round(rows) + extra_rows, int(tokens) + extra_tokens)
