"""A flow's declaration (docs/flows.md), parsed and checked at submission into plain typed steps.

Everything that can be known before a value exists is checked here, so a bad program is a 400 naming the step
(``param`` is the step path, e.g. ``steps[2].loop.steps[0].generate.prompt``) and never a half-started flow:

* every step has exactly one kind; names are scope names; a scope is single-assignment (a step may not define a
  name the scope or an enclosing one has) and a name is defined before it is read (steps run in dataflow order,
  but are declared in order);
* a branch's cases (and default) define every branch output; a loop carries every ``next`` name and has a
  ``max_steps`` within the server's limit; a map's body defines its ``output``;
* conditions read names visible where they are evaluated; ``equals`` on a ``choice``-constrained output names
  one of its options; a ``json`` path on a JSON-schema output exists in the schema;
* server tools exist and get their required arguments; generate templates and sampling validate as a submit's.

Scopes (what a step sees)::

    flow inputs ─┬─ steps of the flow ──────────────────────────── outputs exported to the session
                 ├─ branch case / default: its own names + all above; exports the branch outputs upward
                 ├─ loop body: carried names + its own names + all above; exports the loop outputs upward
                 └─ map body: the item name + its own names + all above; exports ``into`` (joined) upward
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from parrot.common.constraints import ConstraintKind
from parrot.common.errors import InvalidRequestError, ParrotError
from parrot.common.sampling import SamplingParams
from parrot.common.template import PlaceholderSegment, parse_template
from parrot.manager.flows.conditions import (
    Condition,
    Equals,
    Json,
    leaves,
    parse_condition,
    schema_has_path,
)
from parrot.manager.flows.server_tools import check_args
from parrot.manager.graph import TOOL_NAME
from parrot.manager.submit import PlaceholderSpec, SubmitSpec, build_bindings

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_STEPS_IN_SPEC = 256  # steps of one flow declaration, nested ones included
MAX_DEPTH = 8  # nesting of branches / loops / maps
MAX_MAP_ITEMS = 256
STEP_KINDS = ("generate", "text", "tool", "branch", "loop", "map")


@dataclass(frozen=True)
class Arg:
    """A tool argument: a scope name (``ref``) or a literal."""

    ref: str | None = None
    value: str | None = None


@dataclass(frozen=True)
class GenerateStep:
    path: str
    spec: SubmitSpec  # placeholders bound by scope name (var_id holds the scope name until instantiated)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    sampling: Mapping[str, SamplingParams]


@dataclass(frozen=True)
class TextStep:
    path: str
    template: str
    inputs: tuple[str, ...]
    output: str


@dataclass(frozen=True)
class ToolStep:
    path: str
    name: str
    args: Mapping[str, Arg]
    output: str
    runs: Literal["server", "client"]
    expected_duration_s: float | None
    on_error: Literal["fail", "value"]

    @property
    def refs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a.ref for a in self.args.values() if a.ref is not None))


@dataclass(frozen=True)
class Block:
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Case:
    when: Condition
    block: Block


@dataclass(frozen=True)
class BranchStep:
    path: str
    name: str
    cases: tuple[Case, ...]
    default: Block | None
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class LoopStep:
    path: str
    name: str
    carry: Mapping[str, str]  # carried name -> enclosing name giving its first value
    block: Block
    next: Mapping[str, str]  # carried name -> body name giving its next value
    until: Condition
    max_steps: int
    on_max: Literal["error", "last"]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class MapStep:
    path: str
    over: str
    split: Literal["lines", "json_array"]
    item: str
    block: Block
    output: str
    into: str
    join: str
    max_items: int


Step = GenerateStep | TextStep | ToolStep | BranchStep | LoopStep | MapStep


@dataclass(frozen=True)
class FlowSpec:
    name: str
    inputs: Mapping[str, str]  # scope name -> session var id
    block: Block
    outputs: tuple[str, ...]
    speculate: bool | None


def defined_names(step: Step) -> tuple[str, ...]:
    """The names ``step`` adds to its block's scope."""
    if isinstance(step, GenerateStep):
        return step.outputs
    if isinstance(step, (TextStep, ToolStep)):
        return (step.output,)
    if isinstance(step, MapStep):
        return (step.into,)
    return step.outputs


