"""Semantic functions (paper §4.1, Fig. 7): a prompt template whose call submits one request to the server.

::

    @P.semantic_function(max_tokens=64)
    def write_code(task: P.SemanticVariable):
        '''You are an expert software engineer.
        Write python code of {{input:task}}.
        Code: {{output:code}}'''

    code = write_code("a snake game")    # submits now, returns the output variable at once

Everything is checked at definition time: the docstring template (dedented with ``inspect.cleandoc``), the
function parameters against the template inputs, the sampling parameters and the transform specs.

Default stop: an output that is followed by constant text stops where that text begins
(:func:`~parrot.common.template.default_stop`, the server's rule too). An explicit ``stop`` (even ``[]``)
replaces the default.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parrot.common.constraints import Constraint
from parrot.common.errors import BadSamplingParams, TemplateError
from parrot.common.sampling import SamplingParams
from parrot.common.template import PlaceholderSegment, Segment, default_stop, input_names, parse_template, placeholders
from parrot.common.transforms import Transform, validate_transforms
from parrot.frontend.client import Session, resolve_session
from parrot.frontend.variable import SemanticVariable

RESERVED_PARAMS = frozenset({"session"})


# every SamplingParams field, optional: None = not set here (a new sampling field appears in Output by itself)
_OptionalSampling = dataclasses.make_dataclass(
    "_OptionalSampling", [(f.name, f"{f.type} | None", dataclasses.field(default=None))
                          for f in dataclasses.fields(SamplingParams)],
    frozen=True, kw_only=True, namespace={"__module__": __name__})


@dataclass(frozen=True, kw_only=True)
class Output(_OptionalSampling):
    """Per-output settings: any :class:`~parrot.common.sampling.SamplingParams` field (``max_tokens``,
    ``temperature``, ``stop``, ...) plus ``transforms``. ``None`` fields fall back to the function-level
    defaults, then SamplingParams'.

    Structured output: at most one of ``json_schema`` (a JSON-schema dict, or a pydantic model class),
    ``regex``, ``choice`` (a list of strings) or ``grammar`` (Lark or GBNF) — shorthands for ``constraint``. The
    engine then only generates text the constraint accepts, so e.g. a ``json`` transform on a schema-constrained
    output always parses; an output that hits max_tokens first fails its step (ConstraintIncomplete)."""

    transforms: Sequence[Mapping | Transform] | None = None
    json_schema: Mapping[str, Any] | type | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def resolved_constraint(self) -> Constraint | None:
        """The one constraint these settings ask for (TemplateError naming the fields if several)."""
        given = {k: v for k, v in (("constraint", self.constraint), ("json_schema", self.json_schema),
                                   ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
                 if v is not None}
        if len(given) > 1:
            raise BadSamplingParams(f"an output takes one constraint; got {sorted(given)}", param=sorted(given)[1])
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, type):  # a pydantic model class
                if not hasattr(schema, "model_json_schema"):
                    raise BadSamplingParams(f"json_schema: {schema.__name__} is not a pydantic model class",
                                            param="json_schema")
                schema = schema.model_json_schema()
            return Constraint.json_schema(dict(schema))
        if self.regex is not None:
            return Constraint.regex(self.regex)
        if self.choice is not None:
            return Constraint.choice(list(self.choice))
        if self.grammar is not None:
            return Constraint.grammar(self.grammar)
        return self.constraint

    def merged_over(self, base: "Output") -> "Output":
        """This output's set fields over ``base``'s (a constraint set here replaces any constraint of ``base``)."""
        changes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        if changes.keys() & _CONSTRAINT_FIELDS:
            changes = {**dict.fromkeys(_CONSTRAINT_FIELDS), **changes}
        return dataclasses.replace(base, **changes)


_CONSTRAINT_FIELDS = frozenset({"constraint", "json_schema", "regex", "choice", "grammar"})


@dataclass(frozen=True)
class OutputConfig:
    """A resolved output: what the server gets in the submit's placeholder entry."""

    name: str
    sampling: SamplingParams
    transforms: tuple[Transform, ...]

    def to_placeholder(self, var_id: str | None = None) -> dict:
        return {"name": self.name, "is_output": True, "var_id": var_id, "sampling": self.sampling.to_dict(),
                "transforms": [t.to_spec() for t in self.transforms]}


