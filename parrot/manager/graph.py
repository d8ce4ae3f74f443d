"""The per-session DAG of Semantic Variables and requests (paper §4.2) and its primitives.

Nodes are variables and requests; edges are placeholders: a request *consumes* its input variables and
*produces* its output variables. Invariants kept by :class:`Graph` (the only writer of node state):

* a variable has at most one producer, and a variable the client set (PUT) has none;
* the graph is acyclic: a submit whose outputs are upstream of its inputs is rejected (CycleError);
* a variable's status only moves PENDING -> READY or PENDING -> FAILED, once; its event is set then;
* statuses move only along VAR_TRANSITIONS and REQUEST_TRANSITIONS (below); any other change raises
  IllegalTransition.

Variables are numbered ``%1, %2, ...`` in creation order; :meth:`Graph.dump_text` prints one SSA-like line
per free variable and per request::

    %1 = input task = 'a snake game'  [ready]
    %2 = r_1 write_code(code) <- %1  [finished, engine e0, get:latency]
    %3 = tool search <- %2  [pending]

A *tool-produced* variable (:class:`ToolDecl`) is a free variable the client sets later from a tool call (a
native function declared with ``tool=``) that reads its ``inputs``: the generate producing such an input is
followed by a tool call (LAMPS), so its context is paused rather than freed (parrot.manager.executor).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from parrot.common.errors import (
    CycleError,
    InvalidRequestError,
    StepFailed,
    UnknownVariable,
    VariableAlreadySet,
)
from parrot.common.perf import PerfCriteria
from parrot.common.sampling import SamplingParams
from parrot.common.template import PlaceholderSegment, Segment, TextSegment
from parrot.common.transforms import Transform
from parrot.manager.journal import Journal, NullJournal
from parrot.manager.perf import PerfAnnotation
from parrot.manager.state_budget import StateBudget
from parrot.manager.value_stream import ValueStream


class VarStatus(str, Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


class RequestStatus(str, Enum):
    WAITING = "waiting"  # some input is not materialized yet
    READY = "ready"  # inputs materialized; waiting for the dispatcher to hand out an engine
    RUNNING = "running"  # dispatched to an engine
    FINISHED = "finished"
    FAILED = "failed"


# The legal status changes (the executor makes them; an illegal one is a bug and raises IllegalTransition):
#
#   WAITING --inputs ready--> READY --engine leased--> RUNNING --run done--> FINISHED
#                               ^                         |
#                               +------ engine lost ------+   (rescheduled: it runs again on another engine)
#
#   WAITING | READY | RUNNING --a failed input, a failed run, the session closed--> FAILED
#   FINISHED and FAILED are final.
REQUEST_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.READY, RequestStatus.FAILED}),
    RequestStatus.READY: frozenset({RequestStatus.RUNNING, RequestStatus.FAILED}),
    RequestStatus.RUNNING: frozenset({RequestStatus.READY, RequestStatus.FINISHED, RequestStatus.FAILED}),
    RequestStatus.FINISHED: frozenset(),
    RequestStatus.FAILED: frozenset(),
}
VAR_TRANSITIONS: dict[VarStatus, frozenset[VarStatus]] = {
    VarStatus.PENDING: frozenset({VarStatus.READY, VarStatus.FAILED}),
    VarStatus.READY: frozenset(),
    VarStatus.FAILED: frozenset(),
}


TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class ToolDecl:
    """A variable's declaration as the output of tool ``name`` called on ``inputs`` (var ids of the session).
    ``expected_duration_s``: the client's guess, used until the manager has observed the tool."""

    name: str
    inputs: tuple[str, ...]
    expected_duration_s: float | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "inputs": list(self.inputs), "expected_duration_s": self.expected_duration_s}


@dataclass(frozen=True)
class Lookahead:
    """What a flow expects after a request it made (parrot.manager.flows.runner): the tool that will read its
    output (when none is declared yet: a branch picks it once the output exists) and how many more generates like
    it its loop is expected to run, each followed by that tool whose result appends ``return_tokens``; and when the
    flow started (the manager's clock), its requests' age. Sent to the engine in the generate's OpHint (``tool``,
    ``later``, ``elapsed_s``): LAMPS' ranking and pause planning see ahead, and a request-level rank ages them."""

    tool: ToolDecl | None = None
    later_steps: int = 0
    return_tokens: int | None = None
    started_at: float | None = None


