"""Flows: branches and loops run by the server (docs/flows.md), written as ordinary Python and traced once.

::

    @P.semantic_function(max_tokens=8, choice=["billing", "tech", "other"])
    def classify(msg: P.SemanticVariable):
        '''Classify the message: {{input:msg}}
        Label: {{output:label}}'''

    label = classify(msg)
    reply = P.branch(label, cases={"billing": lambda: billing(msg), "tech": lambda: tech(msg)},
                     default=lambda: other(msg))            # one submission; the server picks the case

    def step(history):                                        # a loop body: carried values as keywords
        thought, action = think(history)
        obs = P.tool("calculator", expression=action)
        return {"history": P.text("{{input:h}}{{input:t}}\\nObservation: {{input:o}}\\n", h=history, t=thought,
                                  o=obs), "answer": thought}

    out = P.loop(step, carry={"history": prompt}, until=lambda o: o["answer"].contains("Final Answer"),
                 max_steps=8, on_max="last")                # out["answer"]: a SemanticVariable

**Tracing.** ``P.flow(fn, *args)`` (and ``P.branch`` / ``P.loop`` / ``P.map`` / ``P.text`` / ``P.tool`` called at
top level) calls the Python bodies exactly once with symbolic :class:`FlowVar` values, inside an active *tracer*
(per thread). While a tracer is active, a semantic function call records a ``generate`` step, a native function
declared with ``tool=`` records a client ``tool`` step (its Python runs later in this process, answering the
server's tool calls), and the constructs record their steps; nothing is sent until the trace ends, then the whole
flow is one ``POST .../flows``. Values entering the flow (SemanticVariables, strings) become its ``inputs``: the
string arguments of generate / text steps become new session variables, the string arguments of tool steps are
sent as literals (``{"value": ...}``).

**Invariants.** Every scope name is fresh (``<base>_<n>``, unique in the flow), so single assignment holds by
construction. Names are boxes (:class:`_Name`) until serialization: a branch renames the value a case defines to
the branch's output name instead of copying it; a value a body did not define itself (an input, an enclosing
name, a carried value, a literal) is copied by a one-input ``text`` step. A FlowVar is usable only in the block
that defined it and in blocks nested in it (checked at trace time, TemplateError).

**Client tools.** A flow with client tool steps starts (lazily, once per session) a daemon worker thread that
long-polls ``GET .../tool_calls``, runs the native function's Python on the call's string args in the session's
native pool and PUTs the value (or POSTs the error). It ends once the session is closed.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from parrot.common.errors import TemplateError
from parrot.common.template import TextSegment, parse_template
from parrot.frontend.client import Session, resolve_session
from parrot.frontend.conditions import Cond, ConditionMethods
from parrot.frontend.function import SemanticFunction
from parrot.frontend.native import NativeFunction
from parrot.frontend.tool_worker import flow_status, submit_flow, worker_for
from parrot.frontend.variable import SemanticVariable

log = logging.getLogger(__name__)

FLOW_POLL_S = 0.2  # FlowRun.wait's status poll
_OPS = ("==", "!=", "<", "<=", ">", ">=")
_SPLITS = ("lines", "json_array")
_ON_MAX = ("error", "last")
_ON_ERROR = ("fail", "value")


class _Name:
    """A mutable box holding a scope name until serialization (a branch may rename what its case defines)."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value


class _Block:
    """A list of steps with its own scope (the flow, a branch case, a loop or map body)."""

    def __init__(self, parent: _Block | None, kind: str) -> None:
        self.parent, self.kind, self.steps = parent, kind, []  # type: ignore[var-annotated]

    def encloses(self, other: _Block) -> bool:
        b: _Block | None = other
        while b is not None:
            if b is self:
                return True
            b = b.parent
        return False