def _resolve_output(segments: list[Segment], name: str, settings: Output) -> OutputConfig:
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(SamplingParams)
              if getattr(settings, f.name) is not None}
    constraint = settings.resolved_constraint()  # -> BadSamplingParams
    if constraint is not None:
        fields["constraint"] = constraint
    if "stop" not in fields and constraint is None:  # a constrained output ends with its grammar
        fields["stop"] = default_stop(segments, name)
    sampling = SamplingParams(**fields)  # validates -> BadSamplingParams
    transforms = tuple(validate_transforms(list(settings.transforms or [])))  # -> TransformSpecError
    return OutputConfig(name, sampling, transforms)


class SemanticFunction:
    """A template plus per-output configuration. Calling it submits a request and returns output futures."""

    def __init__(self, template: str, *, name: str = "semantic_function",
                 signature: inspect.Signature | None = None, defaults: Output = Output(),
                 outputs: Mapping[str, Output | Mapping] | None = None, models: Sequence[str] = ()) -> None:
        self.name = name
        self.template = template
        self.segments = parse_template(template)
        self._defaults = defaults
        self._overrides = {k: _as_output(v) for k, v in (outputs or {}).items()}
        self.models = tuple(models)
        holders = placeholders(self.segments)
        out_names = [p.name for p in holders if p.is_output]
        if not out_names:
            raise TemplateError(f"semantic function {name!r} has no {{{{output:NAME}}}} placeholder", param="prompt")
        inputs = input_names(self.segments)
        if signature is None:
            signature = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                           for n in inputs])
        self._check_signature(signature, inputs, out_names)
        self.signature = signature
        overrides = dict(outputs or {})
        unknown = sorted(set(overrides) - set(out_names))
        if unknown:
            raise TemplateError(f"semantic function {name!r}: outputs={unknown} are not output placeholders of "
                                f"its template (outputs: {out_names})", param="outputs")
        self.outputs: tuple[OutputConfig, ...] = tuple(
            _resolve_output(self.segments, n, _as_output(overrides.get(n, Output())).merged_over(defaults))
            for n in out_names)

    def _check_signature(self, sig: inspect.Signature, inputs: list[str], outputs: list[str]) -> None:
        where = f"semantic function {self.name!r}"
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TemplateError(f"{where}: *args/**kwargs parameter {p.name!r} not allowed; name each input",
                                    param=p.name)
            if p.name in RESERVED_PARAMS:
                raise TemplateError(f"{where}: parameter name {p.name!r} is reserved", param=p.name)
            if p.name in outputs:
                raise TemplateError(f"{where}: parameter {p.name!r} is an {{{{output:{p.name}}}}} placeholder; "
                                    "outputs are returned, not passed", param=p.name)
        params = list(sig.parameters)
        missing = [n for n in inputs if n not in params]
        extra = [n for n in params if n not in inputs]
        if missing or extra:
            raise TemplateError(f"{where}: parameters {params} do not match the template inputs {inputs}"
                                + (f"; no parameter for {missing}" if missing else "")
                                + (f"; no {{{{input:...}}}} placeholder for {extra}" if extra else ""),
                                param=(missing or extra)[0])

    def options(self, *, outputs: Mapping[str, Output | Mapping] | None = None,
                models: Sequence[str] | None = None, **defaults: Any) -> "SemanticFunction":
        """A copy with some settings changed (``f.options(max_tokens=8)(x)``); validated like a definition."""
        merged = dict(self._overrides)
        for k, v in (outputs or {}).items():
            merged[k] = _as_output(v).merged_over(merged.get(k, Output()))
        return SemanticFunction(self.template, name=self.name, signature=self.signature,
                                defaults=_output_from_kwargs(defaults).merged_over(self._defaults), outputs=merged,
                                models=self.models if models is None else models)

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]

    def __call__(self, *args: Any, session: Session | None = None, **kwargs: Any
                 ) -> SemanticVariable | tuple[SemanticVariable, ...]:
        """Submit the call; returns the output variable (a tuple, in template order, for several outputs).

        ``str`` arguments become new ready variables; SemanticVariables are passed by id whether or not
        they are ready (the server runs the request once all inputs are materialized).
        """
        from parrot.frontend.flow import active_tracer  # here: parrot.frontend.flow imports this module

        tracer = active_tracer(itertools.chain(args, kwargs.values()))
        if tracer is not None:  # inside a flow being traced: a generate step (docs/flows.md), nothing submitted
            return tracer.generate(self, args, kwargs)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.name}(): {e}") from None
        bound.apply_defaults()
        s = resolve_session(session)
        in_vars: dict[str, SemanticVariable] = {}
        for pname, value in bound.arguments.items():
            if isinstance(value, str):
                value = SemanticVariable(value, name=pname)
            if not isinstance(value, SemanticVariable):
                raise TypeError(f"{self.name}(): argument {pname!r} must be str or SemanticVariable, got "
                                f"{type(value).__name__}")
            in_vars[pname] = value
        holders = []
        for p in placeholders(self.segments):
            if p.is_output:
                holders.append(self._output(p).to_placeholder())
            else:
                holders.append({"name": p.name, "is_output": False, "var_id": in_vars[p.name]._bind(s)})
        out_ids = s.submit(self.template, holders, list(self.models), name=self.name)
        inputs = tuple(in_vars.values())
        outs = tuple(SemanticVariable._semantic_output(n, s, out_ids[n], inputs, f"semantic function {self.name}")
                     for n in self.output_names)
        return outs[0] if len(outs) == 1 else outs

    def _output(self, p: PlaceholderSegment) -> OutputConfig:
        return next(o for o in self.outputs if o.name == p.name)

    def __repr__(self) -> str:
        return f"SemanticFunction({self.name}{self.signature} -> {tuple(self.output_names)})"