@dataclass(frozen=True)
class GeneratedTokens:
    """The tokens a generate wrote for a variable, on model ``model``: ``text`` is the raw generated text (before
    moved spaces are dropped and transforms applied) and ``token_ids`` what the engine appended to the context
    for it (a final EOS / stop token left out). A later prompt that holds ``text`` verbatim reuses these ids
    rather than retokenizing the text (which may split it differently), so it continues the producer's context
    token for token and the engine's prefix match finds that context's KV."""

    model: str
    text: str
    token_ids: tuple[int, ...]


class IllegalTransition(AssertionError):
    """A status change the transition tables do not allow: an internal error (a bug in the caller)."""


def _check_transition(table: dict, what: str, old: Enum, new: Enum) -> None:
    if new not in table[old]:
        raise IllegalTransition(f"{what}: {old.value} -> {new.value} is not a legal transition")


@dataclass(frozen=True)
class PlaceholderBinding:
    """One placeholder of a submitted request, bound to a variable of the session."""

    name: str
    is_output: bool
    var_id: str | None  # None only before Graph.add_request binds a fresh output variable
    sampling: SamplingParams | None = None  # outputs only
    transforms: tuple[Transform, ...] = ()


@dataclass
class RequestTimes:
    """Milestones of a request on the graph's clock (the manager's: wall-clock seconds in a server, virtual time in
    the simulator); None until reached."""

    submitted: float
    dispatched: float | None = None  # inputs ready and handed to an engine
    first_token: float | None = None
    finished: float | None = None  # finished or failed

    def to_dict(self) -> dict:
        return {"submitted": self.submitted, "dispatched": self.dispatched, "first_token": self.first_token,
                "finished": self.finished}


@dataclass(eq=False)
class Variable:
    var_id: str
    number: int
    name: str | None
    status: VarStatus = VarStatus.PENDING
    value: str | None = None
    error: StepFailed | None = None
    producer: str | None = None  # request id
    consumers: list[str] = field(default_factory=list)  # request ids, in submit order, unique
    perf: PerfAnnotation | None = None
    _done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    pieces: ValueStream = field(default_factory=ValueStream, repr=False)  # the value while generated (streaming)
    tool: ToolDecl | None = None  # produced by this tool call (set by the client)
    tool_outputs: list[str] = field(default_factory=list)  # var ids of tool-produced variables reading this one
    ready_at: float | None = None  # when it became READY (graph clock)
    generated: GeneratedTokens | None = field(default=None, repr=False)  # its producer's tokens for it
    # the flow step that made it (parrot.manager.flows: "f_1/steps[0].loop[2]/steps[1].text"); None: the client
    origin: str | None = None
    client_tool: bool = False  # a flow's call of a client-side tool: the client's worker sets it

    @property
    def done(self) -> bool:
        return self.status is not VarStatus.PENDING

    async def wait(self) -> None:
        """Return once the variable is READY or FAILED."""
        await self._done.wait()


@dataclass(eq=False)
class RequestNode:
    request_id: str
    number: int
    name: str | None
    segments: tuple[Segment, ...]
    bindings: dict[str, PlaceholderBinding]  # placeholder name -> binding, template order
    inputs: tuple[str, ...]  # distinct input var ids, template order
    outputs: tuple[str, ...]  # output var ids, template order
    models: tuple[str, ...]
    times: RequestTimes
    status: RequestStatus = RequestStatus.WAITING
    engine: str | None = None
    context_id: str | None = None
    prefix_context: str | None = None  # the prefix context its context was forked from (prefix sharing)
    num_shared_tokens: int = 0  # tokens it inherited from that prefix context instead of filling them
    num_cached_tokens: int = 0  # of the tokens it filled, those the engine served from cached KV (FillResult)
    error: StepFailed | None = None
    origin: str | None = None  # the flow step that made it (see Variable.origin)
    generated_tokens: int = 0  # tokens its generates produced so far (in flight included; every run of it)
    lookahead: Lookahead | None = None  # what its flow expects after it (not journaled: a hint)

    @property
    def label(self) -> str:
        outs = ", ".join(b.name for b in self.bindings.values() if b.is_output)
        return f"{self.name or 'gen'}({outs})"


