"""Flow conditions: a closed set of comparisons on scope values (docs/flows.md, "Conditions").

Invariants:

* Nothing a client sends is evaluated as code. A condition is data parsed by :func:`parse_condition` into one of
  the frozen dataclasses below; every shape error is an :class:`InvalidRequestError` whose ``param`` is
  ``where + ".<field>"``, raised at submission.
* :meth:`Condition.evaluate` never raises on content: a value it cannot read (not JSON, no number, a path that
  is absent, a regex that runs out of its 100 ms budget) makes the condition false.
* :meth:`Condition.to_json` round-trips through :func:`parse_condition` (``parse(c.to_json()) == c``).

The json path syntax (``a.b[0].c``) is shared with the ``json_get`` server tool (:func:`parse_path`,
:func:`get_path`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import regex

from parrot.common.errors import InvalidRequestError

logger = logging.getLogger(__name__)

SCOPE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
OPS: tuple[str, ...] = ("==", "!=", "<", "<=", ">", ">=")
MAX_DEPTH = 8  # condition levels (a bare leaf is depth 1)
MAX_CONDS = 32  # children of one all / any
MAX_PATTERN = 1000  # characters of a regex pattern
MAX_PATH_SEGMENTS = 32
REGEX_TIMEOUT_S = 0.1
NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_SEGMENT = re.compile(r"([^.\[\]]+)|\[(\d+)\]")

PathT = tuple[str | int, ...]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # what get_path returns for an absent path


# ---- paths ---------------------------------------------------------------------------------------------------
def parse_path(text: str) -> PathT:
    """``"a.b[0].c"`` -> ``("a", "b", 0, "c")``; ``""`` is the root. Raises ValueError naming the problem."""
    out: list[str | int] = []
    pos = 0
    while pos < len(text):
        if out and text[pos] == ".":
            pos += 1
            if pos >= len(text) or text[pos] in ".[":
                raise ValueError(f"empty key at character {pos} of path {text!r}")
        m = _SEGMENT.match(text, pos)
        if m is None or (m.group(1) is not None and out and text[pos - 1] != "."):
            raise ValueError(f"bad path {text!r} at character {pos} (expected a key, '.key' or '[index]')")
        out.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    if len(out) > MAX_PATH_SEGMENTS:
        raise ValueError(f"path {text!r} has more than {MAX_PATH_SEGMENTS} segments")
    return tuple(out)


def format_path(path: PathT) -> str:
    parts: list[str] = []
    for seg in path:
        parts.append(f"[{seg}]" if isinstance(seg, int) else (f".{seg}" if parts else seg))
    return "".join(parts)


def get_path(obj: Any, path: PathT) -> Any:
    """The value at ``path`` in a parsed JSON value, or :data:`MISSING`."""
    for seg in path:
        if isinstance(seg, int):
            if not isinstance(obj, list) or seg >= len(obj):
                return MISSING
            obj = obj[seg]
        else:
            if not isinstance(obj, dict) or seg not in obj:
                return MISSING
            obj = obj[seg]
    return obj


def _json_eq(a: Any, b: Any) -> bool:
    """JSON equality: true / 1 differ, 1 and 1.0 agree, containers compare deeply."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_number(a) and _is_number(b):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_eq(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _compare(left: Any, op: str, right: Any) -> bool:
    if op == "==":
        return _json_eq(left, right)
    if op == "!=":
        return not _json_eq(left, right)
    if not ((_is_number(left) and _is_number(right)) or (isinstance(left, str) and isinstance(right, str))):
        return False
    if op == "<":
        return left < right
    if op == "<=":
        return left <= right
    if op == ">":
        return left > right
    return left >= right


# ---- the condition classes -----------------------------------------------------------------------------------
class Condition(ABC):
    kind: ClassVar[str]

    @abstractmethod
    def names(self) -> tuple[str, ...]:
        """The scope names this condition reads, in order, each once."""

    @abstractmethod
    def evaluate(self, values: Mapping[str, str]) -> bool:
        """``values`` holds every name of :meth:`names`; never raises on their content."""

    @abstractmethod
    def to_json(self) -> dict:
        """The wire form (parse_condition(c.to_json()) == c)."""


@dataclass(frozen=True)
class _Leaf(Condition):
    var: str

    def names(self) -> tuple[str, ...]:
        return (self.var,)