def _as_output(o: Output | Mapping) -> Output:
    if isinstance(o, Output):
        return o
    if isinstance(o, Mapping):
        try:
            return Output(**o)
        except TypeError as e:
            raise TemplateError(f"bad output settings {dict(o)}: {e}", param="outputs") from None
    raise TemplateError(f"output settings must be P.Output or a dict, got {type(o).__name__}", param="outputs")


def _output_from_kwargs(kwargs: Mapping[str, Any]) -> Output:
    try:
        return Output(**kwargs)
    except TypeError as e:
        raise TypeError(f"semantic_function: {e} (known: {[f.name for f in dataclasses.fields(Output)]})") from None


def semantic_function(fn: Callable | None = None, /, *, outputs: Mapping[str, Output | Mapping] | None = None,
                      models: Sequence[str] = (), **defaults: Any) -> Any:
    """Decorator turning a function whose docstring is a template into a :class:`SemanticFunction`.

    Usable bare (``@P.semantic_function``) or with arguments: ``defaults`` are :class:`Output` fields
    (``max_tokens``, ``temperature``, ``stop``, ``transforms``, ...) applied to every output;
    ``outputs={"name": P.Output(...)}`` overrides them per output; ``models`` restricts the engines' models.
    """
    base = _output_from_kwargs(defaults)

    def wrap(f: Callable) -> SemanticFunction:
        if not f.__doc__:
            raise TemplateError(f"semantic function {f.__name__!r} has no docstring template", param="prompt")
        sf = SemanticFunction(inspect.cleandoc(f.__doc__), name=f.__name__, signature=inspect.signature(f),
                              defaults=base, outputs=outputs, models=models)
        functools.update_wrapper(sf, f, updated=())
        return sf

    return wrap(fn) if fn is not None else wrap