def _fail(msg: str, where: str) -> InvalidRequestError:
    return InvalidRequestError(msg, param=where)


def _obj(x: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    if not isinstance(x, dict):
        raise _fail(f"{where} must be an object, got {type(x).__name__}", where)
    missing = [k for k in required if k not in x]
    if missing:
        raise _fail(f"{where} needs {', '.join(repr(m) for m in missing)}", f"{where}.{missing[0]}")
    unknown = sorted(set(x) - set(required) - set(optional))
    if unknown:
        raise _fail(f"{where} has unknown field(s) {unknown} (known: {sorted(required + optional)})",
                    f"{where}.{unknown[0]}")
    return x


def _name(x: Any, where: str) -> str:
    if not isinstance(x, str) or not NAME.match(x):
        raise _fail(f"{where} must be a scope name (a letter or '_', then letters, digits, '_'; <= 64), got {x!r}",
                    where)
    return x


def _names(x: Any, where: str, *, nonempty: bool = True) -> tuple[str, ...]:
    if not isinstance(x, list) or (nonempty and not x):
        raise _fail(f"{where} must be a {'non-empty ' if nonempty else ''}list of scope names", where)
    names = tuple(_name(n, f"{where}[{i}]") for i, n in enumerate(x))
    if len(set(names)) != len(names):
        raise _fail(f"{where} lists a name twice: {list(names)}", where)
    return names


class _Parser:
    """One declaration's parse: counts steps, tracks the scopes and what produced each name (for the checks of
    conditions against constrained outputs)."""

    def __init__(self, max_loop_steps: int) -> None:
        self.max_loop_steps = max_loop_steps
        self.num_steps = 0
        self.produced_by: dict[str, SamplingParams] = {}  # scope name -> sampling of the generate producing it

    def block(self, steps: Any, where: str, visible: set[str], depth: int) -> tuple[Block, set[str]]:
        """Parse a list of steps seeing ``visible``; returns the block and the names its steps define."""
        if depth > MAX_DEPTH:
            raise _fail(f"{where}: branches, loops and maps nest at most {MAX_DEPTH} deep", where)
        if not isinstance(steps, list) or not steps:
            raise _fail(f"{where} must be a non-empty list of steps", where)
        scope = set(visible)
        defined: set[str] = set()
        out: list[Step] = []
        for i, raw in enumerate(steps):
            self.num_steps += 1
            if self.num_steps > MAX_STEPS_IN_SPEC:
                raise _fail(f"a flow declares at most {MAX_STEPS_IN_SPEC} steps", where)
            step = self.step(raw, f"{where}[{i}]", scope, depth)
            for n in defined_names(step):
                if n in scope:
                    raise _fail(f"{where}[{i}] defines {n!r}, which is already defined in its scope (a scope is "
                                "single-assignment)", f"{where}[{i}]")
                scope.add(n)
                defined.add(n)
            out.append(step)
        return Block(tuple(out)), defined

    def step(self, raw: Any, where: str, visible: set[str], depth: int) -> Step:
        if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in STEP_KINDS:
            kinds = list(raw) if isinstance(raw, dict) else type(raw).__name__
            raise _fail(f"{where} must be an object with exactly one of {', '.join(STEP_KINDS)}; got {kinds}", where)
        kind, body = next(iter(raw.items()))
        where = f"{where}.{kind}"
        return getattr(self, kind)(body, where, visible, depth)

    def _reads(self, names: Any, where: str, visible: set[str]) -> None:
        for n in names:
            if n not in visible:
                raise _fail(f"{where} reads {n!r}, which no earlier step, flow input or enclosing scope defines "
                            f"(visible: {sorted(visible)})", where)

    # ---- leaves -----------------------------------------------------------------------------------------------
    def generate(self, body: Any, where: str, visible: set[str], depth: int) -> GenerateStep:
        b = _obj(body, where, ("prompt",), ("name", "sampling", "transforms", "models"))
        prompt = b["prompt"]
        if not isinstance(prompt, str):
            raise _fail(f"{where}.prompt must be a string", f"{where}.prompt")
        sampling, transforms = b.get("sampling") or {}, b.get("transforms") or {}
        for field, val in (("sampling", sampling), ("transforms", transforms)):
            if not isinstance(val, dict):
                raise _fail(f"{where}.{field} must be an object keyed by placeholder name", f"{where}.{field}")
        models = b.get("models") or []
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise _fail(f"{where}.models must be a list of model names", f"{where}.models")
        name = b.get("name")
        if name is not None and (not isinstance(name, str) or not TOOL_NAME.match(name)):
            raise _fail(f"{where}.name must be 1..64 of a-z, A-Z, 0-9, '_', '-', '.'", f"{where}.name")
        try:
            segments = parse_template(prompt)
            holders = list(dict.fromkeys((s.name, s.is_output) for s in segments if isinstance(s, PlaceholderSegment)))
            for ph, _ in holders:
                _name(ph, f"{where}.prompt (placeholder)")
            unknown = sorted((set(sampling) | set(transforms)) - {n for n, _ in holders})
            if unknown:
                raise _fail(f"{where}: sampling / transforms for {unknown}, which are not placeholders of the prompt",
                            f"{where}.sampling")
            for ph, is_out in holders:
                if not is_out and ph in sampling:
                    raise _fail(f"{where}: input {ph!r} cannot have sampling", f"{where}.sampling")
            spec = SubmitSpec(prompt=prompt, models=tuple(models), name=name, placeholders=[
                PlaceholderSpec(ph, is_out, None if is_out else ph, sampling.get(ph) if is_out else None,
                                tuple(transforms.get(ph) or ())) for ph, is_out in holders])
            _, bindings = build_bindings(spec)  # the submit API's own checks (template, sampling, transforms)
        except ParrotError as e:
            raise _fail(f"{where}: {e.message}", f"{where}.{e.param or 'prompt'}") from None
        inputs = tuple(b.name for b in bindings if not b.is_output)
        outputs = tuple(b.name for b in bindings if b.is_output)
        self._reads(inputs, f"{where}.prompt", visible)
        samplings = {bd.name: bd.sampling for bd in bindings if bd.is_output and bd.sampling is not None}
        self.produced_by.update(samplings)
        return GenerateStep(where, spec, inputs, outputs, samplings)

    def text(self, body: Any, where: str, visible: set[str], depth: int) -> TextStep:
        b = _obj(body, where, ("template", "output"))
        if not isinstance(b["template"], str):
            raise _fail(f"{where}.template must be a string", f"{where}.template")
        try:
            segments = parse_template(b["template"])
        except ParrotError as e:
            raise _fail(f"{where}.template: {e.message}", f"{where}.template") from None
        holders = [s for s in segments if isinstance(s, PlaceholderSegment)]
        if any(s.is_output for s in holders):
            raise _fail(f"{where}.template may hold only {{{{input:NAME}}}} placeholders (it generates nothing)",
                        f"{where}.template")
        inputs = tuple(dict.fromkeys(s.name for s in holders))
        self._reads(inputs, f"{where}.template", visible)
        return TextStep(where, b["template"], inputs, _name(b["output"], f"{where}.output"))

    def tool(self, body: Any, where: str, visible: set[str], depth: int) -> ToolStep:
        b = _obj(body, where, ("name", "args", "output"), ("runs", "expected_duration_s", "on_error"))
        name, runs, on_error = b["name"], b.get("runs", "server"), b.get("on_error", "fail")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise _fail(f"{where}.name must be 1..64 of a-z, A-Z, 0-9, '_', '-', '.', got {name!r}", f"{where}.name")
        if runs not in ("server", "client"):
            raise _fail(f"{where}.runs must be 'server' or 'client', got {runs!r}", f"{where}.runs")
        if on_error not in ("fail", "value"):
            raise _fail(f"{where}.on_error must be 'fail' or 'value', got {on_error!r}", f"{where}.on_error")
        d = b.get("expected_duration_s")
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < 1e6):
            raise _fail(f"{where}.expected_duration_s must be a positive number", f"{where}.expected_duration_s")
        if not isinstance(b["args"], dict):
            raise _fail(f"{where}.args must be an object: parameter -> scope name or {{\"value\": literal}}",
                        f"{where}.args")
        args: dict[str, Arg] = {}
        for param, a in b["args"].items():
            w = f"{where}.args.{param}"
            if isinstance(a, str):
                self._reads([_name(a, w)], w, visible)
                args[param] = Arg(ref=a)
            elif isinstance(a, dict) and set(a) == {"value"} and isinstance(a["value"], str):
                args[param] = Arg(value=a["value"])
            else:
                raise _fail(f"{w} must be a scope name or {{\"value\": \"a literal string\"}}", w)
        if runs == "server":
            check_args(name, tuple(args), f"{where}.args")
        return ToolStep(where, name, args, _name(b["output"], f"{where}.output"), runs,
                        None if d is None else float(d), on_error)

    # ---- control flow -----------------------------------------------------------------------------------------
    def condition(self, raw: Any, where: str, visible: set[str]) -> Condition:
        cond = parse_condition(raw, where)
        self._reads(cond.names(), where, visible)
        for leaf in leaves(cond):
            sampling = self.produced_by.get(leaf.var)
            constraint = sampling.constraint if sampling is not None else None
            if constraint is None:
                continue
            if isinstance(leaf, Equals) and constraint.kind is ConstraintKind.CHOICE:
                options = json.loads(constraint.spec)
                match = [o for o in options if (o == leaf.value.strip() if leaf.case_sensitive
                                                else o.casefold() == leaf.value.strip().casefold())]
                if not match:
                    raise _fail(f"{where}: {leaf.var!r} is one of {options} (its choice constraint); "
                                f"{leaf.value!r} can never match", where)
            if isinstance(leaf, Json) and constraint.kind is ConstraintKind.JSON_SCHEMA and \
                    not schema_has_path(json.loads(constraint.spec), leaf.path):
                raise _fail(f"{where}: the JSON schema of {leaf.var!r} has no field at path "
                                f"{'.'.join(map(str, leaf.path))!r}", where)
        return cond

    def branch(self, body: Any, where: str, visible: set[str], depth: int) -> BranchStep:
        b = _obj(body, where, ("cases", "outputs"), ("default", "name"))
        outputs = _names(b["outputs"], f"{where}.outputs")
        if not isinstance(b["cases"], list) or not b["cases"]:
            raise _fail(f"{where}.cases must be a non-empty list of {{\"when\": COND, \"steps\": [...]}}",
                        f"{where}.cases")
        cases = []
        for i, c in enumerate(b["cases"]):
            w = f"{where}.cases[{i}]"
            c = _obj(c, w, ("when", "steps"))
            when = self.condition(c["when"], f"{w}.when", visible)
            cases.append(Case(when, self._exporting(c["steps"], f"{w}.steps", visible, depth, outputs)))
        default = None
        if b.get("default") is not None:
            default = self._exporting(b["default"], f"{where}.default", visible, depth, outputs)
        return BranchStep(where, self._label(b.get("name"), where), tuple(cases), default, outputs)

    def _exporting(self, steps: Any, where: str, visible: set[str], depth: int,
                   exports: tuple[str, ...]) -> Block:
        block, defined = self.block(steps, where, visible, depth + 1)
        missing = [n for n in exports if n not in defined]
        if missing:
            raise _fail(f"{where} does not define {missing}, which the enclosing step exports", where)
        return block

    def loop(self, body: Any, where: str, visible: set[str], depth: int) -> LoopStep:
        b = _obj(body, where, ("steps", "until", "outputs"), ("carry", "next", "max_steps", "on_max", "name"))
        if "max_steps" not in b:
            raise _fail(f"{where} has no max_steps: every loop needs a bound (1..{self.max_loop_steps})",
                        f"{where}.max_steps")
        n = b["max_steps"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_loop_steps:
            raise _fail(f"{where}.max_steps must be an integer in 1..{self.max_loop_steps} (the server's "
                        f"flow_max_steps), got {n!r}", f"{where}.max_steps")
        on_max = b.get("on_max", "error")
        if on_max not in ("error", "last"):
            raise _fail(f"{where}.on_max must be 'error' or 'last', got {on_max!r}", f"{where}.on_max")
        carry = b.get("carry") or {}
        nxt = b.get("next") or {}
        if not isinstance(carry, dict) or not isinstance(nxt, dict):
            raise _fail(f"{where}.carry and .next must be objects: carried name -> scope name", f"{where}.carry")
        for k, src in carry.items():
            _name(k, f"{where}.carry")
            self._reads([_name(src, f"{where}.carry.{k}")], f"{where}.carry.{k}", visible)
            if k in visible:
                raise _fail(f"{where}.carry: {k!r} is already defined in the enclosing scope", f"{where}.carry.{k}")
        if set(nxt) != set(carry):
            raise _fail(f"{where}.next must give the next value of every carried name: carried {sorted(carry)}, "
                        f"next {sorted(nxt)}", f"{where}.next")
        inner = visible | set(carry)
        block, defined = self.block(b["steps"], f"{where}.steps", inner, depth + 1)
        after = inner | defined
        for k, src in nxt.items():
            self._reads([_name(src, f"{where}.next.{k}")], f"{where}.next.{k}", after)
        until = self.condition(b["until"], f"{where}.until", after)
        outputs = _names(b["outputs"], f"{where}.outputs")
        bad = [o for o in outputs if o not in defined and o not in carry]
        if bad:
            raise _fail(f"{where}.outputs {bad} are not defined by the loop body or carried", f"{where}.outputs")
        return LoopStep(where, self._label(b.get("name"), where), dict(carry), block, dict(nxt), until, n, on_max,
                        outputs)

    def map(self, body: Any, where: str, visible: set[str], depth: int) -> MapStep:
        b = _obj(body, where, ("over", "as", "steps", "output", "into"), ("split", "join", "max_items"))
        over, item = _name(b["over"], f"{where}.over"), _name(b["as"], f"{where}.as")
        self._reads([over], f"{where}.over", visible)
        if item in visible:
            raise _fail(f"{where}.as: {item!r} is already defined in the enclosing scope", f"{where}.as")
        split, join, max_items = b.get("split", "lines"), b.get("join", "\n"), b.get("max_items", 32)
        if split not in ("lines", "json_array"):
            raise _fail(f"{where}.split must be 'lines' or 'json_array', got {split!r}", f"{where}.split")
        if not isinstance(join, str):
            raise _fail(f"{where}.join must be a string", f"{where}.join")
        if isinstance(max_items, bool) or not isinstance(max_items, int) or not 1 <= max_items <= MAX_MAP_ITEMS:
            raise _fail(f"{where}.max_items must be an integer in 1..{MAX_MAP_ITEMS}", f"{where}.max_items")
        output = _name(b["output"], f"{where}.output")
        block = self._exporting(b["steps"], f"{where}.steps", visible | {item}, depth, (output,))
        return MapStep(where, over, split, item, block, output, _name(b["into"], f"{where}.into"), join, max_items)

    @staticmethod
    def _label(name: Any, where: str) -> str:
        if name is None:
            return re.sub(r"^steps", "", where)
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise _fail(f"{where}.name must be 1..64 of a-z, A-Z, 0-9, '_', '-', '.'", f"{where}.name")
        return name


def parse_flow(body: Any, *, max_loop_steps: int) -> FlowSpec:
    """Parse and check a flow declaration (the JSON body of ``POST .../flows``); InvalidRequestError (400) names
    the first problem. Session variable ids in ``inputs`` are checked by the caller."""
    b = _obj(body, "flow", ("steps", "outputs"), ("name", "inputs", "speculate"))
    name = b.get("name") or "flow"
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise _fail(f"name must be 1..64 of a-z, A-Z, 0-9, '_', '-', '.', got {name!r}", "name")
    inputs = b.get("inputs") or {}
    if not isinstance(inputs, dict) or not all(isinstance(v, str) for v in inputs.values()):
        raise _fail("inputs must be an object: scope name -> variable id of the session", "inputs")
    for k in inputs:
        _name(k, "inputs")
    speculate = b.get("speculate")
    if speculate is not None and not isinstance(speculate, bool):
        raise _fail("speculate must be true, false or null", "speculate")
    parser = _Parser(max_loop_steps)
    block, defined = parser.block(b["steps"], "steps", set(inputs), 0)
    outputs = _names(b["outputs"], "outputs")
    bad = [o for o in outputs if o not in defined]
    if bad:
        raise _fail(f"outputs {bad} are not defined by the flow's steps", "outputs")
    return FlowSpec(name, dict(inputs), block, outputs, speculate)
