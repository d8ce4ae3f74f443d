"""A unit-time model of API-augmented requests under a memory budget: LAMPS' Fig. 3 worked example. No torch.

Each request decodes ``api_after`` tokens, calls an API for ``api_duration`` units, then decodes the rest of its
``total`` tokens. Time advances in units; the rules (pinned down from the paper's narrative of Fig. 3):

1. At most one request computes per unit (one decode token, or one unit of recompute / swap-in).
2. A request's memory is the tokens it holds, the token being computed included. At its API call a PRESERVE
   request keeps them; DISCARD and SWAP drop them to 0. Back from the API, DISCARD recomputes its pre-API
   tokens (``fwd_s(pre)`` units holding them) and SWAP copies them back in (``swap_s(pre)`` units), then the
   post-API tokens follow. A request releases everything when it finishes.
3. *Residents* are requests holding memory. A resident never waits for a newcomer: a non-resident part (a
   request not started yet, or back from a DISCARD/SWAP API call) is admitted only if at every unit until it
   releases memory (its API call under DISCARD/SWAP, else its end), assuming it runs uninterrupted, its memory
   plus every resident's demand fits the budget, where a resident demands what it holds plus one token from
   the unit it is ready to compute on (a PRESERVE request from its API's return).
4. Each unit the ready requests are taken in the policy's priority order; the first that can compute does
   (a resident if its next step fits, a non-resident if admitted). Nothing fitting and nothing in an API
   call is a deadlock (:class:`UnitDeadlock`).

Table 1 (budget 6; ``R1 6/5/2 preserve, R2 2/1/7 discard, R3 3/2/1 swap``) under FCFS::

    unit:   0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
    R1:     1  2  3  4  5  a  a  6                         a: in its API (PRESERVE keeps 5); done at 8
    R2:                    1  a  a  a  a  a  a  a  r  2    r: recompute its 1 token; done at 15
    R3:                       -     1  2  a  3             -: may not start (R1 is back at 7 needing a 6th
                                                              unit, R3 would hold 2); done at 12
    average (8 + 15 + 12) / 3 = 11.67

Priorities: ``fcfs`` (request order), ``sjf`` (total tokens), ``sjf_total`` (tokens + API duration) and
``lamps`` (:func:`~parrot.engine.scheduler.tool_handling.memory_time` through the real
:class:`~parrot.engine.scheduler.lamps.LampsRanker`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from parrot.engine.scheduler.lamps import LampsRanker
from parrot.engine.scheduler.tool_handling import FixedCosts, Handling, ToolCosts, memory_time

UNIT_COSTS = FixedCosts(fwd_per_token_s=1.0, swap_per_token_s=0.0, decode_step_s=1.0)
"""One decode token = one unit; recomputing a token = one unit; swapping is free (the paper's example)."""


class UnitDeadlock(Exception):
    """Requests are ready but none can compute and no API call is pending: the budget is too small."""


@dataclass(frozen=True)
class UnitRequest:
    name: str
    total: int         # output tokens, pre- and post-API
    api_after: int     # tokens decoded before the API call
    api_duration: int  # units the API call takes
    handling: Handling

    def __post_init__(self) -> None:
        if not 0 < self.api_after <= self.total:
            raise ValueError(f"{self.name}: api_after must be in 1..total, got {self.api_after!r}")
        if self.api_duration < 0:
            raise ValueError(f"{self.name}: api_duration must be >= 0, got {self.api_duration!r}")

    @property
    def post(self) -> int:
        return self.total - self.api_after


TABLE1 = (
    UnitRequest("R1", total=6, api_after=5, api_duration=2, handling=Handling.PRESERVE),
    UnitRequest("R2", total=2, api_after=1, api_duration=7, handling=Handling.DISCARD),
    UnitRequest("R3", total=3, api_after=2, api_duration=1, handling=Handling.SWAP),
)
"""LAMPS Table 1 (all arrive at 0); memory budget 6."""


def _units(seconds: float, what: str) -> int:
    n = round(seconds)
    if abs(n - seconds) > 1e-9:
        raise ValueError(f"{what} must be a whole number of units, got {seconds!r}")
    return n


class _Phase(enum.Enum):
    PRE = "pre"
    API = "api"
    POST = "post"
    DONE = "done"


@dataclass
class _State:
    req: UnitRequest
    index: int
    steps: list[int]                 # memory held after each compute step of the current part
    phase: _Phase = _Phase.PRE
    held: int = 0
    api_end: int = 0
    finish: int | None = None
    trace: list[str] = field(default_factory=list)

    def ready(self, t: int) -> bool:
        return self.phase in (_Phase.PRE, _Phase.POST) or (self.phase is _Phase.API and t >= self.api_end)


@dataclass(frozen=True)
class UnitSchedule:
    completion: dict[str, int]     # name -> the unit its last step ends
    timeline: tuple[str | None, ...]  # who computes in each unit (None = idle)

    @property
    def average(self) -> float:
        return sum(self.completion.values()) / len(self.completion)

    def gantt(self) -> str:
        return " ".join(name or "." for name in self.timeline)


Priority = Callable[[Sequence[UnitRequest]], list[UnitRequest]]
"""Orders the ready requests (given in request order) for one unit."""


def simulate(requests: Sequence[UnitRequest], budget: int, priority: Priority,
             costs: ToolCosts = UNIT_COSTS, on_unit: Callable[[UnitRequest | None, Sequence[UnitRequest]], None]
             | None = None) -> UnitSchedule:
    """Run ``requests`` (all arriving at 0) under the rules of the module docstring. ``on_unit(chosen, ready)``
    is told each unit's outcome (the LAMPS ranker counts passes with it)."""
    states = [_State(r, i, list(range(1, r.api_after + 1))) for i, r in enumerate(requests)]
    swap_units = {s.req.name: _units(costs.swap_s(s.req.api_after), "swap_s") for s in states}
    fwd_units = {s.req.name: _units(costs.fwd_s(s.req.api_after), "fwd_s") for s in states}
    timeline: list[str | None] = []
    t = 0
    while any(s.phase is not _Phase.DONE for s in states):
        for s in states:  # back from the API: the post part
            if s.phase is _Phase.API and t >= s.api_end:
                s.phase = _Phase.POST
                pre = s.req.api_after
                back = [] if s.req.handling is Handling.PRESERVE else \
                    [pre] * (fwd_units[s.req.name] if s.req.handling is Handling.DISCARD else swap_units[s.req.name])
                s.steps = back + list(range(pre + 1, s.req.total + 1))
        ready = [s for s in states if s.ready(t)]
        by_req = {id(s.req): s for s in ready}
        order = [by_req[id(r)] for r in priority([s.req for s in ready])]
        chosen = next((s for s in order if _can_compute(s, states, budget, t)), None)
        if on_unit is not None:
            on_unit(chosen.req if chosen else None, [s.req for s in ready])
        if chosen is None:
            if not any(s.phase is _Phase.API for s in states):
                raise UnitDeadlock(f"at unit {t}: {[s.req.name for s in ready]} ready, none fits budget {budget}")
        else:
            _step(chosen, t)
        timeline.append(chosen.req.name if chosen else None)
        t += 1
    return UnitSchedule({s.req.name: s.finish for s in states if s.finish is not None}, tuple(timeline))


def _step(s: _State, t: int) -> None:
    s.held = s.steps.pop(0)
    if s.steps:
        return
    if s.phase is _Phase.PRE and s.req.post > 0:
        s.phase = _Phase.API
        s.api_end = t + 1 + s.req.api_duration
        if s.req.handling is not Handling.PRESERVE:
            s.held = 0
        return
    s.phase = _Phase.DONE
    s.held = 0
    s.finish = t + 1


def _release_profile(s: _State) -> list[int]:
    """Memory per unit of ``s``'s current part run uninterrupted from now until it releases memory."""
    if s.phase is _Phase.PRE and s.req.handling is Handling.PRESERVE and s.req.post > 0:
        pre = s.req.api_after
        return s.steps + [pre] * s.req.api_duration + list(range(pre + 1, s.req.total + 1))
    return list(s.steps)


def _can_compute(s: _State, states: Sequence[_State], budget: int, t: int) -> bool:
    others = [o for o in states if o is not s and o.held > 0]
    if s.held > 0:  # a resident: its next step must fit
        return s.steps[0] + sum(o.held for o in others) <= budget
    for u, mem in enumerate(_release_profile(s), start=t):
        demand = sum(o.held + (1 if o.ready(u) else 0) for o in others)
        if mem + demand > budget:
            return False
    return True


# ---- priorities ----------------------------------------------------------------------------------------------
def fcfs(ready: Sequence[UnitRequest]) -> list[UnitRequest]:
    return list(ready)


def sjf(ready: Sequence[UnitRequest]) -> list[UnitRequest]:
    """Shortest job first by output length."""
    return sorted(ready, key=lambda r: r.total)


def sjf_total(ready: Sequence[UnitRequest]) -> list[UnitRequest]:
    """Shortest job first by total length: output plus API duration."""
    return sorted(ready, key=lambda r: r.total + r.api_duration)


def lamps_score(r: UnitRequest, budget: int, costs: ToolCosts = UNIT_COSTS, *, batch_context: bool = True) -> float:
    """LAMPS' memory over time of ``r``: decode to the API, the handling's tool region, the post-API tokens.
    With ``batch_context`` the batch's other context is estimated as the rest of the budget (a memory-bound
    batch fills it), which the DISCARD recompute and the SWAP transfers stall (INFERCEPT eq. 2-3)."""
    other = max(0, budget - r.api_after) if batch_context else 0
    return memory_time(prompt_tokens=0, output_tokens=r.api_after, tool_s=float(r.api_duration),
                       handling=r.handling, costs=costs, post_tool_tokens=r.post, other_tokens=other)


@dataclass
class LampsPriority:
    """The LAMPS order for :func:`simulate`: the real ranker over :func:`lamps_score` (pass ``counted`` as
    ``on_unit`` so it sees who waited)."""

    budget: int
    costs: ToolCosts = UNIT_COSTS
    batch_context: bool = True
    ranker: LampsRanker[str] = field(default_factory=LampsRanker)

    def __call__(self, ready: Sequence[UnitRequest]) -> list[UnitRequest]:
        return self.ranker.order(ready, key=lambda r: r.name,
                                 score=lambda r: lamps_score(r, self.budget, self.costs,
                                                             batch_context=self.batch_context))

    def counted(self, chosen: UnitRequest | None, ready: Sequence[UnitRequest]) -> None:
        self.ranker.after_admission([chosen.name] if chosen else [],
                                    [r.name for r in ready if r is not chosen])


def run_policy(name: str, requests: Sequence[UnitRequest] = TABLE1, budget: int = 6) -> UnitSchedule:
    """Fig. 3's schedules by name: ``fcfs`` | ``sjf`` | ``sjf_total`` | ``lamps``."""
    if name == "lamps":
        lp = LampsPriority(budget)
        return simulate(requests, budget, lp, on_unit=lp.counted)
    table: dict[str, Priority] = {"fcfs": fcfs, "sjf": sjf, "sjf_total": sjf_total}
    if name not in table:
        raise ValueError(f"unknown unit policy {name!r} (known: fcfs, sjf, sjf_total, lamps)")
    return simulate(requests, budget, table[name])