class FlowVar(ConditionMethods):
    """A symbolic value of the flow being traced: a scope name. Pass it to semantic functions, tools and
    constructs, or build conditions from it; it has no value (``get`` raises), and no truth value."""

    def __init__(self, tracer: _Tracer, name: _Name, block: _Block, base: str, *, by_step: bool = True) -> None:
        self._tracer, self._name, self._block, self.base = tracer, name, block, base
        self._by_step = by_step  # defined by a step of its block (not an input, carried value or map item)

    @property
    def name(self) -> str:
        return self._name.value

    @property
    def scope_name(self) -> str:
        """Its name in the flow's scope (what a condition on it refers to)."""
        return self._name.value

    def get(self, *args: Any, **kwargs: Any) -> str:
        raise TypeError(f"{self!r} is symbolic (a flow is being traced): its value exists on the server once the "
                        "flow runs; read the SemanticVariables P.flow / P.branch / P.loop return")

    def __bool__(self) -> bool:
        raise TypeError(f"{self!r} has no truth value while tracing: use a condition (v.equals(...), "
                        "v.contains(...)) with P.branch / P.loop(until=...)")

    def __repr__(self) -> str:
        return f"FlowVar({self.name})"


Shape = Any  # a FlowVar, a tuple/list of them, a dict of them, or None


def _flatten(result: Shape, what: str) -> tuple[Any, list[tuple[Any, Any]]]:
    """(shape key, [(position key, value)]) of a body's result; TypeError for anything else."""
    if isinstance(result, (FlowVar, SemanticVariable, str)):
        return ("one",), [(None, result)]
    if isinstance(result, (tuple, list)):
        return ("seq", len(result)), list(enumerate(result))
    if isinstance(result, Mapping):
        if not all(isinstance(k, str) for k in result):
            raise TypeError(f"{what} returned a dict with non-str keys: {list(result)!r}")
        return ("dict", tuple(result)), list(result.items())
    if result is None:
        return ("none",), []
    raise TypeError(f"{what} must return a FlowVar, a tuple or a dict of them, got {type(result).__name__}")


def _rebuild(shape: Any, values: list[Any]) -> Shape:
    if shape[0] == "one":
        return values[0]
    if shape[0] == "seq":
        return tuple(values)
    if shape[0] == "dict":
        return dict(zip(shape[1], values))
    return None


def _base(name: str | None) -> str:
    b = re.sub(r"[^A-Za-z0-9_]", "_", name or "v")[:48] or "v"
    return b if re.match(r"[A-Za-z_]", b) else f"v_{b}"[:48]