@dataclass(frozen=True)
class Equals(_Leaf):
    kind: ClassVar[str] = "equals"
    value: str
    case_sensitive: bool = False

    def evaluate(self, values: Mapping[str, str]) -> bool:
        a, b = values[self.var].strip(), self.value.strip()
        return a == b if self.case_sensitive else a.casefold() == b.casefold()

    def to_json(self) -> dict:
        return {"kind": self.kind, "var": self.var, "value": self.value, "case_sensitive": self.case_sensitive}


@dataclass(frozen=True)
class Contains(_Leaf):
    kind: ClassVar[str] = "contains"
    value: str
    case_sensitive: bool = False

    def evaluate(self, values: Mapping[str, str]) -> bool:
        text = values[self.var]
        return self.value in text if self.case_sensitive else self.value.casefold() in text.casefold()

    def to_json(self) -> dict:
        return {"kind": self.kind, "var": self.var, "value": self.value, "case_sensitive": self.case_sensitive}


@dataclass(frozen=True)
class Regex(_Leaf):
    kind: ClassVar[str] = "regex"
    pattern: str
    case_sensitive: bool = True
    compiled: Any = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:  # raises regex.error on a bad pattern
        flags = 0 if self.case_sensitive else regex.IGNORECASE
        object.__setattr__(self, "compiled", regex.compile(self.pattern, flags))

    def evaluate(self, values: Mapping[str, str]) -> bool:
        try:
            return self.compiled.search(values[self.var], timeout=REGEX_TIMEOUT_S) is not None
        except TimeoutError:
            logger.warning("regex condition %r on %r timed out after %.0f ms: false", self.pattern, self.var,
                           REGEX_TIMEOUT_S * 1000)
            return False

    def to_json(self) -> dict:
        return {"kind": self.kind, "var": self.var, "pattern": self.pattern, "case_sensitive": self.case_sensitive}


@dataclass(frozen=True)
class Json(_Leaf):
    kind: ClassVar[str] = "json"
    path: PathT
    op: str
    value: Any

    def evaluate(self, values: Mapping[str, str]) -> bool:
        try:
            obj = json.loads(values[self.var])
        except (ValueError, RecursionError):
            return False
        found = get_path(obj, self.path)
        return found is not MISSING and _compare(found, self.op, self.value)

    def to_json(self) -> dict:
        return {"kind": self.kind, "var": self.var, "path": format_path(self.path), "op": self.op,
                "value": self.value}


@dataclass(frozen=True)
class Number(_Leaf):
    kind: ClassVar[str] = "number"
    op: str
    value: float

    def evaluate(self, values: Mapping[str, str]) -> bool:
        m = NUMBER.search(values[self.var])
        return m is not None and _compare(float(m.group(0)), self.op, self.value)

    def to_json(self) -> dict:
        return {"kind": self.kind, "var": self.var, "op": self.op, "value": self.value}


def _unique_names(conds: tuple[Condition, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for c in conds for n in c.names()))


@dataclass(frozen=True)
class Not(Condition):
    kind: ClassVar[str] = "not"
    cond: Condition

    def names(self) -> tuple[str, ...]:
        return self.cond.names()

    def evaluate(self, values: Mapping[str, str]) -> bool:
        return not self.cond.evaluate(values)

    def to_json(self) -> dict:
        return {"kind": self.kind, "cond": self.cond.to_json()}


@dataclass(frozen=True)
class All(Condition):
    kind: ClassVar[str] = "all"
    conds: tuple[Condition, ...]

    def names(self) -> tuple[str, ...]:
        return _unique_names(self.conds)

    def evaluate(self, values: Mapping[str, str]) -> bool:
        return all(c.evaluate(values) for c in self.conds)

    def to_json(self) -> dict:
        return {"kind": self.kind, "conds": [c.to_json() for c in self.conds]}


@dataclass(frozen=True)
class Any_(Condition):
    kind: ClassVar[str] = "any"
    conds: tuple[Condition, ...]

    def names(self) -> tuple[str, ...]:
        return _unique_names(self.conds)

    def evaluate(self, values: Mapping[str, str]) -> bool:
        return any(c.evaluate(values) for c in self.conds)

    def to_json(self) -> dict:
        return {"kind": self.kind, "conds": [c.to_json() for c in self.conds]}


