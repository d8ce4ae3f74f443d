"""Server tools of flows (docs/flows.md, "Server tools"): a closed set of pure functions from strings to a string.

Invariants:

* Nothing is evaluated as code: ``calculator`` walks its own small AST (numbers, ``+ - * / // % **``, unary
  ``-``/``+``, parentheses); no ``eval`` / ``exec`` anywhere.
* Every tool is bounded: arguments over :data:`MAX_INPUT_BYTES` are refused, regexes (``regex_extract``,
  JSON-schema ``pattern``) run with a 100 ms budget, arithmetic refuses exponents over 64 and results over
  1e300, parsed JSON over the interpreter's recursion limit is refused.
* A tool fails only with :class:`ToolError`, whose text is written for the flow's author (it becomes the
  output ``"error: <message>"`` with ``on_error: "value"``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import jsonschema
import referencing.exceptions
import regex
from jsonschema import Draft202012Validator, ValidationError

from parrot.common.errors import InvalidRequestError
from parrot.manager.flows.conditions import MISSING, get_path, parse_path

MAX_INPUT_BYTES = 1_000_000
REGEX_TIMEOUT_S = 0.1
MAX_PATTERN = 10_000
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e300
MAX_EXPR_TOKENS = 1000
MAX_EXPR_DEPTH = 50
MAX_SENTENCE_CHARS = 500


class ToolError(Exception):
    """A server tool could not produce its value; ``str(e)`` says why, for the user."""


def _short(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= n else text[: n - 3] + "...")


# ---- calculator ------------------------------------------------------------------------------------------------
_SEGMENT = re.compile(r"(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|[\s+\-*/%()^×÷])+")
_TOKEN = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|\*\*|//|[-+*/%()^×÷])")
_ALIASES = {"^": "**", "×": "*", "÷": "/"}
_BINARY = ("+", "-", "*", "/", "//", "%", "**")


def _tokens(segment: str) -> list[str]:
    return [_ALIASES.get(t, t) for t in _TOKEN.findall(segment)]


def _candidates(tokens: list[str]) -> list[list[str]]:
    """Split where two operands touch ("2023 5 + 3" -> "2023", "5 + 3") and trim stray operators / parens."""
    runs: list[list[str]] = [[]]
    for tok in tokens:
        prev = runs[-1][-1] if runs[-1] else None
        if prev is not None and (prev == ")" or prev[0].isdigit() or prev[0] == ".") and (
                tok == "(" or tok[0].isdigit() or tok[0] == "."):
            runs.append([])
        runs[-1].append(tok)
    out = []
    for run in runs:
        while run and run[0] in ("*", "/", "//", "%", "**", ")"):
            run = run[1:]
        while run and run[-1] in (*_BINARY, "("):
            run = run[:-1]
        while run and run[0] == "(" and run.count("(") > run.count(")"):
            run = run[1:]
        while run and run[-1] == ")" and run.count(")") > run.count("("):
            run = run[:-1]
        if any(t in _BINARY for t in run[1:]):
            out.append(run)
    return out


class _Parser:
    """expr := term (+|- term)*; term := unary (*|/|//|% unary)*; unary := (-|+) unary | power;
    power := atom (** unary)?; atom := NUMBER | ( expr ). Builds tuples: ("num", v) | ("neg", x) | (op, l, r)."""

    def __init__(self, tokens: list[str]) -> None:
        self.toks, self.i, self.depth = tokens, 0, 0

    def parse(self) -> tuple:
        node = self.expr()
        if self.i != len(self.toks):
            raise SyntaxError("trailing tokens")
        return node

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise SyntaxError("unexpected end")
        self.i += 1
        return tok

    def expr(self) -> tuple:
        node = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            node = (op, node, self.term())
        return node

    def term(self) -> tuple:
        node = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op = self.take()
            node = (op, node, self.unary())
        return node

    def unary(self) -> tuple:
        self.depth += 1
        if self.depth > MAX_EXPR_DEPTH:
            raise ToolError(f"arithmetic expression nested more than {MAX_EXPR_DEPTH} levels deep")
        try:
            if self.peek() in ("-", "+"):
                op = self.take()
                inner = self.unary()
                return ("neg", inner) if op == "-" else inner
            node = self.atom()
            if self.peek() == "**":
                self.take()
                node = ("**", node, self.unary())
            return node
        finally:
            self.depth -= 1

    def atom(self) -> tuple:
        tok = self.take()
        if tok == "(":
            node = self.expr()
            if self.take() != ")":
                raise SyntaxError("unbalanced parenthesis")
            return node
        if not (tok[0].isdigit() or tok[0] == "."):
            raise SyntaxError(f"unexpected {tok!r}")
        if len(tok) > 320:
            raise ToolError("result too large (a number has more than 300 digits)")
        return ("num", float(tok) if any(c in tok for c in ".eE") else int(tok))


def _check(x: float) -> float:
    if isinstance(x, complex):
        raise ToolError("the result is not a real number")
    if isinstance(x, float) and math.isnan(x):
        raise ToolError("the result is not a number")
    if abs(x) > MAX_MAGNITUDE:
        raise ToolError(f"result too large (magnitude over {MAX_MAGNITUDE:g})")
    return x


def _walk(node: tuple) -> float:
    if node[0] == "num":
        return _check(node[1])
    if node[0] == "neg":
        return _check(-_walk(node[1]))
    op, left, right = node[0], _walk(node[1]), _walk(node[2])
    try:
        if op == "+":
            return _check(left + right)
        if op == "-":
            return _check(left - right)
        if op == "*":
            return _check(left * right)
        if op == "/":
            return _check(left / right)
        if op == "//":
            return _check(left // right)
        if op == "%":
            return _check(left % right)
        if abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right:g} is too large (at most {MAX_EXPONENT} in magnitude)")
        return _check(left**right)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError(f"result too large (magnitude over {MAX_MAGNITUDE:g})") from None


def format_number(x: float) -> str:
    """Exact for integers (``150``, ``4`` for 4.0), else 12 significant digits (``2.5``, ``0.333333333333``)."""
    if isinstance(x, int):
        return str(x)
    if x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return format(x, ".12g")


def calculate(expression: str) -> str:
    """Evaluate the first arithmetic expression in free text ("I will calculate 12 / 3 now" -> "4")."""
    for m in _SEGMENT.finditer(expression):
        if not any(c.isdigit() for c in m.group(0)):
            continue
        for cand in _candidates(_tokens(m.group(0))):
            if len(cand) > MAX_EXPR_TOKENS:
                raise ToolError(f"arithmetic expression longer than {MAX_EXPR_TOKENS} tokens")
            try:
                tree = _Parser(cand).parse()
            except SyntaxError:
                continue
            return format_number(_walk(tree))
    raise ToolError(f"no arithmetic expression in {_short(expression)}")


# ---- search_text -----------------------------------------------------------------------------------------------
_STOP = frozenset([
    "the", "and", "for", "are", "was", "were", "with", "that", "this", "what", "which", "who", "whom", "how",
    "why", "when", "where", "from", "into", "has", "have", "had", "not", "but", "you", "your", "his", "her",
    "its", "our", "their", "they", "them", "she", "him", "did", "does", "can", "will", "would", "should",
    "could", "there", "here", "about", "been", "being", "than", "then", "also", "any", "all", "some", "such",
    "only", "very", "just", "more", "most", "other", "over", "out", "off", "each", "per", "via", "yes",
])
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+|\n\s*\n")
_WORD = re.compile(r"\w+")


def _terms(text: str) -> set[str]:
    out = set()
    for w in _WORD.findall(text.lower()):
        if len(w) > 2 and w not in _STOP:
            out.add(w[:-1] if len(w) > 4 and w.endswith("s") else w)
    return out


def search_text(query: str, text: str, top_k: str = "1") -> str:
    try:
        k = int(top_k.strip())
    except ValueError:
        raise ToolError(f"top_k must be an integer from 1 to 10, got {_short(top_k)}") from None
    if not 1 <= k <= 10:
        raise ToolError(f"top_k must be an integer from 1 to 10, got {k}")
    if not text.strip():
        raise ToolError("the text to search is empty")
    wanted = _terms(query)
    if not wanted:
        raise ToolError(f"the query {_short(query)} has no content terms")
    fragments = [" ".join(f.split()) for f in _SENTENCE_SPLIT.split(text)]
    sentences = [f for f in fragments if len(f.split()) >= 4] or [f for f in fragments if f]
    scored = [(len(wanted & _terms(s)), -i, s) for i, s in enumerate(sentences)]
    best = [s for s in sorted(scored, reverse=True)[:k] if s[0] > 0]
    if not best:
        raise ToolError(f"no sentence of the text shares a term with the query {_short(query)}")
    return "\n".join(s[:MAX_SENTENCE_CHARS] for _, _, s in best)


# ---- JSON ------------------------------------------------------------------------------------------------------
_FENCE = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n?(.*?)```", re.DOTALL)


def parse_json_lenient(text: str, what: str = "value") -> Any:
    """Strict ``json.loads`` first; then the content of a ```json fence; then the first {...} / [...] embedded in
    text. Raises ToolError with the strict parser's error (line, column) if none parses."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        first = e
    except RecursionError:
        raise ToolError(f"{what} is nested too deeply") from None
    decoder = json.JSONDecoder()
    fence = _FENCE.search(text)
    tries: list[tuple[str, int]] = [(fence.group(1).strip(), 0)] if fence else []
    starts = sorted(i for i in (text.find("{"), text.find("[")) if i >= 0)
    tries += [(text, i) for i in starts]
    for source, start in tries:
        try:
            obj, end = decoder.raw_decode(source, start)
        except (json.JSONDecodeError, RecursionError):
            continue
        if source is not text and source[end:].strip():
            continue  # a fence must hold exactly one value
        return obj
    raise ToolError(f"{what} is not valid JSON: {first}")


def _regex_search(pattern: str, text: str) -> Any:
    try:
        return regex.search(pattern, text, timeout=REGEX_TIMEOUT_S)
    except TimeoutError:
        raise ToolError(f"the pattern {_short(pattern)} ran out of its {REGEX_TIMEOUT_S * 1000:.0f} ms budget") \
            from None


def _kw_pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not _regex_search(patrn, instance):
        yield ValidationError(f"{_short(instance)} does not match {patrn!r}")


def _kw_pattern_properties(validator: Any, pattern_props: Mapping, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "object"):
        for patrn, sub in pattern_props.items():
            for k, v in instance.items():
                if _regex_search(patrn, k):
                    yield from validator.descend(v, sub, path=k, schema_path=patrn)


def _kw_additional_properties(validator: Any, ap: Any, instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    props = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [k for k in instance if k not in props and not any(_regex_search(p, k) for p in patterns)]
    if validator.is_type(ap, "object"):
        for k in extras:
            yield from validator.descend(instance[k], ap, path=k)
    elif ap is False and extras:
        yield ValidationError(f"additional properties are not allowed ({', '.join(map(repr, sorted(extras)))})")


_Validator = jsonschema.validators.extend(Draft202012Validator, {
    "pattern": _kw_pattern, "patternProperties": _kw_pattern_properties,
    "additionalProperties": _kw_additional_properties})


def json_validate(value: str, schema: str) -> str:
    obj = parse_json_lenient(value, "value")
    try:
        schema_obj = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ToolError(f"schema is not valid JSON: {e}") from None
    try:
        Draft202012Validator.check_schema(schema_obj)
        validator = _Validator(schema_obj, format_checker=Draft202012Validator.FORMAT_CHECKER)
        errors = list(islice(validator.iter_errors(obj), 4))
    except jsonschema.SchemaError as e:
        raise ToolError(f"invalid schema at {e.json_path}: {e.message[:200]}") from None
    except referencing.exceptions.Unresolvable as e:
        raise ToolError(f"invalid schema: unresolvable reference {e}") from None
    if errors:
        shown = "; ".join(f"at {e.json_path}: {e.message[:200]}" for e in errors[:3])
        more = " (and more)" if len(errors) > 3 else ""
        raise ToolError(f"value does not match the schema: {shown}{more}")
    return json.dumps(obj, ensure_ascii=False)


def json_get(value: str, path: str) -> str:
    obj = parse_json_lenient(value, "value")
    try:
        parsed = parse_path(path.strip())
    except ValueError as e:
        raise ToolError(str(e)) from None
    found = get_path(obj, parsed)
    if found is MISSING:
        raise ToolError(f"no value at path {path.strip()!r}")
    return found if isinstance(found, str) else json.dumps(found, ensure_ascii=False, separators=(",", ":"))


# ---- regex_extract ---------------------------------------------------------------------------------------------
def regex_extract(text: str, pattern: str) -> str:
    if len(pattern) > MAX_PATTERN:
        raise ToolError(f"the pattern is longer than {MAX_PATTERN} characters")
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise ToolError(f"bad regex pattern {pattern!r}: {e}") from None
    try:
        m = compiled.search(text, timeout=REGEX_TIMEOUT_S)
    except TimeoutError:
        raise ToolError(f"the pattern {_short(pattern)} ran out of its {REGEX_TIMEOUT_S * 1000:.0f} ms budget") \
            from None
    if m is None:
        raise ToolError(f"the pattern {_short(pattern)} does not match the text")
    return (m.group(1) or "") if compiled.groups else m.group(0)


# ---- the registry ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerTool:
    name: str
    params: tuple[str, ...]  # required args
    optional: tuple[str, ...]  # optional args
    description: str
    fn: Callable[..., str] = field(repr=False, compare=False)

    def run(self, args: Mapping[str, str]) -> str:
        """Run on string args (required ones present, no unknown ones); raises ToolError only."""
        missing = [p for p in self.params if p not in args]
        unknown = [a for a in args if a not in self.params and a not in self.optional]
        if missing or unknown:
            raise ToolError(f"{self.name}: missing args {missing}, unknown args {unknown}")
        for name, arg in args.items():
            if not isinstance(arg, str):
                raise ToolError(f"{self.name}: arg {name!r} must be a string")
            if len(arg) > MAX_INPUT_BYTES or len(arg.encode("utf-8")) > MAX_INPUT_BYTES:
                raise ToolError(f"{self.name}: arg {name!r} is larger than {MAX_INPUT_BYTES} bytes")
        try:
            return self.fn(**args)
        except RecursionError:
            raise ToolError(f"{self.name}: input nested too deeply") from None
        except MemoryError:
            raise ToolError(f"{self.name}: out of memory") from None


SERVER_TOOLS: Mapping[str, ServerTool] = {t.name: t for t in (
    ServerTool("calculator", ("expression",), (), "evaluates the first arithmetic expression in the text "
               "(+ - * / // % **, parentheses)", calculate),
    ServerTool("search_text", ("query", "text"), ("top_k",), "the top_k (1) sentences of text sharing the most "
               "terms with query", search_text),
    ServerTool("json_validate", ("value", "schema"), (), "the JSON value re-serialized if it validates against "
               "the JSON schema, else an error naming the path", json_validate),
    ServerTool("json_get", ("value", "path"), (), "the field at path a.b[0].c (strings bare, other values as "
               "JSON)", json_get),
    ServerTool("regex_extract", ("text", "pattern"), (), "the first match of pattern (group 1 if it has groups), "
               "100 ms budget", regex_extract),
)}


def check_args(name: str, given: Collection[str], where: str) -> ServerTool:
    """Validate a server tool call at submission; ``where`` is the step path (``steps[2].tool``)."""
    tool = SERVER_TOOLS.get(name)
    if tool is None:
        raise InvalidRequestError(f"unknown server tool {name!r}; server tools: {', '.join(SERVER_TOOLS)} "
                                  "(use runs: \"client\" for a tool a worker runs)", param=f"{where}.name")
    missing = [p for p in tool.params if p not in given]
    if missing:
        raise InvalidRequestError(f"server tool {name!r} needs the arg(s) {', '.join(map(repr, missing))}",
                                  param=f"{where}.args")
    for arg in given:
        if arg not in tool.params and arg not in tool.optional:
            allowed = ", ".join((*tool.params, *tool.optional))
            raise InvalidRequestError(f"server tool {name!r} has no arg {arg!r} (args: {allowed})",
                                      param=f"{where}.args.{arg}")
    return tool
