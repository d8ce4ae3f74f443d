"""Conditions of flows as the frontend writes them: ``v.equals("yes")``, ``v.contains(...)``, ``v.matches(...)``,
``v.json("a.b") == "ok"``, ``v.number() >= 7``, combined with ``~ & |``; they build the COND JSON of docs/flows.md.

``ConditionMethods`` is a base of both :class:`~parrot.frontend.flow.FlowVar` (values inside a flow) and
:class:`~parrot.frontend.variable.SemanticVariable` (a top-level ``P.branch`` on a variable). Data only: nothing
here is evaluated on the client; the server evaluates the JSON (parrot.manager.flows.conditions).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from parrot.common.errors import TemplateError

_OPS = ("==", "!=", "<", "<=", ">", ">=")


# ---- conditions -----------------------------------------------------------------------------------------------------
Operand = Any  # a FlowVar or a SemanticVariable (resolved to a scope name by the tracer)


class Cond:
    """A condition of docs/flows.md (COND): a comparison on one value, or ``~c``, ``c & d``, ``c | d``. Data only;
    ``bool(cond)`` raises (``and`` / ``or`` / ``not`` / ``if`` cannot be traced: use ``& | ~``)."""

    def __init__(self, kind: str, operand: Operand = None, fields: Mapping[str, Any] | None = None,
                 children: Sequence[Cond] = ()) -> None:
        self.kind, self.operand, self.fields, self.children = kind, operand, dict(fields or {}), tuple(children)

    def __invert__(self) -> Cond:
        return Cond("not", children=(self,))

    def __and__(self, other: Cond) -> Cond:
        return _combine("all", self, other)

    def __or__(self, other: Cond) -> Cond:
        return _combine("any", self, other)

    def __bool__(self) -> bool:
        raise TypeError("a flow condition has no truth value while tracing: combine with &, |, ~ "
                        "(not and / or / not) and branch with P.branch")

    def operands(self) -> Iterator[Operand]:
        if self.operand is not None:
            yield self.operand
        for c in self.children:
            yield from c.operands()

    def to_dict(self, ref: Callable[[Operand], Any] | None = None) -> dict:
        """The COND JSON; ``ref`` maps an operand to its scope name (default: a FlowVar's name)."""
        ref = ref or _name_of
        if self.kind == "not":
            return {"kind": "not", "cond": self.children[0].to_dict(ref)}
        if self.kind in ("all", "any"):
            return {"kind": self.kind, "conds": [c.to_dict(ref) for c in self.children]}
        return {"kind": self.kind, "var": ref(self.operand), **self.fields}

    def __repr__(self) -> str:
        return f"Cond({self.to_dict(lambda o: getattr(o, 'name', None) or '?')})"


def _combine(kind: str, a: Cond, b: Cond) -> Cond:
    if not isinstance(b, Cond):
        return NotImplemented  # type: ignore[return-value]
    parts = [c for x in (a, b) for c in (x.children if x.kind == kind else (x,))]
    return Cond(kind, children=parts)


def _name_of(operand: Operand) -> str:
    name = getattr(operand, "scope_name", None)  # FlowVar's (parrot.frontend.flow)
    if isinstance(name, str):
        return name
    raise TypeError(f"{operand!r} is not a FlowVar: build the condition inside a flow (P.flow / P.branch)")


class _Compare:
    """``v.json(path)`` / ``v.number()``: compared with ``== != < <= > >=`` it gives a :class:`Cond`."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, kind: str, operand: Operand, path: str | None = None) -> None:
        self._kind, self._operand, self._path = kind, operand, path

    def _cond(self, op: str, value: Any) -> Cond:
        if self._kind == "number" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                       or not math.isfinite(value)):
            raise TypeError(f"number() compares with a finite number, got {value!r}")
        if self._kind == "json" and not isinstance(value, (str, int, float, bool, type(None))):
            raise TypeError(f"json() compares with a JSON scalar, got {type(value).__name__}")
        fields = {"op": op, "value": value} if self._path is None else {"path": self._path, "op": op, "value": value}
        return Cond(self._kind, self._operand, fields)

    def __eq__(self, value: object) -> Cond:  # type: ignore[override]
        return self._cond("==", value)

    def __ne__(self, value: object) -> Cond:  # type: ignore[override]
        return self._cond("!=", value)

    def __lt__(self, value: Any) -> Cond:
        return self._cond("<", value)

    def __le__(self, value: Any) -> Cond:
        return self._cond("<=", value)

    def __gt__(self, value: Any) -> Cond:
        return self._cond(">", value)

    def __ge__(self, value: Any) -> Cond:
        return self._cond(">=", value)

    def __bool__(self) -> bool:
        raise TypeError("compare json() / number() with a value (== != < <= > >=) to get a condition")


class ConditionMethods:
    """The condition builders of a value (FlowVar; SemanticVariable for top-level branches)."""

    def equals(self, value: str, *, case_sensitive: bool = False) -> Cond:
        """The stripped text equals ``value``."""
        return Cond("equals", self, {"value": _str(value, "equals"), "case_sensitive": bool(case_sensitive)})

    def contains(self, value: str, *, case_sensitive: bool = False) -> Cond:
        return Cond("contains", self, {"value": _str(value, "contains"), "case_sensitive": bool(case_sensitive)})

    def matches(self, pattern: str, *, case_sensitive: bool = True) -> Cond:
        """A regex search (not a full match); the pattern is checked here (TemplateError if it does not compile)."""
        try:
            re.compile(_str(pattern, "matches"))
        except re.error as e:
            raise TemplateError(f"matches(): bad regex {pattern!r}: {e}", param="pattern") from None
        return Cond("regex", self, {"pattern": pattern, "case_sensitive": bool(case_sensitive)})

    def json(self, path: str = "") -> _Compare:
        """The field at a dotted ``path`` (``[i]`` indexes) of the value parsed as JSON; compare it."""
        return _Compare("json", self, _str(path, "json"))

    def number(self) -> _Compare:
        """The first number in the text; compare it."""
        return _Compare("number", self)


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what}() takes a str, got {type(value).__name__}")
    return value


# ---- symbolic values --------------------------------------------------------------------------------------------------
