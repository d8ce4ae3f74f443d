"""Parrot: an LLM service for applications. ``import parrot as P`` gives the frontend (paper §4.1, Fig. 7)::

    import parrot as P

    @P.semantic_function(max_tokens=64)
    def write_code(task: P.SemanticVariable):
        '''You are an expert software engineer.
        Write python code of {{input:task}}.
        Code: {{output:code}}'''

    with P.connect("http://127.0.0.1:8000"):      # or P.local() for an in-process server
        code = write_code("a snake game")           # returns at once: a future
        print(code.get(perf=P.LATENCY))

Names are imported lazily (PEP 562), so ``import parrot`` (and importing any ``parrot.*`` submodule, which
runs this file first) stays cheap: neither torch nor fastapi nor httpx is loaded until a name is used.
The default session set by ``P.connect`` / ``P.local`` is the frontend's one deliberate global.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> (module, attribute)
_EXPORTS: dict[str, tuple[str, str]] = {
    "SemanticVariable": ("parrot.frontend.variable", "SemanticVariable"),
    "PerfCriteria": ("parrot.common.perf", "PerfCriteria"),
    "LATENCY": ("parrot.frontend.variable", "LATENCY"),
    "Latency": ("parrot.frontend.variable", "Latency"),
    "THROUGHPUT": ("parrot.frontend.variable", "THROUGHPUT"),
    "semantic_function": ("parrot.frontend.function", "semantic_function"),
    "SemanticFunction": ("parrot.frontend.function", "SemanticFunction"),
    "Output": ("parrot.frontend.function", "Output"),
    "native_function": ("parrot.frontend.native", "native_function"),
    "NativeFunction": ("parrot.frontend.native", "NativeFunction"),
    "Session": ("parrot.frontend.client", "Session"),
    "connect": ("parrot.frontend.client", "connect"),
    "default_session": ("parrot.frontend.client", "default_session"),
    "local": ("parrot.frontend.local", "local"),
    # flows: branches and loops run by the server (docs/flows.md)
    "flow": ("parrot.frontend.flow", "flow"),
    "trace": ("parrot.frontend.flow", "trace"),
    "branch": ("parrot.frontend.flow", "branch"),
    "loop": ("parrot.frontend.flow", "loop"),
    "map": ("parrot.frontend.flow", "map"),
    "text": ("parrot.frontend.flow", "text"),
    "tool": ("parrot.frontend.flow", "tool"),
    "FlowVar": ("parrot.frontend.flow", "FlowVar"),
    "FlowRun": ("parrot.frontend.flow", "FlowRun"),
    "TracedFlow": ("parrot.frontend.flow", "TracedFlow"),
    "Cond": ("parrot.frontend.conditions", "Cond"),
    # transform spec builders (data; validated when a function is defined)
    "strip": ("parrot.common.transforms", "strip"),
    "first_line": ("parrot.common.transforms", "first_line"),
    "lines": ("parrot.common.transforms", "lines"),
    "regex": ("parrot.common.transforms", "regex_group"),
    "json_field": ("parrot.common.transforms", "json_field"),
    "remove_prefix": ("parrot.common.transforms", "remove_prefix"),
    "remove_suffix": ("parrot.common.transforms", "remove_suffix"),
    "lower": ("parrot.common.transforms", "lower"),
    "upper": ("parrot.common.transforms", "upper"),
    "replace": ("parrot.common.transforms", "replace"),
    "truncate": ("parrot.common.transforms", "truncate"),
    # typed errors users commonly catch
    "ParrotError": ("parrot.common.errors", "ParrotError"),
    "StepFailed": ("parrot.common.errors", "StepFailed"),
    "ConstraintIncomplete": ("parrot.common.errors", "ConstraintIncomplete"),
    "Constraint": ("parrot.common.constraints", "Constraint"),
    "TemplateError": ("parrot.common.errors", "TemplateError"),
    "TransformSpecError": ("parrot.common.errors", "TransformSpecError"),
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'parrot' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # static names for type checkers and IDEs
    from parrot.common.constraints import Constraint
    from parrot.common.errors import ConstraintIncomplete, ParrotError, StepFailed, TemplateError, TransformSpecError
    from parrot.common.perf import PerfCriteria
    from parrot.common.transforms import (first_line, json_field, lines, lower, remove_prefix, remove_suffix,
                                          replace, strip, truncate, upper)
    from parrot.common.transforms import regex_group as regex
    from parrot.frontend.client import Session, connect, default_session
    from parrot.frontend.function import Output, SemanticFunction, semantic_function
    from parrot.frontend.local import local
    from parrot.frontend.native import NativeFunction, native_function
    from parrot.frontend.variable import LATENCY, THROUGHPUT, Latency, SemanticVariable