def leaves(cond: Condition) -> Iterator[Condition]:
    """The leaf conditions (equals, contains, regex, json, number) of ``cond``, depth first."""
    if isinstance(cond, Not):
        yield from leaves(cond.cond)
    elif isinstance(cond, All | Any_):
        for c in cond.conds:
            yield from leaves(c)
    else:
        yield cond


# ---- parsing -------------------------------------------------------------------------------------------------
# kind -> (required fields, optional fields); "kind" itself is implied
_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "equals": (("var", "value"), ("case_sensitive",)),
    "contains": (("var", "value"), ("case_sensitive",)),
    "regex": (("var", "pattern"), ("case_sensitive",)),
    "json": (("var", "path", "op", "value"), ()),
    "number": (("var", "op", "value"), ()),
    "not": (("cond",), ()),
    "all": (("conds",), ()),
    "any": (("conds",), ()),
}
KINDS: tuple[str, ...] = tuple(_FIELDS)


def parse_condition(obj: Any, where: str) -> Condition:
    """Parse the wire form of a condition; ``where`` is its request path (``steps[1].branch.cases[0].when``)."""
    return _parse(obj, where, 1)


def _err(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _parse(obj: Any, where: str, depth: int) -> Condition:
    if not isinstance(obj, dict):
        raise _err(f"a condition must be an object, got {type(obj).__name__}", where)
    if depth > MAX_DEPTH:
        raise _err(f"conditions nest at most {MAX_DEPTH} levels deep", where)
    kind = obj.get("kind")
    if kind not in _FIELDS:
        shown = "missing" if kind is None else repr(kind)
        raise _err(f"unknown condition kind {shown}; known kinds: {', '.join(KINDS)}", f"{where}.kind")
    required, optional = _FIELDS[kind]
    for name in required:
        if name not in obj:
            raise _err(f"a {kind!r} condition needs the field {name!r}", f"{where}.{name}")
    extra = [k for k in obj if k != "kind" and k not in required and k not in optional]
    if extra:
        allowed = ", ".join(("kind", *required, *optional))
        raise _err(f"unknown field(s) {', '.join(map(repr, extra))} in a {kind!r} condition (allowed: {allowed})",
                   f"{where}.{extra[0]}")

    if kind == "not":
        return Not(_parse(obj["cond"], f"{where}.cond", depth + 1))
    if kind in ("all", "any"):
        conds = obj["conds"]
        if not isinstance(conds, list) or not conds or len(conds) > MAX_CONDS:
            raise _err(f"'conds' of an {kind!r} condition must be a list of 1 to {MAX_CONDS} conditions",
                       f"{where}.conds")
        parsed = tuple(_parse(c, f"{where}.conds[{i}]", depth + 1) for i, c in enumerate(conds))
        return All(parsed) if kind == "all" else Any_(parsed)

    var = obj["var"]
    if not isinstance(var, str) or not SCOPE_NAME.match(var):
        raise _err(f"'var' must be a scope name matching {SCOPE_NAME.pattern}, got {var!r}", f"{where}.var")
    if kind in ("equals", "contains", "regex"):
        case_sensitive = obj.get("case_sensitive", kind == "regex")
        if not isinstance(case_sensitive, bool):
            raise _err(f"'case_sensitive' must be true or false, got {case_sensitive!r}", f"{where}.case_sensitive")
    if kind in ("equals", "contains"):
        value = obj["value"]
        if not isinstance(value, str):
            raise _err(f"'value' of a {kind!r} condition must be a string, got {type(value).__name__}",
                       f"{where}.value")
        if kind == "contains" and not value:
            raise _err("'value' of a 'contains' condition must not be empty", f"{where}.value")
        return (Equals if kind == "equals" else Contains)(var, value, case_sensitive)
    if kind == "regex":
        pattern = obj["pattern"]
        if not isinstance(pattern, str):
            raise _err(f"'pattern' must be a string, got {type(pattern).__name__}", f"{where}.pattern")
        if len(pattern) > MAX_PATTERN:
            raise _err(f"'pattern' is {len(pattern)} characters, more than {MAX_PATTERN}", f"{where}.pattern")
        try:
            return Regex(var, pattern, case_sensitive)
        except regex.error as e:
            raise _err(f"bad regex pattern {pattern!r}: {e}", f"{where}.pattern") from None

    op = obj["op"]
    if op not in OPS:
        raise _err(f"'op' must be one of {' '.join(OPS)}, got {op!r}", f"{where}.op")
    value = obj["value"]
    if kind == "number":
        if not _is_number(value) or not math.isfinite(value):
            raise _err(f"'value' of a 'number' condition must be a finite number, got {value!r}", f"{where}.value")
        return Number(var, op, float(value))
    # json
    text = obj["path"]
    if not isinstance(text, str):
        raise _err(f"'path' must be a string such as \"a.b[0].c\", got {type(text).__name__}", f"{where}.path")
    try:
        path = parse_path(text)
    except ValueError as e:
        raise _err(str(e), f"{where}.path") from None
    if not _is_json(value, 0):
        raise _err(f"'value' must be a JSON value (finite numbers, at most {MAX_DEPTH} levels deep)",
                   f"{where}.value")
    if op not in ("==", "!=") and not (isinstance(value, str) or _is_number(value)):
        raise _err(f"'value' of op {op!r} must be a number or a string, got {json.dumps(value)}", f"{where}.value")
    return Json(var, path, op, value)


def _is_json(v: Any, depth: int) -> bool:
    if depth > MAX_DEPTH:
        return False
    if v is None or isinstance(v, bool | str | int):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        return all(_is_json(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_json(x, depth + 1) for k, x in v.items())
    return False


# ---- schema paths --------------------------------------------------------------------------------------------
def schema_has_path(schema: Mapping | bool, path: PathT) -> bool:
    """True if a value valid against the JSON ``schema`` can have ``path``.

    A key is possible where it is in ``properties``, matches ``patternProperties``, or ``additionalProperties``
    is given as a schema; an object schema naming no properties at all is free-form (any key). An index is
    possible through ``prefixItems`` / ``items`` (below ``maxItems``). ``$ref`` to ``#/...`` and ``allOf`` must
    all allow the path, one ``anyOf`` / ``oneOf`` branch must. Unresolvable refs are given the benefit of doubt.
    """
    return _has(schema, tuple(path), schema, 64)


def _resolve(root: Any, ref: str) -> Any:
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return True  # remote ref: cannot know
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return node


def _types(node: Mapping) -> set[str] | None:
    t = node.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)}