class Graph:
    """Variables and requests of one session. Not thread-safe: used from the event loop only.

    Every change below is also handed to ``journal`` (:mod:`parrot.manager.journal`; a NullJournal records
    nothing), right after it is made."""

    def __init__(self, session_id: str, *, max_nodes: int = 10_000, clock: Callable[[], float] = time.time,
                 journal: Journal | None = None, budget: StateBudget | None = None):
        self.session_id = session_id
        self.max_nodes = max_nodes
        self.budget = budget or StateBudget()  # bytes of values and prompts held (default: unbounded)
        self.bytes_used = 0  # charged to the budget (given back when the session closes)
        self._clock = clock
        self.journal = journal or NullJournal()
        self.variables: dict[str, Variable] = {}
        self.requests: dict[str, RequestNode] = {}
        self.by_origin: dict[str, str] = {}  # a flow step's origin -> the var id / request id it made
        self._num_final = 0  # requests FINISHED or FAILED (see open_requests)

    @property
    def open_requests(self) -> int:
        """Requests not FINISHED or FAILED yet (waiting, ready or running): the session's work in flight."""
        return len(self.requests) - self._num_final

    # ---- lookup ---------------------------------------------------------------------------------------------
    def variable(self, var_id: str) -> Variable:
        var = self.variables.get(var_id)
        if var is None:
            raise UnknownVariable(f"unknown variable {var_id!r} in session {self.session_id!r}", param="var_id")
        return var

    def request(self, request_id: str) -> RequestNode:
        return self.requests[request_id]

    # ---- primitives (paper Fig. 8) ----------------------------------------------------------------------------
    def get_producer(self, var_id: str) -> RequestNode | None:
        producer = self.variable(var_id).producer
        return self.requests[producer] if producer is not None else None

    def get_consumers(self, var_id: str) -> list[RequestNode]:
        return [self.requests[r] for r in self.variable(var_id).consumers]

    def get_perf_obj(self, var_id: str) -> PerfCriteria | None:
        perf = self.variable(var_id).perf
        return perf.criteria if perf is not None else None

    def set_perf_obj(self, var_id: str, criteria: PerfCriteria) -> None:
        var = self.variable(var_id)
        now = self._clock()
        before = var.perf
        var.perf = PerfAnnotation(criteria, now) if var.perf is None else var.perf.merged(criteria, now)
        if var.perf is not before:
            self.journal.perf_recorded(self.session_id, var)

    # ---- building -------------------------------------------------------------------------------------------
    def _check_capacity(self, new_nodes: int) -> None:
        if len(self.variables) + len(self.requests) + new_nodes > self.max_nodes:
            raise InvalidRequestError(f"session {self.session_id!r} reached its limit of {self.max_nodes} "
                                      "variables + requests; create a new session")

    def add_variable(self, name: str | None = None, value: str | None = None, *,
                     tool: ToolDecl | None = None, origin: str | None = None, client_tool: bool = False) -> Variable:
        """A new free variable (READY when ``value`` is given). ``tool``: it is the output of that tool call
        (validated first: InvalidRequestError naming ``tool.*``, UnknownVariable for an unknown input).
        ``origin``: the flow step making it (unique per graph; the client cannot set it unless ``client_tool``)."""
        self._check_capacity(1)
        if origin is not None and origin in self.by_origin:
            raise IllegalTransition(f"graph of {self.session_id}: origin {origin!r} already made a node")
        if tool is not None:
            self._check_tool(tool, value)
        if value is not None:
            self.reserve_text(value, "the value")
        number = len(self.variables) + 1
        var = Variable(var_id=f"v_{number}", number=number, name=name, tool=tool, origin=origin,
                       client_tool=client_tool)
        self.variables[var.var_id] = var
        if origin is not None:
            self.by_origin[origin] = var.var_id
        if tool is not None:
            for vid in tool.inputs:
                self.variables[vid].tool_outputs.append(var.var_id)
        self.journal.variable_added(self.session_id, var)
        if value is not None:
            self.materialize(var.var_id, value)
        return var

    def _check_tool(self, tool: ToolDecl, value: str | None) -> None:
        if not TOOL_NAME.match(tool.name):
            raise InvalidRequestError(f"tool name {tool.name!r} must be 1..64 of a-z, A-Z, 0-9, '_', '-', '.'",
                                      param="tool.name")
        d = tool.expected_duration_s
        if d is not None and (isinstance(d, bool) or not math.isfinite(d) or d <= 0):
            raise InvalidRequestError(f"tool.expected_duration_s must be a positive finite number, got {d!r}",
                                      param="tool.expected_duration_s")
        if value is not None:
            raise InvalidRequestError("a tool-produced variable gets its value from the tool call (set it later); "
                                      "it cannot be created with one", param="value")
        for vid in tool.inputs:
            if vid not in self.variables:
                raise UnknownVariable(f"tool {tool.name!r}: unknown input variable {vid!r} in session "
                                      f"{self.session_id!r}", param="tool.inputs")

    def tool_reading(self, var_id: str) -> Variable | None:
        """The tool call made right after ``var_id`` is produced: the last-declared pending tool-produced variable
        reading it (its ``tool`` set; None: no pending tool reads it)."""
        for out in reversed(self.variables[var_id].tool_outputs):
            target = self.variables[out]
            if target.status is VarStatus.PENDING and target.tool is not None:
                return target
        return None

    def check_settable(self, var_id: str) -> Variable:
        """The variable a client may PUT a value into: pending and without a producer (409 otherwise)."""
        var = self.variable(var_id)
        if var.status is not VarStatus.PENDING:
            raise VariableAlreadySet(f"variable {var_id!r} is already {var.status.value}", param="var_id")
        if var.producer is not None:
            raise VariableAlreadySet(f"variable {var_id!r} is produced by request {var.producer!r}; it cannot "
                                     "be set by the client", param="var_id")
        if var.origin is not None and not var.client_tool:
            raise VariableAlreadySet(f"variable {var_id!r} is produced by flow step {var.origin!r}; it cannot be "
                                     "set by the client", param="var_id")
        return var

    def add_request(self, name: str | None, segments: Sequence[Segment], bindings: Sequence[PlaceholderBinding],
                    models: Sequence[str] = (), *, origin: str | None = None) -> RequestNode:
        """Insert a request. Validates everything before changing anything (a rejected submit leaves no trace).

        Raises UnknownVariable (404) for unknown ids, VariableAlreadySet (409) for an output variable that
        already holds a value, InvalidRequestError (400) for a variable with two producers, CycleError (400).
        """
        prompt_bytes = sum(len(seg.text.encode()) for seg in segments if isinstance(seg, TextSegment))
        self.budget.reserve(self.bytes_used, prompt_bytes, "the prompt")
        existing_outputs: dict[str, str] = {}  # var id -> placeholder name
        for b in bindings:
            if not b.is_output:
                if b.var_id is None:
                    raise InvalidRequestError(f"input placeholder {b.name!r} needs a var_id", param="placeholders")
                self.variable(b.var_id)
                continue
            if b.var_id is None:
                continue
            var = self.variable(b.var_id)
            if b.var_id in existing_outputs:
                raise InvalidRequestError(f"variable {b.var_id!r} is bound to two outputs "
                                          f"({existing_outputs[b.var_id]!r}, {b.name!r}); a variable has at most "
                                          "one producer", param="placeholders")
            if var.producer is not None:
                raise InvalidRequestError(f"variable {b.var_id!r} (output {b.name!r}) already has a producer, "
                                          f"request {var.producer!r}; a variable has at most one producer",
                                          param="placeholders")
            if var.status is not VarStatus.PENDING:
                raise VariableAlreadySet(f"output {b.name!r}: variable {b.var_id!r} is already "
                                         f"{var.status.value}", param="placeholders")
            existing_outputs[b.var_id] = b.name
        inputs = tuple(dict.fromkeys(b.var_id for b in bindings if not b.is_output))
        self._check_acyclic(inputs, existing_outputs)
        if origin is not None and origin in self.by_origin:
            raise IllegalTransition(f"graph of {self.session_id}: origin {origin!r} already made a node")
        self._check_capacity(1 + sum(1 for b in bindings if b.is_output and b.var_id is None))

        number = len(self.requests) + 1
        request_id = f"r_{number}"
        bound: dict[str, PlaceholderBinding] = {}
        for b in bindings:
            if b.is_output and b.var_id is None:
                out_origin = None if origin is None else f"{origin}:{b.name}"
                b = PlaceholderBinding(b.name, True, self.add_variable(b.name, origin=out_origin).var_id, b.sampling,
                                       b.transforms)
            bound[b.name] = b
        # keep the template order of placeholders (bindings may come in any order)
        order = [s.name for s in segments if isinstance(s, PlaceholderSegment)]
        bound = {n: bound[n] for n in order}
        outputs = tuple(b.var_id for b in bound.values() if b.is_output)
        req = RequestNode(request_id=request_id, number=number, name=name, segments=tuple(segments),
                          bindings=bound, inputs=inputs, outputs=outputs, models=tuple(models),
                          times=RequestTimes(submitted=self._clock()), origin=origin)
        self.requests[request_id] = req
        if origin is not None:
            self.by_origin[origin] = request_id
        self._charge(prompt_bytes)
        for vid in outputs:
            self.variables[vid].producer = request_id
        for vid in inputs:
            self.variables[vid].consumers.append(request_id)
        self.journal.request_added(self.session_id, req)
        return req

    def load(self, variables: Iterable[Variable], requests: Iterable[RequestNode]) -> None:
        """Adopt nodes rebuilt from the journal (:mod:`parrot.manager.restore`) into this empty graph, in number
        order, with their statuses as journaled; done variables wake their waiters at once. Not journaled again."""
        if self.variables or self.requests:
            raise IllegalTransition(f"graph of {self.session_id}: load() needs an empty graph")
        for var in variables:
            self.variables[var.var_id] = var
            if var.origin is not None:
                self.by_origin[var.origin] = var.var_id
            if var.value is not None:
                self._charge(len(var.value.encode()))
            if var.done:
                var._done.set()
        for req in requests:
            self.requests[req.request_id] = req
            if req.origin is not None:
                self.by_origin[req.origin] = req.request_id
            self._charge(sum(len(seg.text.encode()) for seg in req.segments if isinstance(seg, TextSegment)))
            self._num_final += req.status in (RequestStatus.FINISHED, RequestStatus.FAILED)

    def _check_acyclic(self, inputs: Iterable[str], outputs: dict[str, str]) -> None:
        """Walk upstream from the inputs (each variable has at most one producer); meeting an output closes
        a cycle."""
        if not outputs:
            return
        seen: set[str] = set()
        stack = list(inputs)
        while stack:
            vid = stack.pop()
            if vid in seen:
                continue
            seen.add(vid)
            if vid in outputs:
                raise CycleError(f"output {outputs[vid]!r} (variable {vid!r}) is upstream of an input of the same "
                                 "request: the submit would create a cycle", param="placeholders")
            producer = self.variables[vid].producer
            if producer is not None:
                stack.extend(self.requests[producer].inputs)

    # ---- state transitions (called by the executor) -------------------------------------------------------------
    def reserve_text(self, text: str, what: str) -> None:
        """LimitExceeded unless client-given ``text`` fits the session's and the server's byte budget."""
        self.budget.reserve(self.bytes_used, len(text.encode()), what)

    def _charge(self, nbytes: int) -> None:
        self.bytes_used += nbytes
        self.budget.charge(nbytes)

    def release_budget(self) -> None:
        """Give the session's bytes back (it is closed; its graph is dropped)."""
        self.budget.release(self.bytes_used)
        self.bytes_used = 0

    def materialize(self, var_id: str, value: str, *, generated: GeneratedTokens | None = None) -> Variable:
        """``generated``: the tokens its producer wrote for it (see GeneratedTokens)."""
        var = self.variable(var_id)
        if var.status is not VarStatus.PENDING:
            raise VariableAlreadySet(f"variable {var_id!r} is already {var.status.value}", param="var_id")
        var.value = value
        var.generated = generated
        var.ready_at = self._clock()
        self._charge(len(value.encode()))
        self._set_var_status(var, VarStatus.READY)
        self.journal.variable_done(self.session_id, var)
        return var

    def fail_variable(self, var_id: str, error: StepFailed) -> bool:
        """Mark a pending variable failed; False (no change) if it was already done."""
        var = self.variable(var_id)
        if var.status is not VarStatus.PENDING:
            return False
        var.error = error
        self._set_var_status(var, VarStatus.FAILED)
        self.journal.variable_done(self.session_id, var)
        return True

    @staticmethod
    def _set_var_status(var: Variable, status: VarStatus) -> None:
        """The one place a variable's status changes (VAR_TRANSITIONS); a done variable wakes its waiters."""
        _check_transition(VAR_TRANSITIONS, f"variable {var.var_id}", var.status, status)
        var.status = status
        if var.done:
            var._done.set()
            var.pieces.wake()

    def input_state(self, req: RequestNode) -> tuple[bool, Variable | None]:
        """(all inputs ready, the first failed input or None)."""
        ready = True
        for vid in req.inputs:
            var = self.variables[vid]
            if var.status is VarStatus.FAILED:
                return False, var
            ready = ready and var.status is VarStatus.READY
        return ready, None

    def set_status(self, req: RequestNode, status: RequestStatus) -> None:
        """Move ``req`` to ``status`` (stamping its times); raises IllegalTransition unless REQUEST_TRANSITIONS
        allows the change."""
        _check_transition(REQUEST_TRANSITIONS, f"request {req.request_id}", req.status, status)
        req.status = status
        if status is RequestStatus.RUNNING:
            req.times.dispatched = self._clock()
        elif status in (RequestStatus.FINISHED, RequestStatus.FAILED):
            req.times.finished = self._clock()
            self._num_final += 1
        self.journal.request_status(self.session_id, req)

    # ---- dumps ----------------------------------------------------------------------------------------------
    def dump_text(self) -> str:
        """Numbered lines: free variables first, then requests in submit order."""
        lines: list[str] = []
        for var in self.variables.values():
            if var.producer is not None:
                continue
            value = "" if var.value is None else f" = {_short(var.value)}"
            if var.tool is not None:
                ins = ", ".join(f"%{self.variables[v].number}" for v in var.tool.inputs)
                lines.append(f"%{var.number} = tool {var.tool.name}{' <- ' + ins if ins else ''}{value}  "
                             f"[{_var_notes(var)}]")
                continue
            kind = "input" if var.origin is None else "flow"  # set by the client / computed by a flow step
            lines.append(f"%{var.number} = {kind} {var.name or var.var_id}{value}  [{_var_notes(var)}]")
        for req in self.requests.values():
            outs = ", ".join(f"%{self.variables[v].number}" for v in req.outputs) or "_"
            ins = ", ".join(f"%{self.variables[v].number}" for v in req.inputs)
            notes = [req.status.value]
            if req.engine:
                notes.append(f"engine {req.engine}")
            if req.prefix_context:
                notes.append(f"prefix {req.prefix_context} ({req.num_shared_tokens} tok)")
            perfs = {self.variables[v].perf.criteria.value for v in req.outputs if self.variables[v].perf}
            notes.extend(f"get:{p}" for p in sorted(perfs))
            if req.error is not None:
                notes.append(f"error {req.error.cause_code}")
            if req.origin is not None:
                notes.append(f"flow {req.origin}")
            arrow = f" <- {ins}" if ins else ""
            lines.append(f"{outs} = {req.request_id} {req.label}{arrow}  [{', '.join(notes)}]")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "variables": [
                {"var_id": v.var_id, "number": v.number, "name": v.name, "status": v.status.value,
                 "producer": v.producer, "consumers": list(v.consumers),
                 "perf": v.perf.criteria.value if v.perf else None,
                 "value_chars": None if v.value is None else len(v.value),
                 "tool": v.tool.to_json() if v.tool is not None else None,
                 "origin": v.origin,
                 "error": _error_json(v.error)}
                for v in self.variables.values()
            ],
            "requests": [
                {"request_id": r.request_id, "number": r.number, "name": r.name, "label": r.label,
                 "inputs": list(r.inputs), "outputs": list(r.outputs), "status": r.status.value,
                 "engine": r.engine, "context_id": r.context_id, "prefix_context": r.prefix_context,
                 "num_shared_tokens": r.num_shared_tokens, "num_cached_tokens": r.num_cached_tokens,
                 "timestamps": r.times.to_dict(), "origin": r.origin,
                 "error": _error_json(r.error)}
                for r in self.requests.values()
            ],
        }


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _var_notes(var: Variable) -> str:
    notes = [var.status.value]
    if var.origin is not None:
        notes.append(f"flow {var.origin}")
    if var.perf is not None:
        notes.append(f"get:{var.perf.criteria.value}")
    if var.error is not None:
        notes.append(f"error {var.error.cause_code}")
    return ", ".join(notes)


def _error_json(err: StepFailed | None) -> dict | None:
    if err is None:
        return None
    return {"code": err.code, "cause": err.cause_code, "message": err.message}
