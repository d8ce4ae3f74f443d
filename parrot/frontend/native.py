"""Native functions: ordinary Python run in the client process (the paper forbids server-side user code).

::

    @P.native_function
    def count_words(text: str) -> str:
        return str(len(text.split()))

    n = count_words(summary)      # returns an output variable at once; runs when `summary` is ready

The call returns output variables immediately. The function runs in the session's thread pool: its
SemanticVariable arguments are fetched first (``get`` with the function's ``perf``), then it is called with
plain strings; other arguments are passed unchanged. It must return ``str`` (one output) or a tuple/list of
``len(outputs)`` strings. Its exception surfaces at its outputs' ``get``; semantic outputs computed from
them fail with ``StepFailed`` (cause ``native_function_failed``).

A native function that calls a tool (an API, a search, a code runner) says so, LAMPS-style::

    @P.native_function(tool="search", expected_duration_s=0.8)
    def search(query: str) -> str: ...

Its outputs are then created on the server at once, declared as that tool's outputs on its Semantic Variable
arguments: the server pauses the context of the generate producing those arguments while the tool runs (the
follow-up prompt continuing it reuses its KV), predicts the tool's duration (``expected_duration_s`` until it has
observed the tool) and learns it from when the value arrives.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import itertools
import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from parrot.common.perf import PerfCriteria
from parrot.frontend.client import Session, resolve_session
from parrot.frontend.variable import LATENCY, SemanticVariable

log = logging.getLogger(__name__)

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # as the server checks it (parrot.manager.graph.TOOL_NAME)


class NativeFunction:
    """A client-side function in the Parrot data flow. See the module docstring."""

    def __init__(self, fn: Callable[..., Any], *, outputs: int | Sequence[str] = 1,
                 perf: PerfCriteria | str = LATENCY, input_timeout: float | None = None, tool: str | None = None,
                 expected_duration_s: float | None = None) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", "native_function")
        if tool is not None and not (isinstance(tool, str) and _TOOL_NAME.match(tool)):
            raise ValueError(f"native function {self.name!r}: tool must be 1..64 of a-z, A-Z, 0-9, '_', '-', '.', "
                             f"got {tool!r}")
        if expected_duration_s is not None:
            if tool is None:
                raise ValueError(f"native function {self.name!r}: expected_duration_s needs tool=")
            if isinstance(expected_duration_s, bool) or not isinstance(expected_duration_s, (int, float)) \
                    or not (0 < expected_duration_s < math.inf):
                raise ValueError(f"native function {self.name!r}: expected_duration_s must be a positive finite "
                                 f"number, got {expected_duration_s!r}")
        self.tool = tool
        self.expected_duration_s = None if expected_duration_s is None else float(expected_duration_s)
        if isinstance(outputs, int):
            if outputs < 1:
                raise ValueError(f"native function {self.name!r}: outputs must be >= 1, got {outputs}")
            names = ["output"] if outputs == 1 else [f"output{i}" for i in range(outputs)]
        else:
            names = [str(n) for n in outputs]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"native function {self.name!r}: outputs must be distinct names, got {names}")
        self.output_names: tuple[str, ...] = tuple(names)
        self.perf = PerfCriteria(perf)
        self.input_timeout = input_timeout
        self.signature = inspect.signature(fn)
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, session: Session | None = None, **kwargs: Any
                 ) -> SemanticVariable | tuple[SemanticVariable, ...]:
        from parrot.frontend.flow import active_tracer  # here: parrot.frontend.flow imports this module

        tracer = active_tracer(itertools.chain(args, kwargs.values()))
        if tracer is not None:  # inside a flow being traced: a client tool step (docs/flows.md)
            return tracer.client_tool(self, args, kwargs)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.name}(): {e}") from None
        s = resolve_session(session)
        futures = [concurrent.futures.Future() for _ in self.output_names]
        inputs = tuple(v for v in bound.arguments.values() if isinstance(v, SemanticVariable))
        outs = tuple(SemanticVariable._native_output(n, s, f, inputs, f"native function {self.name}")
                     for n, f in zip(self.output_names, futures))
        if self.tool is not None:  # declared on the server now: the generates feeding it pause for it
            decl = {"name": self.tool, "inputs": [v._bind(s) for v in inputs],
                    "expected_duration_s": self.expected_duration_s}
            for out in outs:
                out._bind_tool_output(s, decl)
        s.native_pool.submit(self._run, bound, futures)
        return outs[0] if len(outs) == 1 else outs

    def _run(self, bound: inspect.BoundArguments, futures: list[concurrent.futures.Future]) -> None:
        """Worker body: fetch inputs, call, distribute results. Never raises (errors go to the futures)."""
        for f in futures:
            f.set_running_or_notify_cancel()
        try:
            for k, v in bound.arguments.items():  # this BoundArguments is private to this call
                if isinstance(v, SemanticVariable):
                    bound.arguments[k] = v.get(perf=self.perf, timeout=self.input_timeout)
            result = self.fn(*bound.args, **bound.kwargs)
            values = self._split(result)
        except BaseException as e:  # noqa: BLE001 -- any failure of user code belongs to its outputs
            log.info("native function %s failed: %r", self.name, e)
            for f in futures:
                f.set_exception(e)
            return
        for f, value in zip(futures, values):
            f.set_result(value)

    def _split(self, result: Any) -> list[str]:
        n = len(self.output_names)
        values = [result] if n == 1 and isinstance(result, str) else result
        if not isinstance(values, (list, tuple)) or len(values) != n or not all(isinstance(v, str) for v in values):
            raise TypeError(f"native function {self.name!r} must return {'a str' if n == 1 else f'{n} strs'}, "
                            f"got {result!r:.200}")
        return list(values)

    def __repr__(self) -> str:
        return f"NativeFunction({self.name}{self.signature} -> {self.output_names})"


def native_function(fn: Callable | None = None, /, *, outputs: int | Sequence[str] = 1,
                    perf: PerfCriteria | str = LATENCY, input_timeout: float | None = None, tool: str | None = None,
                    expected_duration_s: float | None = None) -> Any:
    """Decorator (bare or with arguments) making a :class:`NativeFunction`; ``tool``: it calls that tool (module
    docstring), ``expected_duration_s`` its expected duration."""

    def wrap(f: Callable) -> NativeFunction:
        return NativeFunction(f, outputs=outputs, perf=perf, input_timeout=input_timeout, tool=tool,
                              expected_duration_s=expected_duration_s)

    return wrap(fn) if fn is not None else wrap