# ---- the tracer ---------------------------------------------------------------------------------------------------------
class _Tracer:
    """Records the steps of one flow while its Python bodies run (see the module docstring)."""

    def __init__(self) -> None:
        self.root = _Block(None, "flow")
        self.block = self.root
        self.inputs: list[tuple[_Name, SemanticVariable]] = []
        self._input_of: dict[Any, FlowVar] = {}  # id(SemanticVariable) or ("str", text) -> its input FlowVar
        self.client_tools: dict[str, NativeFunction] = {}
        self._counter = itertools.count(1)

    # names and scopes
    def fresh(self, base: str | None) -> _Name:
        return _Name(f"{_base(base)}_{next(self._counter)}")

    def define(self, base: str | None, **kw: Any) -> FlowVar:
        return FlowVar(self, self.fresh(base), self.block, _base(base), **kw)

    @contextlib.contextmanager
    def nested(self, kind: str) -> Iterator[_Block]:
        block = self.block = _Block(self.block, kind)
        try:
            yield block
        finally:
            self.block = block.parent  # type: ignore[assignment]

    def var(self, value: Any, what: str, base: str | None = None) -> FlowVar:
        """The FlowVar of a value used here: a visible FlowVar, or a flow input (SemanticVariable, str; ``base``
        names a new input after the parameter it is passed to). One input per SemanticVariable / distinct str."""
        if isinstance(value, FlowVar):
            if value._tracer is not self:
                raise TypeError(f"{what}: {value!r} belongs to another flow (FlowVars live in the flow traced "
                                "when they were made)")
            if not value._block.encloses(self.block):
                raise TemplateError(f"{what}: {value!r} is defined inside a {value._block.kind} and is not visible "
                                    "here: return it from that body to use it outside", param=value.name)
            return value
        if isinstance(value, SemanticVariable):
            key: Any = id(value)
        elif isinstance(value, str):
            key = ("str", value)
        else:
            raise TypeError(f"{what}: expected a FlowVar, SemanticVariable or str, got {type(value).__name__}")
        if key not in self._input_of:
            sv = value if isinstance(value, SemanticVariable) else SemanticVariable(value, name=base or "input")
            label = sv.name or base or "input"
            fv = FlowVar(self, self.fresh(label), self.root, _base(label), by_step=False)
            self.inputs.append((fv._name, sv))
            self._input_of[key] = fv
        return self._input_of[key]

    def ref(self, value: Any, what: str, base: str | None = None) -> _Name:
        return self.var(value, what, base)._name

    def cond(self, c: Any, what: str) -> dict:
        if not isinstance(c, Cond):
            raise TypeError(f"{what}: expected a condition (v.equals(...), v.contains(...), ...), got {c!r}")
        return c.to_dict(lambda operand: self.ref(operand, what))

    def add(self, kind: str, spec: dict) -> None:
        self.block.steps.append({kind: spec})

    def defined_here(self, value: Any, block: _Block) -> bool:
        return isinstance(value, FlowVar) and value._tracer is self and value._block is block and value._by_step

    def copy(self, value: Any, base: str, what: str) -> FlowVar:
        """A new name of the current block holding ``value`` (a one-input ``text`` step)."""
        src = self.ref(value, what)
        out = self.define(base)
        self.add("text", {"template": _Template([("input", src)]), "output": out._name})
        return out

    def own(self, value: Any, block: _Block, taken: set[int], base: str, what: str) -> FlowVar:
        """``value`` as a name defined by a step of ``block`` (the current one): itself, or a copy when it is
        not defined here or was already used for another output (``taken``)."""
        if self.defined_here(value, block) and id(value._name) not in taken:
            taken.add(id(value._name))
            return value
        out = self.copy(value, base, what)
        taken.add(id(out._name))
        return out

    # steps
    def generate(self, fn: SemanticFunction, args: tuple, kwargs: dict) -> FlowVar | tuple[FlowVar, ...]:
        try:
            bound = fn.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{fn.name}(): {e}") from None
        bound.apply_defaults()
        configs = {o.name: o for o in fn.outputs}
        parts: list[Any] = []
        sampling: dict[_Name, dict] = {}
        transforms: dict[_Name, list] = {}
        outs: list[FlowVar] = []
        for seg in fn.segments:
            if isinstance(seg, TextSegment):
                parts.append(seg.text)
            elif seg.is_output:
                out, cfg = self.define(seg.name), configs[seg.name]
                outs.append(out)
                parts.append(("output", out._name))
                sampling[out._name] = cfg.sampling.to_dict()
                if cfg.transforms:
                    transforms[out._name] = [t.to_spec() for t in cfg.transforms]
            else:
                parts.append(("input", self.ref(bound.arguments[seg.name], f"{fn.name}({seg.name}=)", seg.name)))
        spec: dict[str, Any] = {"prompt": _Template(parts), "name": fn.name, "sampling": sampling}
        if transforms:
            spec["transforms"] = transforms
        if fn.models:
            spec["models"] = list(fn.models)
        self.add("generate", spec)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def text(self, template: str, values: Mapping[str, Any]) -> FlowVar:
        segments = parse_template(template)
        names = [s.name for s in segments if not isinstance(s, TextSegment)]
        if any(not isinstance(s, TextSegment) and s.is_output for s in segments):
            raise TemplateError("P.text() templates take only {{input:NAME}} placeholders", param="template")
        missing, extra = sorted(set(names) - set(values)), sorted(set(values) - set(names))
        if missing or extra:
            raise TemplateError(f"P.text(): placeholders {names} need exactly one keyword each"
                                + (f"; missing {missing}" if missing else "") + (f"; unused {extra}" if extra else ""),
                                param=(missing or extra)[0])
        parts = [s.text if isinstance(s, TextSegment) else ("input", self.ref(values[s.name], f"P.text({s.name}=)", s.name))
                 for s in segments]
        out = self.define("text")
        self.add("text", {"template": _Template(parts), "output": out._name})
        return out

    def tool(self, name: str, args: Mapping[str, Any], *, runs: str, on_error: str,
             expected_duration_s: float | None, base: str) -> FlowVar:
        if on_error not in _ON_ERROR:
            raise TypeError(f"tool {name!r}: on_error must be one of {_ON_ERROR}, got {on_error!r}")
        wire_args = {p: self.tool_arg(v, f"tool {name}({p}=)") for p, v in args.items()}
        out = self.define(base)
        spec: dict[str, Any] = {"name": name, "args": wire_args, "output": out._name, "runs": runs,
                                "on_error": on_error}
        if expected_duration_s is not None:
            spec["expected_duration_s"] = float(expected_duration_s)
        self.add("tool", spec)
        return out

    def tool_arg(self, value: Any, what: str) -> Any:
        if isinstance(value, str):
            return {"value": value}
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"value": str(value)}
        return self.ref(value, what, "arg")

    def client_tool(self, nf: NativeFunction, args: tuple, kwargs: dict) -> FlowVar:
        if nf.tool is None:
            raise TypeError(f"native function {nf.name!r} is called in a flow: declare it a tool "
                            "(@P.native_function(tool=\"name\")) so the server can hand its calls to this client")
        if len(nf.output_names) != 1:
            raise TypeError(f"native function {nf.name!r}: a flow tool has one output, it declares "
                            f"{list(nf.output_names)}")
        try:
            bound = nf.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{nf.name}(): {e}") from None
        known = self.client_tools.setdefault(nf.tool, nf)
        if known.fn is not nf.fn:
            raise TypeError(f"tool name {nf.tool!r} names two native functions ({known.name}, {nf.name})")
        return self.tool(nf.tool, dict(bound.arguments), runs="client", on_error="fail",
                         expected_duration_s=nf.expected_duration_s, base=nf.name)

    def branch(self, var: Any, cases: Any, default: Callable[[], Shape] | None, name: str | None) -> Shape:
        pairs = _case_pairs(var, cases)
        bname = name or f"branch_{next(self._counter)}"
        traced: list[tuple[dict | None, _Block, Shape]] = []
        for cond, fn in pairs + ([(None, default)] if default is not None else []):
            when = None if cond is None else self.cond(cond, f"branch {bname!r}")
            if not callable(fn):
                raise TypeError(f"branch {bname!r}: a case is a function of no arguments, got {fn!r}")
            with self.nested(f"branch {bname!r} case") as block:
                traced.append((when, block, fn()))
        shapes = [_flatten(r, f"branch {bname!r} case") for _, _, r in traced]
        if any(s[0] != shapes[0][0] for s in shapes):
            raise TemplateError(f"branch {bname!r}: every case must return the same shape (one value, a tuple of "
                                f"the same length, a dict with the same keys); got {[s[0] for s in shapes]}",
                                param=bname)
        first = shapes[0][1]
        outs = [self.fresh(k if isinstance(k, str) else getattr(v, "base", "out")) for k, v in first]
        wire_cases, default_steps = [], None
        for (when, block, _), (_, items) in zip(traced, shapes):
            taken: set[int] = set()
            with self._reentered(block):
                for out, (_, value) in zip(outs, items):
                    own = self.own(value, block, taken, out.value, f"branch {bname!r}")
                    own._name.value = out.value  # the case defines the branch's output name itself
            if when is None:
                default_steps = block.steps
            else:
                wire_cases.append({"when": when, "steps": block.steps})
        spec: dict[str, Any] = {"name": bname, "cases": wire_cases}
        if default_steps is not None:
            spec["default"] = default_steps
        spec["outputs"] = list(outs)
        self.add("branch", spec)
        return _rebuild(shapes[0][0], [FlowVar(self, _Name(o.value), self.block, _base(o.value)) for o in outs])

    @contextlib.contextmanager
    def _reentered(self, block: _Block) -> Iterator[None]:
        saved, self.block = self.block, block
        try:
            yield
        finally:
            self.block = saved

    def loop(self, body: Callable[..., Mapping[str, Any]], carry: Mapping[str, Any], until: Any, max_steps: int,
             on_max: str, name: str | None) -> dict[str, FlowVar]:
        lname = name or f"loop_{next(self._counter)}"
        where = f"loop {lname!r}"
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise TypeError(f"{where}: max_steps must be an int >= 1, got {max_steps!r}")
        if on_max not in _ON_MAX:
            raise TypeError(f"{where}: on_max must be one of {_ON_MAX}, got {on_max!r}")
        if not isinstance(carry, Mapping) or not carry:
            raise TypeError(f"{where}: carry must be a non-empty dict {{name: initial value}}")
        init = {k: self.ref(v, f"{where} carry[{k!r}]", k) for k, v in carry.items()}
        with self.nested(f"loop {lname!r} body") as block:
            carried = {k: self.define(k, by_step=False) for k in carry}
            result = body(**carried)
            if not isinstance(result, Mapping) or not all(isinstance(k, str) for k in result):
                raise TypeError(f"{where}: the body must return a dict {{name: value}} (the carried names' next "
                                f"values plus any outputs), got {type(result).__name__}")
            missing = [k for k in carry if k not in result]
            if missing:
                raise TemplateError(f"{where}: the body must return every carried name; missing {missing}",
                                    param=missing[0])
            taken: set[int] = set()
            body_vars = {k: self.own(v, block, taken, k, f"{where} result[{k!r}]") for k, v in result.items()}
            cond = until(dict(body_vars)) if callable(until) else until
            when = self.cond(cond, f"{where} until")
        self.add("loop", {"name": lname, "carry": {carried[k]._name: init[k] for k in carry}, "steps": block.steps,
                          "next": {carried[k]._name: body_vars[k]._name for k in carry}, "until": when,
                          "max_steps": max_steps, "on_max": on_max,
                          "outputs": [v._name for v in body_vars.values()]})
        return {k: FlowVar(self, v._name, self.block, v.base) for k, v in body_vars.items()}

    def map(self, items: Any, body: Callable[[FlowVar], Any], split: str, join: str, max_items: int) -> FlowVar:
        if split not in _SPLITS:
            raise TypeError(f"P.map: split must be one of {_SPLITS}, got {split!r}")
        if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
            raise TypeError(f"P.map: max_items must be an int >= 1, got {max_items!r}")
        if not isinstance(join, str):
            raise TypeError(f"P.map: join must be a str, got {type(join).__name__}")
        over = self.ref(items, "P.map(items)", "items")
        with self.nested("map body") as block:
            item = self.define("item", by_step=False)
            result = body(item)
            if isinstance(result, (tuple, list, Mapping)):
                raise TypeError("P.map: the body returns one value per item (a FlowVar), got "
                                f"{type(result).__name__}")
            out = self.own(result, block, set(), "mapped", "P.map body")
        into = self.define("mapped")
        self.add("map", {"over": over, "split": split, "as": item._name, "steps": block.steps, "output": out._name,
                         "into": into._name, "join": join, "max_items": max_items})
        return into

    # the whole flow
    def finish(self, result: Shape, name: str) -> TracedFlow:
        """Close the trace: the result's values as names defined at top level (copied when they are not)."""
        shape, items = _flatten(result, f"flow {name!r}")
        taken: set[int] = set()
        outs = [self.own(v, self.root, taken, k if isinstance(k, str) else "out", f"flow {name!r} output")
                if not (isinstance(v, FlowVar) and id(v._name) in taken) else v for k, v in items]
        return TracedFlow(name=name, steps=self.root.steps, inputs=list(self.inputs), shape=shape,
                          outputs=outs, client_tools=dict(self.client_tools))


