"""Declarative string transforms applied to a generated output before it becomes a variable's value (§5.1).

Transforms are data, never code: a spec is a JSON object ``{"op": NAME, ...args}``. The server validates
specs on submit (:func:`validate_transforms` -> TransformSpecError, HTTP 400) and applies them in order to the
generated text (:func:`apply_transforms` -> TransformFailed, which fails the step).

=============  ====================================  ====================================================
op             args                                  result
=============  ====================================  ====================================================
strip          -                                     surrounding whitespace removed
first_line     -                                     first non-blank line ("" for blank text)
lines          index: int                            line ``index`` (negative counts from the end)
regex          pattern: str, group: int|str = 0      group of the first match (``search``)
json           path: str ("a.b.0")                   value at path; re-serialized as JSON unless a string
remove_prefix  text: str                             text without that prefix (unchanged if absent)
remove_suffix  text: str                             text without that suffix (unchanged if absent)
lower / upper  -                                     case-folded text
replace        old: str, new: str                    every ``old`` replaced by ``new``
truncate       chars: int                            at most ``chars`` characters
=============  ====================================  ====================================================

Regex safety: patterns run with the third-party ``regex`` engine and a time budget
(:data:`REGEX_TIMEOUT_S`, raising TransformFailed when exceeded); patterns longer than
:data:`MAX_PATTERN_LEN` and patterns with a quantified group that itself contains a quantifier (``(a+)+``,
``(.*)*``, the classic catastrophic-backtracking shape) are rejected at validation; inputs longer than
:data:`MAX_REGEX_INPUT_CHARS` fail instead of being scanned.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import regex

from parrot.common.errors import TransformFailed, TransformSpecError

MAX_TRANSFORMS = 16
MAX_STRING_ARG_LEN = 10_000
MAX_PATTERN_LEN = 512
MAX_REGEX_INPUT_CHARS = 200_000
REGEX_TIMEOUT_S = 0.25
_QUANTIFIERS = "*+?{"
_BRACE_QUANTIFIER = regex.compile(r"\{(\d+,?\d*|,\d+)\}")


@dataclass(frozen=True)
class Transform:
    """One validated transform. ``args`` holds every argument (defaults filled in), in declaration order."""

    op: str
    args: tuple[tuple[str, Any], ...] = ()
    compiled: Any = field(default=None, compare=False, repr=False)  # a compiled regex for op == "regex"

    def arg(self, name: str) -> Any:
        return dict(self.args)[name]

    def to_spec(self) -> dict:
        return {"op": self.op, **dict(self.args)}


# ---- argument schema ------------------------------------------------------------------------------------------
_REQUIRED = object()  # marks an argument without default in a schema


@dataclass(frozen=True)
class _Arg:
    name: str
    types: tuple[type, ...]
    default: Any = _REQUIRED


@dataclass(frozen=True)
class _Op:
    args: tuple[_Arg, ...]
    apply: Callable[[Transform, str], str]
    check: Callable[[dict], Any] | None = None  # extra validation; may return a compiled object


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:  # bool is an int subclass; never accept it as one
        return False
    return isinstance(value, types)


# ---- regex guards ---------------------------------------------------------------------------------------------
def _has_nested_quantifier(pattern: str) -> bool:
    """True if a quantified group contains a quantifier itself (``(a+)+``, ``(?:x*y)*``, ``(a|b+){2,}``).

    A conservative scan: escapes and character classes are skipped; lazy/possessive suffixes count as
    quantifiers too (a rejected safe pattern can be rewritten; an accepted exponential one cannot).
    """
    stack: list[bool] = []  # per open group: does it contain a quantifier?
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # skip a character class, honouring escapes and a leading ']'
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
            continue
        if c == "(":
            stack.append(False)
            i += 1
            if i < n and pattern[i] == "?":  # group flags like (?: (?P< — the '?' is not a quantifier
                i += 1
            continue
        if c == ")":
            inner_quantified = stack.pop() if stack else False
            i += 1
            repeated = i < n and (pattern[i] in "*+" or
                                  (pattern[i] == "{" and _BRACE_QUANTIFIER.match(pattern, i)))
            if inner_quantified and repeated:
                return True
            if stack and (inner_quantified or repeated):
                stack[-1] = True
            continue
        if c == "{" and not _BRACE_QUANTIFIER.match(pattern, i):  # a literal brace
            i += 1
            continue
        if c in _QUANTIFIERS and stack:
            stack[-1] = True
        i += 1
    return False


def _check_regex(args: dict) -> Any:
    pattern = args["pattern"]
    if len(pattern) > MAX_PATTERN_LEN:
        raise TransformSpecError(f"regex pattern too long ({len(pattern)} > {MAX_PATTERN_LEN} characters)",
                                 param="pattern")
    if _has_nested_quantifier(pattern):
        raise TransformSpecError(f"regex pattern {pattern!r} nests quantifiers (like '(a+)+'), which can "
                                 "backtrack catastrophically; rewrite it without a quantified group that "
                                 "contains a quantifier", param="pattern")
    try:
        compiled = regex.compile(pattern, flags=regex.V0)
    except regex.error as e:
        raise TransformSpecError(f"invalid regex pattern {pattern!r}: {e}", param="pattern") from None
    group = args["group"]
    if isinstance(group, int):
        if not 0 <= group <= compiled.groups:
            raise TransformSpecError(f"regex group {group} out of range: pattern {pattern!r} has "
                                     f"{compiled.groups} group(s)", param="group")
    elif group not in compiled.groupindex:
        raise TransformSpecError(f"regex pattern {pattern!r} has no group named {group!r}", param="group")
    return compiled


def _check_json_path(args: dict) -> None:
    path = args["path"]
    if not path or any(not part for part in path.split(".")):
        raise TransformSpecError(f"json path {path!r} must be dot-separated non-empty keys like 'a.b.0'",
                                 param="path")


def _check_nonempty(name: str) -> Callable[[dict], None]:
    def check(args: dict) -> None:
        if not args[name]:
            raise TransformSpecError(f"argument {name!r} must not be empty", param=name)
    return check


def _check_non_negative(name: str) -> Callable[[dict], None]:
    def check(args: dict) -> None:
        if args[name] < 0:
            raise TransformSpecError(f"argument {name!r} must be >= 0, got {args[name]}", param=name)
    return check


# ---- op implementations ---------------------------------------------------------------------------------------
def _first_line(t: Transform, text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line
    return ""


def _lines(t: Transform, text: str) -> str:
    lines = text.splitlines()
    index = t.arg("index")
    if not -len(lines) <= index < len(lines):
        raise TransformFailed(f"lines: index {index} out of range for a text of {len(lines)} line(s)")
    return lines[index]


def _regex(t: Transform, text: str) -> str:
    if len(text) > MAX_REGEX_INPUT_CHARS:
        raise TransformFailed(f"regex: input of {len(text)} characters exceeds the limit of "
                              f"{MAX_REGEX_INPUT_CHARS}")
    try:
        m = t.compiled.search(text, timeout=REGEX_TIMEOUT_S)
    except TimeoutError:
        raise TransformFailed(f"regex {t.arg('pattern')!r} exceeded its time budget of "
                              f"{REGEX_TIMEOUT_S} s") from None
    if m is None:
        raise TransformFailed(f"regex {t.arg('pattern')!r} did not match {_excerpt(text)}")
    value = m.group(t.arg("group"))
    if value is None:
        raise TransformFailed(f"regex {t.arg('pattern')!r}: group {t.arg('group')!r} did not take part in "
                              f"the match")
    return value


def _parse_json(text: str) -> Any:
    """Parse the JSON an LLM produced: the whole text, else a ```json fenced block, else the first value
    starting at the first '{' or '[' (trailing chatter ignored)."""
    stripped = text.strip()
    candidates = [stripped]
    if stripped.startswith("```"):
        body = stripped.split("\n", 1)[1] if "\n" in stripped else ""
        candidates.append(body.rsplit("```", 1)[0])
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except ValueError:
            pass
    starts = [i for i in (stripped.find("{"), stripped.find("[")) if i >= 0]
    if starts:
        try:
            return json.JSONDecoder().raw_decode(stripped[min(starts):])[0]
        except ValueError:
            pass
    raise TransformFailed(f"json: output is not valid JSON: {_excerpt(text)}")


