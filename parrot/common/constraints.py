"""What a constrained generation must produce: a JSON schema, any JSON object, a regex, one of a list of
choices, or a grammar (Lark, or llama.cpp's GBNF). One plain value shared by the frontend, the APIs, the wire
and the engine; the engine turns it into per-token masks (parrot.engine.runtime.guided).

A constraint is checked when it is built: the grammar it stands for must compile (llguidance, without a
tokenizer: syntax, regexes, schema keywords), else :class:`BadSamplingParams` names the problem, so a bad
schema is a 400 at the edge and never reaches an engine. The spec is kept as compact text (a schema as JSON
without whitespace, its key order kept: properties are generated in the order the schema declares them), so
equal constraints are equal values and engines cache compiled grammars by value.

Generation under a constraint ends when the grammar is complete (the engine finishes with ``stop``); stop
strings and ``max_tokens`` still apply and may cut it short (``length`` then says the value is incomplete).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Any

from parrot.common.errors import BadSamplingParams

MAX_SPEC_CHARS = 64 * 1024  # a schema / grammar larger than this is refused (compile time and memory are bounded)
MAX_CHOICES = 1024


class ConstraintKind(str, Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
    REGEX = "regex"  # Rust regex syntax (https://docs.rs/regex), matched against the whole output
    CHOICE = "choice"  # exactly one of the strings
    GRAMMAR = "grammar"  # Lark (llguidance's dialect) or GBNF


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    spec: str = ""  # schema: compact JSON, key order kept; choice: JSON list; regex / grammar: the text; json_object: ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            try:
                object.__setattr__(self, "kind", ConstraintKind(self.kind))
            except ValueError:
                kinds = ", ".join(k.value for k in ConstraintKind)
                raise BadSamplingParams(f"constraint kind must be one of {kinds}, got {self.kind!r}",
                                        param="constraint") from None
        if not isinstance(self.spec, str):
            raise BadSamplingParams("constraint spec must be a string", param="constraint")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise BadSamplingParams(f"{self.kind.value} constraint is {len(self.spec)} characters; the limit is "
                                    f"{MAX_SPEC_CHARS}", param="constraint")
        error = _grammar_error(self.kind, self.spec)
        if error:
            raise BadSamplingParams(f"{self.kind.value} constraint does not compile: {error}", param="constraint")

    # ---- builders ----------------------------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise BadSamplingParams(f"json_schema is not valid JSON: {e}", param="constraint") from None
        if not isinstance(schema, dict):
            raise BadSamplingParams("json_schema must be a JSON object (a schema)", param="constraint")
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        if not isinstance(pattern, str) or not pattern:
            raise BadSamplingParams("regex must be a non-empty string", param="constraint")
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> "Constraint":
        if (not isinstance(options, (list, tuple)) or not options or len(options) > MAX_CHOICES
                or any(not isinstance(o, str) or not o for o in options)):
            raise BadSamplingParams(f"choice must be a list of 1..{MAX_CHOICES} non-empty strings",
                                    param="constraint")
        return cls(ConstraintKind.CHOICE, json.dumps(list(options)))

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        if not isinstance(text, str) or not text.strip():
            raise BadSamplingParams("grammar must be a non-empty string", param="constraint")
        return cls(ConstraintKind.GRAMMAR, text)

    # ---- views -------------------------------------------------------------------------------------------------
    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(json.loads(self.spec)) if self.kind is ConstraintKind.CHOICE else ()

    @property
    def schema(self) -> dict[str, Any] | None:
        if self.kind is ConstraintKind.JSON_SCHEMA:
            return json.loads(self.spec)
        return {"type": "object"} if self.kind is ConstraintKind.JSON_OBJECT else None

    @property
    def is_json(self) -> bool:
        return self.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT)

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's serialized form (what an ``LLMatcher`` compiles)."""
        return _to_llguidance(self.kind, self.spec)

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind.value, "spec": self.spec}

    @classmethod
    def from_dict(cls, d: Any) -> "Constraint":
        if isinstance(d, Constraint):
            return d
        if not isinstance(d, dict) or set(d) - {"kind", "spec"} or "kind" not in d:
            raise BadSamplingParams('constraint must be {"kind": ..., "spec": ...}', param="constraint")
        return cls(d["kind"], d.get("spec", ""))


# JSON compile defaults: whitespace between JSON tokens is allowed (models pretty-print) but bounded, so a model
# cannot run to max_tokens emitting blanks inside a value (seen with SmolLM2 and the library's unbounded default).
# A schema's own "x-guidance" options override these.
JSON_DEFAULTS = {"whitespace_pattern": "[ \t\n\r]{0,40}"}


def _to_llguidance(kind: ConstraintKind, spec: str) -> str:
    from llguidance import LLMatcher, grammar_from  # light (no torch); imported where a grammar is built

    if kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT):
        return LLMatcher.grammar_from_json_schema(spec if kind is ConstraintKind.JSON_SCHEMA else '{"type": "object"}',
                                                  defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    fmt = {ConstraintKind.REGEX: "regex", ConstraintKind.CHOICE: "choice", ConstraintKind.GRAMMAR: "grammar"}[kind]
    return grammar_from(fmt, spec)  # type: ignore[arg-type]


@lru_cache(maxsize=256)  # a pure memo of (kind, spec) -> error: validation costs up to milliseconds per schema
def _grammar_error(kind: ConstraintKind, spec: str) -> str:
    """'' if the constraint's grammar compiles, else the compiler's message."""
    from llguidance import LLMatcher

    try:
        grammar = _to_llguidance(kind, spec)
    except (ValueError, TypeError) as e:  # bad JSON text, a GBNF that does not convert
        return str(e)
    return LLMatcher.validate_grammar(grammar)