class _Template:
    """A template whose placeholders hold name boxes: ``parts`` are text or (kind, _Name)."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def render(self) -> str:
        return "".join(p if isinstance(p, str) else "{{" + f"{p[0]}:{p[1].value}" + "}}" for p in self.parts)


def _wire(obj: Any) -> Any:
    """The JSON of recorded steps: name boxes become their (final) names, templates their text."""
    if isinstance(obj, _Name):
        return obj.value
    if isinstance(obj, _Template):
        return obj.render()
    if isinstance(obj, dict):
        return {_wire(k): _wire(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_wire(v) for v in obj]
    return obj


def _case_pairs(var: Any, cases: Any) -> list[tuple[Cond, Callable[[], Shape]]]:
    """``cases`` as (condition, function) pairs: a str key means ``var.equals(key)``."""
    items = list(cases.items()) if isinstance(cases, Mapping) else list(cases)
    if not items:
        raise TypeError("P.branch needs at least one case")
    pairs = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"P.branch: a case is (condition or str, function), got {item!r}")
        key, fn = item
        if isinstance(key, str):
            if var is None:
                raise TypeError(f"P.branch: case {key!r} is a string (equals) but no variable was given")
            key = Cond("equals", var, {"value": key, "case_sensitive": False})
        elif not isinstance(key, Cond):
            raise TypeError(f"P.branch: a case key is a str or a condition, got {key!r}")
        pairs.append((key, fn))
    return pairs


# ---- traced and submitted flows -------------------------------------------------------------------------------------
@dataclass
class TracedFlow:
    """A traced flow, not yet submitted: :meth:`body` is its JSON (docs/flows.md), :meth:`submit` sends it."""

    name: str
    steps: list
    inputs: list[tuple[_Name, SemanticVariable]]
    shape: Any
    outputs: list[FlowVar]
    client_tools: dict[str, NativeFunction] = field(default_factory=dict)

    def body(self, input_ids: Mapping[str, str | None] | None = None, speculate: bool | None = None) -> dict:
        """The submission body; ``input_ids`` maps input names to var ids (missing: None, for inspection)."""
        ids = input_ids or {}
        body: dict[str, Any] = {"name": self.name, "inputs": {n.value: ids.get(n.value) for n, _ in self.inputs},
                                "steps": _wire(self.steps), "outputs": list(dict.fromkeys(v.name for v in self.outputs))}
        if speculate is not None:
            body["speculate"] = bool(speculate)
        return body

    def input_values(self) -> dict[str, SemanticVariable]:
        return {n.value: sv for n, sv in self.inputs}

    def submit(self, session: Session | None = None, speculate: bool | None = None) -> FlowRun:
        """Bind the inputs in the session, start the client-tool worker if needed, submit; returns at once."""
        s = resolve_session(session)
        ids = {n.value: sv._bind(s) for n, sv in self.inputs}
        if self.client_tools:
            worker_for(s).register(self.client_tools)
        answer = submit_flow(s, self.body(ids, speculate))
        inputs = tuple(sv for _, sv in self.inputs)
        svs = {n: SemanticVariable._semantic_output(n, s, vid, inputs, f"flow {self.name}")
               for n, vid in answer["outputs"].items()}
        outputs = _rebuild(self.shape, [svs[v.name] for v in self.outputs])
        log.info("flow %s (%s) submitted in session %s", answer["flow_id"], self.name, s.session_id)
        return FlowRun(s, answer["flow_id"], self.name, outputs)


@dataclass
class FlowRun:
    """A submitted flow: ``outputs`` has the shape the traced function returned (SemanticVariables)."""

    session: Session
    flow_id: str
    name: str
    outputs: Shape

    def status(self) -> dict:
        return flow_status(self.session, self.flow_id)

    def wait(self, timeout: float = 120.0) -> dict:
        """Poll the status until the flow is no longer running (TimeoutError after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st["status"] != "running":
                return st
            if time.monotonic() >= deadline:
                raise TimeoutError(f"flow {self.flow_id} still running after {timeout} s")
            time.sleep(FLOW_POLL_S)

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in self.status()["events"] if kind is None or e["event"] == kind]

    def iterations(self, status: Mapping[str, Any] | None = None) -> int:
        """Loop iterations run (the ``iteration`` events of every loop of the flow) in ``status`` (default: now)."""
        return sum(1 for e in (status or self.status())["events"] if e["event"] == "iteration")


