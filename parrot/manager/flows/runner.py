"""A running flow: instantiates its steps into the session's DAG as the values its decisions need become ready.

The graph stays what the paper's executor runs (acyclic, one producer per variable): a loop iteration, a branch
case or a map item is *new* nodes, made when the decision that selects them is known. What this module adds is
the decisions. Every node it makes carries an **origin**, its place in the declaration::

    f_2/0.loop[3]/1.generate          request: flow f_2, step 0 (a loop), iteration 3, step 1 (a generate)
    f_2/0.loop[3]/1.generate:thought  its output variable "thought"
    f_2/0.loop:answer                 the loop's exported output (a free variable this module materializes)
    f_2/2.branch/case1/0.tool         a tool call in case 1 of the branch at step 2

Nodes are made *get-or-create by origin*: a flow replayed after a restart (parrot.manager.flows.service)
re-derives every decision from the journaled values and meets the nodes it made before, so a loop continues at
the iteration it was in and nothing is generated twice.

Step kinds: ``generate`` becomes an ordinary request (scheduling, prefix sharing, LAMPS pauses, failover);
``text``, a server ``tool``, branch / loop / map outputs and the flow's exports are free variables this module
materializes (``GraphExecutor.materialize_free``); a client ``tool`` is a free variable the client's worker sets
(``ToolCallQueue``). Every tool output is declared as a tool call on its inputs (``ToolDecl``), so the generate
producing an input pauses its context while the tool runs (LAMPS). A failure never hangs: a failed input fails
what reads it, and a bug in a step fails that step's outputs with ``internal_error``.

Speculation (docs/flows.md): a branch whose condition is pending starts the case its profile says is likely;
on a miss every node under that case's origin is cancelled (requests' contexts freed) before the taken case
is made.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parrot.common.errors import ParrotError, StepFailed
from parrot.common.perf import PerfCriteria
from parrot.common.template import (
    Segment,
    parse_template,
    render_template,
)
from parrot.manager.flows.profile import BranchProfile, FlowStats
from parrot.manager.flows.prompts import inline_texts, split_items, tool_reading
from parrot.manager.flows.server_tools import SERVER_TOOLS, ToolError
from parrot.manager.flows.spec import (
    Block,
    BranchStep,
    FlowSpec,
    GenerateStep,
    LoopStep,
    MapStep,
    Step,
    TextStep,
    ToolStep,
)
from parrot.manager.flows.tool_calls import ToolCall, ToolCallQueue
from parrot.manager.graph import (
    Lookahead,
    PlaceholderBinding,
    RequestNode,
    ToolDecl,
    Variable,
    VarStatus,
)
from parrot.manager.session import SessionState
from parrot.manager.submit import build_bindings

if TYPE_CHECKING:
    from parrot.manager.executor import GraphExecutor

logger = logging.getLogger(__name__)

SERVER_TOOL_TIMEOUT_S = 10.0
MAX_EVENTS = 2000


class FlowStatus(str, enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class FlowEvent:
    at: float
    path: str  # the origin of the step it is about
    event: str  # iteration | branch | speculated | speculation_hit | speculation_miss | loop_done | loop_max_steps |
    #             map | failed
    detail: str = ""

    def to_json(self) -> dict:
        return {"at": self.at, "path": self.path, "event": self.event, "detail": self.detail}


CHARS_PER_TOKEN = 4  # the estimate of a tool result's tokens from its characters (Lookahead.return_tokens)
class _InputFailed(Exception):
    def __init__(self, var: Variable) -> None:
        super().__init__(var.var_id)
        self.var = var


@dataclass(frozen=True)
class _LoopAt:
    """The loop iteration a block runs in (for the lookahead of its generates)."""

    key: str  # the profile's key of the loop
    max_steps: int
    iteration: int
    return_tokens: int | None  # mean tokens of the loop's tool results so far (estimate), None: none ready yet


class Scope:
    """Scope name -> variable id; lookups fall through to the enclosing scope (docs/flows.md)."""

    def __init__(self, parent: Scope | None = None, names: dict[str, str] | None = None) -> None:
        self.parent = parent
        self.names = dict(names or {})

    def lookup(self, name: str) -> str:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        raise KeyError(name)  # the spec's checks make this unreachable

    def define(self, name: str, var_id: str) -> None:
        self.names[name] = var_id


@dataclass
class FlowEnv:
    """What a flow needs from the manager, passed explicitly (no globals)."""

    executor: GraphExecutor  # materialize_free, fail_free_variable, cancel_request
    add_request: Callable[..., RequestNode]  # (session, name, segments, bindings, models, origin)
    clock: Callable[[], float]
    calls: ToolCallQueue  # the session's
    profile: BranchProfile
    stats: FlowStats
    speculation_min_prob: float = 0.75
    speculation_min_runs: int = 5
    tool_timeout_s: float = 300.0
    on_event: Callable[[FlowRun, FlowEvent], None] = lambda run, ev: None


@dataclass(eq=False)
class FlowRun:
    flow_id: str
    number: int
    spec: FlowSpec
    body: dict  # the declaration as submitted (journaled; re-parsed at restore)
    session: SessionState
    env: FlowEnv
    outputs: dict[str, str]  # exported name -> var id
    speculate: bool
    status: FlowStatus = FlowStatus.RUNNING
    error: StepFailed | None = None
    criteria: PerfCriteria | None = None  # asked by a GET of an export: the steps made from now on inherit it
    started_at: float | None = None  # when it started running (env clock; a restored flow: when it resumed)
    events: list[FlowEvent] = field(default_factory=list)
    _tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    _main: asyncio.Task | None = None
    # var id of a text step's value -> its template's segments and {placeholder: var id} (see _inline)
    _texts: dict[str, tuple[tuple[Segment, ...], dict[str, str]]] = field(default_factory=dict)

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.started_at = self.env.clock()
        self._main = asyncio.create_task(self._run(), name=f"{self.session.session_id}/{self.flow_id}")

    async def cancel(self) -> None:
        tasks = [t for t in (self._main, *self._tasks.values()) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)

    async def _run(self) -> None:
        async def steps() -> None:
            scope = Scope(None, dict(self.spec.inputs))
            self._block(self.spec.block, scope, self.flow_id)
            await asyncio.gather(*(self._alias(scope.lookup(n), self.outputs[n]) for n in self.spec.outputs))

        await self._guard(f"flow {self.flow_id}", steps(), self.outputs.values())
        graph = self.session.graph
        failed = next((graph.variables[v] for v in self.outputs.values()
                       if graph.variables[v].status is VarStatus.FAILED), None)
        self.status = FlowStatus.FAILED if failed is not None else FlowStatus.FINISHED
        self.error = failed.error if failed is not None else None
        self.env.stats.flow_ended(self.status.value)
        self._event(self.flow_id, self.status.value, "" if failed is None else failed.error.cause_code)

    def _event(self, path: str, event: str, detail: str = "") -> None:
        ev = FlowEvent(self.env.clock(), path, event, detail)
        if len(self.events) < MAX_EVENTS:
            self.events.append(ev)
        self.env.on_event(self, ev)

    async def _guard(self, what: str, coro: Awaitable[None], outs: Iterable[str]) -> None:
        """Await ``coro``; if it raises -- a session limit (nodes, bytes) reached while making nodes, or a bug --
        ``outs`` fail with the reason instead of leaving their readers waiting."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except ParrotError as e:
            logger.info("%s failed: %s", what, e.message)
            self._fail(outs, f"{what} failed: {e.code}: {e.message}", _cause(e))
        except Exception as e:
            logger.exception("%s crashed", what)
            self._fail(outs, f"{what} failed: internal error {type(e).__name__}: {e}", "internal_error")

    def _spawn(self, origin: str, coro: Awaitable[None], outs: Iterable[str]) -> None:
        """Run a step's coroutine as a task of this flow (cancelled with it), guarded (see _guard)."""
        task = asyncio.create_task(self._guard(f"flow step {origin}", coro, tuple(outs)),
                                   name=f"{self.session.session_id}/{origin}")
        self._tasks[origin] = task
        task.add_done_callback(lambda t: self._tasks.pop(origin, None) if self._tasks.get(origin) is t else None)

    # ---- nodes ------------------------------------------------------------------------------------------------
    def _var(self, origin: str, name: str, *, tool: ToolDecl | None = None, client_tool: bool = False) -> Variable:
        graph = self.session.graph
        vid = graph.by_origin.get(origin)
        if vid is not None:
            return graph.variables[vid]
        return graph.add_variable(name, tool=tool, origin=origin, client_tool=client_tool)

    async def _values(self, var_ids: Iterable[str]) -> dict[str, str]:
        """var id -> value once all are ready; _InputFailed for the first failed one."""
        graph = self.session.graph
        out: dict[str, str] = {}
        for vid in var_ids:
            var = graph.variables[vid]
            await var.wait()
            if var.status is VarStatus.FAILED:
                raise _InputFailed(var)
            out[vid] = var.value or ""
        return out

    def _fail(self, var_ids: Iterable[str], message: str, cause: str) -> None:
        for vid in var_ids:
            self.env.executor.fail_free_variable(self.session, vid, StepFailed(message, cause_code=cause))

    def _failed_input(self, var_ids: Iterable[str], origin: str, e: _InputFailed) -> None:
        assert e.var.error is not None
        self._fail(var_ids, f"flow step {origin} not run: its input {e.var.name or e.var.var_id!r} failed: "
                            f"{e.var.error.message}", e.var.error.cause_code)

    async def _alias(self, src_id: str, dst_id: str) -> None:
        """Give ``dst`` (an exported name) the value or the error of ``src`` once it has one."""
        graph = self.session.graph
        src, dst = graph.variables[src_id], graph.variables[dst_id]
        await src.wait()
        if dst.done:
            return
        if src.status is VarStatus.READY:
            self.env.executor.materialize_free(self.session, dst_id, src.value or "", generated=src.generated)
        else:
            assert src.error is not None
            self.env.executor.fail_free_variable(self.session, dst_id, StepFailed(
                src.error.message, cause_code=src.error.cause_code))

    # ---- blocks and leaves ------------------------------------------------------------------------------------
    def _block(self, block: Block, scope: Scope, prefix: str, loop: _LoopAt | None = None) -> None:
        """Make (or find) every step of ``block`` now; each runs as its values become ready. ``loop``: the loop
        iteration the block is (part of) the body of."""
        for i, step in enumerate(block.steps):
            origin = f"{prefix}/{i}.{_kind(step)}"
            if isinstance(step, GenerateStep):
                self._generate(step, scope, origin, self._lookahead(block, i, step, loop))
            elif isinstance(step, TextStep):
                var = self._var(origin, step.output)
                scope.define(step.output, var.var_id)
                ids = {n: scope.lookup(n) for n in step.inputs}
                self._texts[var.var_id] = (tuple(parse_template(step.template)), ids)
                if not var.done:
                    self._spawn(origin, self._text(step, ids, var.var_id, origin), [var.var_id])
            elif isinstance(step, ToolStep):
                self._tool(step, scope, origin)
            else:
                names = (step.into,) if isinstance(step, MapStep) else step.outputs
                outs = {n: self._var(f"{origin}:{n}", n).var_id for n in names}
                for n, vid in outs.items():
                    scope.define(n, vid)
                pending = [vid for vid in outs.values() if not self.session.graph.variables[vid].done]
                if not pending:
                    continue
                run = (self._branch if isinstance(step, BranchStep) else self._loop if isinstance(step, LoopStep)
                       else self._map)
                self._spawn(origin, run(step, scope, origin, outs, loop), outs.values())  # type: ignore[arg-type]

    def _lookahead(self, block: Block, i: int, step: GenerateStep, loop: _LoopAt | None) -> Lookahead | None:
        """What the flow expects after generate ``step`` (``block.steps[i]``): the first later step of its block
        that calls a tool on its output (directly, or in a branch case), and the iterations its loop is expected
        to run after this one (the loop's recent runs; its max_steps before the first)."""
        outs = set(step.outputs)
        tool = next((t for later in block.steps[i + 1:] if (t := tool_reading(later, outs)) is not None), None)
        later = 0 if loop is None else max(0, self.env.profile.expected_iterations(loop.key, loop.max_steps)
                                           - loop.iteration - 1)
        if tool is None and later == 0:
            return None
        decl = None if tool is None else ToolDecl(tool.name, (), tool.expected_duration_s)
        return Lookahead(decl, later, None if loop is None else loop.return_tokens, self.started_at)

    def _generate(self, step: GenerateStep, scope: Scope, origin: str, lookahead: Lookahead | None = None) -> None:
        graph = self.session.graph
        rid = graph.by_origin.get(origin)
        if rid is None:
            segments, bindings = build_bindings(step.spec)
            bound = [PlaceholderBinding(b.name, b.is_output, None if b.is_output else scope.lookup(b.name),
                                        b.sampling, b.transforms) for b in bindings]
            segments, bound = inline_texts(segments, bound, self._texts)
            req = self.env.add_request(self.session, step.spec.name, segments, bound, step.spec.models, origin,
                                       lookahead)
        else:
            req = graph.requests[rid]
        for b in req.bindings.values():
            if b.is_output:
                scope.define(b.name, b.var_id)

    async def _text(self, step: TextStep, ids: dict[str, str], out: str, origin: str) -> None:
        try:
            values = await self._values(ids.values())
        except _InputFailed as e:
            self._failed_input([out], origin, e)
            return
        text = render_template(parse_template(step.template), {n: values[v] for n, v in ids.items()})
        try:
            self.env.executor.materialize_free(self.session, out, text)
        except ParrotError as e:  # over the session's byte budget
            self._fail([out], f"flow step {origin}: {e.message}", e.code)

    def _tool(self, step: ToolStep, scope: Scope, origin: str) -> None:
        refs = {p: scope.lookup(a.ref) for p, a in step.args.items() if a.ref is not None}
        decl = ToolDecl(step.name, tuple(dict.fromkeys(refs.values())), step.expected_duration_s)
        var = self._var(origin, step.output, tool=decl, client_tool=step.runs == "client")
        scope.define(step.output, var.var_id)
        if not var.done:
            self._spawn(origin, self._run_tool(step, refs, var.var_id, origin), [var.var_id])

    async def _run_tool(self, step: ToolStep, refs: dict[str, str], out: str, origin: str) -> None:
        try:
            values = await self._values(refs.values())
        except _InputFailed as e:
            self._failed_input([out], origin, e)
            return
        args = {p: (values[refs[p]] if a.ref is not None else a.value or "") for p, a in step.args.items()}
        if step.runs == "server":
            try:
                result = await asyncio.wait_for(asyncio.to_thread(SERVER_TOOLS[step.name].run, args),
                                                SERVER_TOOL_TIMEOUT_S)
            except (TimeoutError, ToolError) as e:
                message = str(e) or f"took over {SERVER_TOOL_TIMEOUT_S:g} s"
                self._tool_error(step, out, origin, message)
                return
            self.env.executor.materialize_free(self.session, out, result)
            return
        var = self.session.graph.variables[out]
        if var.done:  # answered (or failed) before its arguments were ready: nothing to ask
            return
        self.env.calls.offer(ToolCall(out, step.name, args, self.flow_id, step.on_error))
        try:
            await asyncio.wait_for(var.wait(), self.env.tool_timeout_s)
        except TimeoutError:
            self.env.calls.withdraw(out)
            self._fail([out], f"flow step {origin}: client tool {step.name!r} was not answered within "
                              f"{self.env.tool_timeout_s:g} s (is a worker serving it?)", "tool_timeout")

    def _tool_error(self, step: ToolStep, out: str, origin: str, message: str) -> None:
        if step.on_error == "value":
            self.env.executor.materialize_free(self.session, out, f"error: {message}")
        else:
            self._fail([out], f"flow step {origin}: tool {step.name!r} failed: {message}", "tool_failed")

    # ---- control flow -----------------------------------------------------------------------------------------
    async def _branch(self, step: BranchStep, scope: Scope, origin: str, outs: dict[str, str],
                      loop: _LoopAt | None = None) -> None:
        names = list(dict.fromkeys(n for c in step.cases for n in c.when.names()))
        ids = {n: scope.lookup(n) for n in names}
        graph = self.session.graph
        key = f"{self.spec.name}/{step.name}"
        speculated: tuple[int, Scope] | None = None
        if self.speculate and not all(graph.variables[v].done for v in ids.values()):
            likely = self.env.profile.likely(key, self.env.speculation_min_runs, self.env.speculation_min_prob)
            if likely is not None:
                block = step.cases[likely].block if likely < len(step.cases) else step.default
                if block is not None:
                    spec_scope = Scope(scope)
                    self._block(block, spec_scope, f"{origin}/case{likely}", loop)
                    speculated = (likely, spec_scope)
                    self._event(origin, "speculated", f"case {likely}")
        try:
            values = await self._values(ids.values())
        except _InputFailed as e:
            if speculated is not None:
                await self._drop(f"{origin}/case{speculated[0]}/", "its condition failed")
            self._failed_input(outs.values(), origin, e)
            return
        by_name = {n: values[v] for n, v in ids.items()}
        taken = next((i for i, c in enumerate(step.cases) if c.when.evaluate(by_name)), len(step.cases))
        self.env.profile.record(key, taken)
        self._event(origin, "branch", f"case {taken}")
        # every case but the taken one: the speculated one, and any speculated before a restart
        wasted = await self._drop(f"{origin}/case", f"case {taken} was taken", keep=f"{origin}/case{taken}/")
        if speculated is not None and speculated[0] != taken:
            self.env.stats.speculation(False, wasted)
            self._event(origin, "speculation_miss", f"case {speculated[0]}, {wasted} tokens wasted")
        if speculated is not None and speculated[0] == taken:
            self.env.stats.speculation(True, 0)
            self._event(origin, "speculation_hit", f"case {taken}")
            case_scope = speculated[1]
        else:
            block = step.cases[taken].block if taken < len(step.cases) else step.default
            if block is None:
                self._fail(outs.values(), f"flow step {origin}: no case matched ({json.dumps(by_name)[:200]}) and "
                                          "the branch has no default", "branch_no_match")
                return
            case_scope = Scope(scope)
            self._block(block, case_scope, f"{origin}/case{taken}", loop)
        await asyncio.gather(*(self._alias(case_scope.lookup(n), vid) for n, vid in outs.items()))

    async def _drop(self, prefix: str, why: str, *, keep: str | None = None) -> int:
        """Cancel every node made under ``prefix`` but not under ``keep`` (the cases not taken); returns the tokens
        their requests had generated (wasted: finished ones' and what in-flight ones had streamed when cancelled)."""
        def dropped(origin: str) -> bool:
            return origin.startswith(prefix) and not (keep is not None and origin.startswith(keep))

        for origin, task in list(self._tasks.items()):
            if dropped(origin):
                task.cancel()
        graph = self.session.graph
        wasted = 0
        err = StepFailed(f"flow branch case not taken ({why}): its speculated steps were cancelled",
                         cause_code="speculation_cancelled")
        for origin, node in list(graph.by_origin.items()):
            if not dropped(origin):
                continue
            if node in graph.requests:
                req = graph.requests[node]
                await self.env.executor.cancel_request(self.session, req, err)
                wasted += req.generated_tokens  # after the cancel: nothing more is generated
            elif not graph.variables[node].done:
                self.env.calls.withdraw(node)
                self.env.executor.fail_free_variable(self.session, node, err)
        return wasted

    async def _loop(self, step: LoopStep, scope: Scope, origin: str, outs: dict[str, str],
                    loop: _LoopAt | None = None) -> None:
        carried = {k: scope.lookup(src) for k, src in step.carry.items()}
        it_scope = Scope(scope, carried)
        key = f"{self.spec.name}/{step.name}"
        returned: int | None = None
        iterations = 0
        for it in range(step.max_steps):
            it_scope = Scope(scope, carried)
            iterations = it + 1
            self._block(step.block, it_scope, f"{origin}[{it}]", _LoopAt(key, step.max_steps, it, returned))
            ids = {n: it_scope.lookup(n) for n in step.until.names()}
            try:
                values = await self._values(ids.values())
            except _InputFailed as e:
                self._failed_input(outs.values(), f"{origin}[{it}]", e)
                return
            self.env.stats.iteration()
            done = step.until.evaluate({n: values[v] for n, v in ids.items()})
            self._event(f"{origin}[{it}]", "iteration", "until: true" if done else "until: false")
            if done:
                self._event(origin, "loop_done", f"{it + 1} iteration(s)")
                break
            carried = {k: it_scope.lookup(src) for k, src in step.next.items()}
            returned = self._tool_tokens(f"{origin}[")
        else:
            self._event(origin, "loop_max_steps", f"{step.max_steps} iteration(s), on_max {step.on_max}")
        self.env.profile.record_loop(key, iterations)
        if iterations == step.max_steps and not done and step.on_max == "error":
            self._fail(outs.values(), f"flow loop {origin} reached max_steps={step.max_steps} without its "
                                      "until condition", "loop_max_steps")
            return
        await asyncio.gather(*(self._alias(it_scope.lookup(n), vid) for n, vid in outs.items()))

    def _tool_tokens(self, prefix: str) -> int | None:
        """The mean tokens (estimated: CHARS_PER_TOKEN characters each) of the tool results made under ``prefix``
        (a loop's iterations) that are ready; None: none is yet."""
        graph = self.session.graph
        sizes = [len(var.value) for o, v in graph.by_origin.items() if o.startswith(prefix)
                 and (var := graph.variables.get(v)) is not None and var.tool is not None and var.value is not None]
        return -(-sum(sizes) // (CHARS_PER_TOKEN * len(sizes))) if sizes else None

    async def _map(self, step: MapStep, scope: Scope, origin: str, outs: dict[str, str],
                   loop: _LoopAt | None = None) -> None:
        out = outs[step.into]
        try:
            over = (await self._values([scope.lookup(step.over)]))
        except _InputFailed as e:
            self._failed_input([out], origin, e)
            return
        items = split_items(next(iter(over.values())), step.split)
        if items is None or len(items) > step.max_items:
            what = "is not a JSON array of strings" if items is None else f"has {len(items)} items"
            self._fail([out], f"flow map {origin}: {step.over!r} {what} (max_items {step.max_items})",
                       "map_bad_input")
            return
        self._event(origin, "map", f"{len(items)} item(s)")
        results: list[str] = []
        for k, item in enumerate(items):
            item_var = self._var(f"{origin}[{k}]:{step.item}", step.item)
            if not item_var.done:
                self.env.executor.materialize_free(self.session, item_var.var_id, item)
            item_scope = Scope(scope, {step.item: item_var.var_id})
            self._block(step.block, item_scope, f"{origin}[{k}]", loop)
            results.append(item_scope.lookup(step.output))
        try:
            values = await self._values(results)
        except _InputFailed as e:
            self._failed_input([out], origin, e)
            return
        self.env.executor.materialize_free(self.session, out, step.join.join(values[v] for v in results))


def _cause(e: ParrotError) -> str:
    return e.cause_code if isinstance(e, StepFailed) else e.code


def _kind(step: Step) -> str:
    return {GenerateStep: "generate", TextStep: "text", ToolStep: "tool", BranchStep: "branch", LoopStep: "loop",
            MapStep: "map"}[type(step)]