def _has(node: Any, path: PathT, root: Any, budget: int) -> bool:
    if budget <= 0 or node is True:
        return True
    if node is False or not isinstance(node, Mapping):
        return node is not False
    ref = node.get("$ref")
    if isinstance(ref, str) and not _has(_resolve(root, ref), path, root, budget - 1):
        return False
    for sub in node.get("allOf") or ():
        if not _has(sub, path, root, budget - 1):
            return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(_has(b, path, root, budget - 1) for b in branches):
            return False
    if not path:
        return True
    if "const" in node:
        return get_path(node["const"], path) is not MISSING
    if isinstance(node.get("enum"), list):
        return any(get_path(v, path) is not MISSING for v in node["enum"])
    seg, rest = path[0], path[1:]
    types = _types(node)
    if isinstance(seg, int):
        if types is not None and "array" not in types:
            return False
        max_items = node.get("maxItems")
        if isinstance(max_items, int) and seg >= max_items:
            return False
        prefix = node.get("prefixItems")
        items = node.get("items")
        if isinstance(items, list):  # draft-07 tuple form
            prefix, items = items, node.get("additionalItems", True)
        if isinstance(prefix, list) and seg < len(prefix):
            return _has(prefix[seg], rest, root, budget - 1)
        return _has(True if items is None else items, rest, root, budget - 1)
    if types is not None and "object" not in types:
        return False
    props = node.get("properties") if isinstance(node.get("properties"), Mapping) else {}
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), Mapping) else {}
    if seg in props:
        return _has(props[seg], rest, root, budget - 1)
    for pat, sub in patterns.items():
        try:
            if regex.search(pat, seg, timeout=REGEX_TIMEOUT_S) and _has(sub, rest, root, budget - 1):
                return True
        except (regex.error, TimeoutError):
            continue
    additional = node.get("additionalProperties")
    if additional is not None and additional is not False:
        return _has(additional, rest, root, budget - 1)
    return additional is None and not props and not patterns  # a free-form object allows any key