# ---- the public constructs ----------------------------------------------------------------------------------------------
class _Active(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Tracer] = []


_active = _Active()


def _current() -> _Tracer | None:
    return _active.stack[-1] if _active.stack else None


@contextlib.contextmanager
def _tracing(tracer: _Tracer) -> Iterator[_Tracer]:
    _active.stack.append(tracer)
    try:
        yield tracer
    finally:
        _active.stack.pop()


def active_tracer(values: Iterable[Any]) -> _Tracer | None:
    """The active tracer if a call must be recorded (one is active, or a FlowVar is passed), else None."""
    current = _current()
    for v in values:
        if isinstance(v, FlowVar) and v._tracer is not current:
            raise TypeError(f"{v!r} is used outside the flow it belongs to (it is symbolic: use it inside the "
                            "body that traced it)")
    return current


def _construct(kind: str, name: str | None, session: Session | None, build: Callable[[_Tracer], Shape]) -> Shape:
    """Record a construct in the active flow, or (at top level) trace it alone and submit it as a one-step flow,
    returning SemanticVariables in the construct's shape."""
    tracer = _current()
    if tracer is not None:
        return build(tracer)
    tracer = _Tracer()
    with _tracing(tracer):
        result = build(tracer)
    return tracer.finish(result, name or kind).submit(session).outputs