def _json(t: Transform, text: str) -> str:
    value = _parse_json(text)
    walked: list[str] = []
    for key in t.arg("path").split("."):
        if isinstance(value, dict):
            if key not in value:
                raise TransformFailed(f"json: key {key!r} not found at '{'.'.join(walked) or '$'}'")
            value = value[key]
        elif isinstance(value, list):
            try:
                index = int(key)
            except ValueError:
                raise TransformFailed(f"json: '{'.'.join(walked) or '$'}' is a list; {key!r} is not an "
                                      "index") from None
            if not -len(value) <= index < len(value):
                raise TransformFailed(f"json: index {index} out of range at '{'.'.join(walked) or '$'}' "
                                      f"(length {len(value)})")
            value = value[index]
        else:
            raise TransformFailed(f"json: cannot descend into {type(value).__name__} at "
                                  f"'{'.'.join(walked) or '$'}' with key {key!r}")
        walked.append(key)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _excerpt(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


_S = (str,)
_OPS: dict[str, _Op] = {
    "strip": _Op((), lambda t, s: s.strip()),
    "first_line": _Op((), _first_line),
    "lines": _Op((_Arg("index", (int,)),), _lines),
    "regex": _Op((_Arg("pattern", _S), _Arg("group", (int, str), 0)), _regex, _check_regex),
    "json": _Op((_Arg("path", _S),), _json, _check_json_path),
    "remove_prefix": _Op((_Arg("text", _S),), lambda t, s: s.removeprefix(t.arg("text")), _check_nonempty("text")),
    "remove_suffix": _Op((_Arg("text", _S),), lambda t, s: s.removesuffix(t.arg("text")), _check_nonempty("text")),
    "lower": _Op((), lambda t, s: s.lower()),
    "upper": _Op((), lambda t, s: s.upper()),
    "replace": _Op((_Arg("old", _S), _Arg("new", _S)), lambda t, s: s.replace(t.arg("old"), t.arg("new")),
                   _check_nonempty("old")),
    "truncate": _Op((_Arg("chars", (int,)),), lambda t, s: s[:t.arg("chars")], _check_non_negative("chars")),
}
OPS: tuple[str, ...] = tuple(_OPS)


def validate_transform(spec: Mapping | Transform) -> Transform:
    """Check one spec (op known, every required argument present, no extra argument, right types)."""
    if isinstance(spec, Transform):
        spec = spec.to_spec()
    if not isinstance(spec, Mapping):
        raise TransformSpecError(f"a transform must be an object like {{'op': 'strip'}}, got "
                                 f"{type(spec).__name__}", param="transforms")
    op_name = spec.get("op")
    if not isinstance(op_name, str) or op_name not in _OPS:
        raise TransformSpecError(f"unknown transform op {op_name!r} (known: {', '.join(OPS)})", param="op")
    op = _OPS[op_name]
    known = {a.name for a in op.args}
    extra = sorted(set(spec) - known - {"op"})
    if extra:
        raise TransformSpecError(f"transform {op_name!r} got unexpected argument(s) {extra} "
                                 f"(accepts: {sorted(known) or 'none'})", param=extra[0])
    args: dict[str, Any] = {}
    for a in op.args:
        if a.name not in spec:
            if a.default is _REQUIRED:
                raise TransformSpecError(f"transform {op_name!r} needs argument {a.name!r}", param=a.name)
            args[a.name] = a.default
            continue
        value = spec[a.name]
        if not _type_ok(value, a.types):
            want = " or ".join(t.__name__ for t in a.types)
            raise TransformSpecError(f"transform {op_name!r}: argument {a.name!r} must be {want}, got "
                                     f"{type(value).__name__}", param=a.name)
        if isinstance(value, str) and len(value) > MAX_STRING_ARG_LEN:
            raise TransformSpecError(f"transform {op_name!r}: argument {a.name!r} longer than "
                                     f"{MAX_STRING_ARG_LEN} characters", param=a.name)
        args[a.name] = value
    compiled = op.check(args) if op.check else None
    return Transform(op_name, tuple(args.items()), compiled)


def validate_transforms(specs: list[Mapping | Transform] | tuple | None) -> list[Transform]:
    """Validate a list of specs (None = no transforms). Raises TransformSpecError naming the bad entry."""
    if specs is None:
        return []
    if not isinstance(specs, (list, tuple)):
        raise TransformSpecError(f"transforms must be a list, got {type(specs).__name__}", param="transforms")
    if len(specs) > MAX_TRANSFORMS:
        raise TransformSpecError(f"at most {MAX_TRANSFORMS} transforms per output, got {len(specs)}",
                                 param="transforms")
    out = []
    for i, spec in enumerate(specs):
        try:
            out.append(validate_transform(spec))
        except TransformSpecError as e:
            raise TransformSpecError(f"transform #{i}: {e.message}", param=e.param) from None
    return out


def apply_transforms(transforms: list[Transform], text: str) -> str:
    """Apply validated transforms in order. Raises TransformFailed naming the failing transform."""
    for i, t in enumerate(transforms):
        try:
            text = _OPS[t.op].apply(t, text)
        except TransformFailed as e:
            raise TransformFailed(f"transform #{i} ({t.op}): {e.message}") from None
    return text


# ---- spec builders for the frontend (plain dicts; validated where they are used) ---------------------------------
def strip() -> dict:
    return {"op": "strip"}


def first_line() -> dict:
    return {"op": "first_line"}


def lines(index: int) -> dict:
    return {"op": "lines", "index": index}


def regex_group(pattern: str, group: int | str = 0) -> dict:
    return {"op": "regex", "pattern": pattern, "group": group}


def json_field(path: str) -> dict:
    return {"op": "json", "path": path}


def remove_prefix(text: str) -> dict:
    return {"op": "remove_prefix", "text": text}


def remove_suffix(text: str) -> dict:
    return {"op": "remove_suffix", "text": text}


def lower() -> dict:
    return {"op": "lower"}


def upper() -> dict:
    return {"op": "upper"}


def replace(old: str, new: str) -> dict:
    return {"op": "replace", "old": old, "new": new}


def truncate(chars: int) -> dict:
    return {"op": "truncate", "chars": chars}