def trace(fn: Callable[..., Shape], *args: Any, name: str | None = None, **kwargs: Any) -> TracedFlow:
    """Trace ``fn`` (called once with a FlowVar per argument: SemanticVariables and strings become flow inputs)
    into a :class:`TracedFlow` without submitting it."""
    tracer = _Tracer()
    fname = name or getattr(fn, "__name__", "flow")
    if fname == "<lambda>":
        fname = "flow"
    with _tracing(tracer):
        names = _param_names(fn, len(args))
        fargs = [tracer.var(a, f"flow {fname!r} argument {n}", n) for n, a in zip(names, args)]
        fkwargs = {k: tracer.var(v, f"flow {fname!r} argument {k!r}", k) for k, v in kwargs.items()}
        result = fn(*fargs, **fkwargs)
    return tracer.finish(result, _base(fname))


def _param_names(fn: Callable[..., Any], n: int) -> list[str]:
    """Names for ``n`` positional arguments of ``fn`` (its parameter names where it has them)."""
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(n)]


def flow(fn: Callable[..., Shape], *args: Any, name: str | None = None, speculate: bool | None = None,
         session: Session | None = None, **kwargs: Any) -> FlowRun:
    """Trace ``fn`` into one flow and submit it; returns a :class:`FlowRun` whose ``outputs`` are
    SemanticVariables shaped like ``fn``'s result. ``speculate`` overrides the server's --flow-speculation."""
    if _current() is not None:
        raise TypeError("P.flow inside a flow being traced: call the function directly instead")
    return trace(fn, *args, name=name, **kwargs).submit(session, speculate)


def branch(var: Any = None, cases: Mapping[str, Callable[[], Shape]] | Sequence[tuple[Any, Callable[[], Shape]]] = (),
           default: Callable[[], Shape] | None = None, *, name: str | None = None,
           session: Session | None = None) -> Shape:
    """Run the first case whose condition holds (str keys: ``var.equals(key)``; or (condition, fn) pairs), else
    ``default``. Each case is a function of no arguments returning a value, a tuple or a dict of values, the same
    shape in every case; the branch returns that shape. No match and no default: the outputs fail
    (``branch_no_match``)."""
    return _construct("branch", name, session, lambda t: t.branch(var, cases, default, name))


def loop(body: Callable[..., Mapping[str, Any]], *, carry: Mapping[str, Any], until: Any, max_steps: int,
         on_max: str = "error", name: str | None = None, session: Session | None = None) -> dict[str, Any]:
    """Run ``body`` until ``until`` holds, at most ``max_steps`` times.

    ``body(**carried)`` gets the carried values as keyword FlowVars (``carry`` gives their first values) and
    returns a dict: every carried name's next value plus any other names to export. ``until(out)`` (or a
    condition) is checked after each iteration on that dict. Returns the dict of the last iteration's values.
    ``on_max``: "error" fails the outputs (cause ``loop_max_steps``), "last" exports the last values."""
    return _construct("loop", name, session, lambda t: t.loop(body, carry, until, max_steps, on_max, name))


def map(items: Any, body: Callable[[FlowVar], Any], *, split: str = "lines", join: str = "\n",
        max_items: int = 32, session: Session | None = None) -> Any:
    """Run ``body(item)`` on every item of ``items`` (split by lines or as a JSON array), in parallel; the results
    joined with ``join``."""
    return _construct("map", None, session, lambda t: t.map(items, body, split, join, max_items))


def text(template: str, /, *, session: Session | None = None, **values: Any) -> Any:
    """A ``text`` step: ``template`` with ``{{input:NAME}}`` placeholders filled from the keywords."""
    return _construct("text", None, session, lambda t: t.text(template, values))


def tool(name: str, /, *, on_error: str = "fail", expected_duration_s: float | None = None,
         session: Session | None = None, **args: Any) -> Any:
    """A server tool step (``calculator``, ``search_text``, ``json_validate``, ``json_get``, ``regex_extract``;
    docs/flows.md). ``on_error="value"``: a failure becomes the value ``"error: <message>"``."""
    return _construct("tool", None, session, lambda t: t.tool(name, args, runs="server", on_error=on_error,
                                                                expected_duration_s=expected_duration_s,
                                                                base=name))
