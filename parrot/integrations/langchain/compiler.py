"""Trace an LCEL chain into Semantic-Variable calls (paper §6: "the template itself and the variables to render it
need to be wrapped as a SemanticFunction").

The tracer runs the chain's structure on *symbolic* values instead of text:

    value                    what it stands for                         materialized (read) as
    ----------------------   ----------------------------------------   ---------------------------------------
    SymText(var, message)    a string in the session (an LLM output)    str, or AIMessage for a chat model's
    SymPrompt(prompt, ...)   a prompt formatted with sentinel slots     the PromptValue LangChain would build
    dict / list / str / ...  plain Python holding any of the above      the same with every symbol read

A prompt template is formatted with a sentinel (``\\ue000<slot>\\ue001``, private-use code points) for each input
whose value is a string or a SymText; the model step after it turns the sentinel text into a Parrot template
(each sentinel -> ``{{input:NAME}}``, ``{{output:text}}`` at the end; a chat model first renders the messages with
the served model's chat template) and queues a call of a :class:`~parrot.frontend.function.SemanticFunction` on
the slots' variables, with its output variable made here. Nothing waits: a whole chain (sequences, parallel
branches, ``.map()``, chains of chains) is traced, then sent by :meth:`Tracer.flush` in two concurrent waves (every
variable created, then every submit: outputs exist before their consumers are submitted, so no submit waits for
another's answer and a chain of any length costs two round trips), and steps run on the server as a DAG with prefix
sharing. Only the final value is read (``materialize``, which flushes first).

Handlers are chosen by the runnable's class (first match along its MRO in :data:`_HANDLERS`):
RunnableSequence, RunnableParallel, RunnablePassthrough, RunnableAssign, RunnablePick, RunnableEach,
RunnableBinding (``.bind`` / ``.with_config``), RunnableLambda of ``operator.itemgetter``, prompt templates,
ParrotLLM / ChatParrot, StrOutputParser. Anything else runs **client-side**: its input is read (waiting for
the server), the runnable is invoked as LangChain would, and tracing goes on with its concrete output (other output
parsers always parse there, as in LangChain; other models and lambdas with a warning). ``strict=True`` raises
:class:`UnsupportedRunnable` naming the runnable instead (output parsers stay allowed). Text is never rendered
into a prompt silently: constant prompt text that would read as a placeholder (``{{``) is a
:class:`ChainCompileError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor
import logging
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from langchain_core.language_models import BaseLanguageModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.output_parsers import BaseOutputParser, StrOutputParser
from langchain_core.prompt_values import ChatPromptValue, PromptValue
from langchain_core.prompts import BasePromptTemplate
from langchain_core.prompts.chat import BaseChatPromptTemplate
from langchain_core.runnables import (Runnable, RunnableBinding, RunnableLambda, RunnableParallel, RunnablePassthrough,
                                      RunnableSequence)
from langchain_core.runnables.base import RunnableEachBase
from langchain_core.runnables.config import RunnableConfig
from langchain_core.runnables.passthrough import RunnableAssign, RunnablePick

from parrot.common.errors import InvalidRequestError, TemplateError
from parrot.common.perf import PerfCriteria
from parrot.common.template import MAX_NAME_LEN, placeholders
from parrot.frontend.client import Session
from parrot.frontend.function import Output, SemanticFunction
from parrot.frontend.variable import SemanticVariable
from parrot.integrations.langchain.models import ChatParrot, ParrotLLM, message_dicts, render_chat

log = logging.getLogger(__name__)

_SLOT = re.compile("\ue000(\\d+)\ue001")
_NON_IDENT = re.compile(r"[^A-Za-z0-9_]")


class UnsupportedRunnable(InvalidRequestError):
    """A runnable the compiler does not turn into Parrot calls, met with ``strict=True`` (``param`` names it)."""

    code = "unsupported_runnable"


class ChainCompileError(TemplateError):
    """A prompt that cannot become a Parrot template (its constant text holds ``{{``, which Parrot templates
    read as a placeholder); ``param`` names the step."""


@dataclass(frozen=True, eq=False)
class SymText:
    """A string produced in the session; ``message``: a chat model's output (read as an AIMessage)."""

    var: SemanticVariable
    message: bool = False


@dataclass(frozen=True, eq=False)
class SymPrompt:
    """A prompt template formatted with sentinel slots: ``text`` (string prompts) or ``messages`` (chat)."""

    prompt: BasePromptTemplate | None  # None: a prompt made from a plain string / message list input
    inputs: Any  # what the prompt was invoked with (read back by ``materialize``)
    text: str | None
    messages: list[BaseMessage] | None


@dataclass(frozen=True)
class PendingCall:
    """A traced ``prompt | model`` step not sent yet: ``fn`` called on ``bindings``, producing into ``output``."""

    fn: SemanticFunction
    bindings: dict[str, SemanticVariable]
    output: SemanticVariable


MAX_SEND_THREADS = 16  # concurrent HTTP calls of one flush wave


@dataclass(frozen=True)
class TracedStep:
    """One step of a trace: ``where`` is ``"server"`` (submitted as a semantic function) or ``"client"``."""

    name: str
    kind: str
    where: str


class Tracer:
    """Traces chains into one session. ``steps`` lists what ran where, in order; ``slots`` maps a sentinel's
    number to its variable and placeholder name."""

    def __init__(self, session: Session, *, strict: bool = False, config: RunnableConfig | None = None,
                 perf: PerfCriteria = PerfCriteria.LATENCY, pending: list[PendingCall] | None = None) -> None:
        """``pending``: the queue of unsent calls (tracers of one batch share one, so one flush sends them all)."""
        self.session = session
        self.pending: list[PendingCall] = [] if pending is None else pending
        self.strict = strict
        self.config = config
        self.perf = perf
        self.steps: list[TracedStep] = []
        self.slots: list[tuple[SemanticVariable, str]] = []
        self._names: list[str] = []

    # ---- dispatch -----------------------------------------------------------------------------------------------
    def run(self, runnable: Runnable, value: Any) -> Any:
        """The (symbolic) output of ``runnable`` on the (symbolic) ``value``."""
        handler = handler_for(runnable)
        if handler is None:
            return self.client_side(runnable, value, "is not compiled to Parrot calls")
        return handler(self, runnable, value)

    def client_side(self, runnable: Runnable, value: Any, why: str, *, quiet: bool = False) -> Any:
        """Run ``runnable`` here on the read input (waits for the server). UnsupportedRunnable when strict, except
        for ``quiet`` steps (output parsers: LangChain parses client-side too)."""
        name = runnable.get_name()
        if self.strict and not quiet:
            raise UnsupportedRunnable(f"{name} ({type(runnable).__name__}) {why}; compile_chain(strict=False) runs "
                                      "it client-side on its read input", param=name)
        (log.info if quiet else log.warning)("%s %s: running it client-side (the chain waits here for its input)",
                                             name, why)
        self.steps.append(TracedStep(name, type(runnable).__name__, "client"))
        return runnable.invoke(self.materialize(value), self.config)

    @contextlib.contextmanager
    def named(self, name: str | None) -> Iterator[None]:
        """Steps traced inside get ``name`` (a ``run_name`` / runnable name) unless their prompt has one."""
        if name:
            self._names.append(name)
        try:
            yield
        finally:
            if name:
                self._names.pop()

    # ---- sending and reading ------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Send the queued calls: one concurrent wave creating every variable they use (inputs with their values,
        outputs empty), then one concurrent wave of submits, each output placeholder naming its made variable. A
        failed call raises its typed error here (the others stay submitted; the session's deletion cancels them)."""
        calls = list(self.pending)
        del self.pending[:]
        if not calls:
            return
        variables = {id(v): v for c in calls for v in (*c.bindings.values(), c.output)}
        with ThreadPoolExecutor(max_workers=MAX_SEND_THREADS, thread_name_prefix="parrot-lc-send") as pool:
            list(pool.map(lambda v: v.id, variables.values()))  # .id creates a variable in its session, once
            list(pool.map(self._submit, calls))

    def _submit(self, call: PendingCall) -> None:
        (out,) = call.fn.outputs
        holders = [out.to_placeholder(call.output.id) if p.is_output else
                   {"name": p.name, "is_output": False, "var_id": call.bindings[p.name].id}
                   for p in placeholders(call.fn.segments)]
        self.session.submit(call.fn.template, holders, list(call.fn.models), name=call.fn.name)

    def materialize(self, value: Any) -> Any:
        """``value`` with every symbol read (flushes, then waits for the server): the types LangChain returns."""
        self.flush()
        if isinstance(value, SymText):
            text = value.var.get(perf=self.perf)
            return AIMessage(content=text) if value.message else text
        if isinstance(value, SymPrompt):
            if value.prompt is None:
                return self.materialize(value.inputs)
            return value.prompt.invoke(self.materialize(value.inputs), self.config)
        if isinstance(value, dict):
            return {k: self.materialize(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.materialize(v) for v in value)
        return value

    # ---- slots and templates ------------------------------------------------------------------------------------
    def slot(self, value: str | SymText, name: str) -> str:
        """A sentinel standing for ``value`` in formatted prompt text (a str becomes a new ready variable)."""
        var = value.var if isinstance(value, SymText) else SemanticVariable(value, name=name, session=self.session)
        self.slots.append((var, name))
        return f"\ue000{len(self.slots) - 1}\ue001"

    def template(self, text: str, step: str) -> tuple[str, dict[str, SemanticVariable]]:
        """Sentinel text -> (Parrot template without the output, {placeholder name: variable})."""
        parts = _SLOT.split(text)
        consts = parts[0::2]
        for c in consts:
            if "{{" in c or c.endswith("{"):
                raise ChainCompileError(f"step {step!r}: the prompt's constant text holds '{{{{', which a Parrot "
                                        f"template reads as a placeholder (near {c[max(0, c.find('{') - 20):][:60]!r})",
                                        param=step)
        out, bindings = [consts[0]], {}
        for idx, const in zip(parts[1::2], consts[1:]):
            var, hint = self.slots[int(idx)]
            name = _unique(_identifier(hint), bindings)
            bindings[name] = var
            out += ["{{input:%s}}" % name, const]
        return "".join(out), bindings

    def step_name(self, prompt: SymPrompt, default: str) -> str:
        if prompt.prompt is not None and prompt.prompt.name:
            return prompt.prompt.name
        return self._names[-1] if self._names else default


def _identifier(hint: str) -> str:
    name = _NON_IDENT.sub("_", hint)[:MAX_NAME_LEN - 4] or "v"
    return "v_" + name if name[0].isdigit() else name


def _unique(name: str, taken: dict[str, Any]) -> str:
    if name not in taken and name != "text":
        return name
    n = 2
    while f"{name}_{n}" in taken:
        n += 1
    return f"{name}_{n}"


# ---- handlers ---------------------------------------------------------------------------------------------------
def _sequence(t: Tracer, seq: RunnableSequence, value: Any) -> Any:
    with t.named(seq.name):
        for step in seq.steps:
            value = t.run(step, value)
    return value


def _parallel(t: Tracer, par: RunnableParallel, value: Any) -> Any:
    return {key: t.run(step, value) for key, step in par.steps__.items()}


def _passthrough(t: Tracer, p: RunnablePassthrough, value: Any) -> Any:
    if p.func is None and p.afunc is None:
        return value
    return t.client_side(p, value, "calls a function on its input")


def _assign(t: Tracer, a: RunnableAssign, value: Any) -> Any:
    if not isinstance(value, dict):
        raise TypeError(f"the input to RunnablePassthrough.assign() must be a dict, got {type(value).__name__}")
    return {**value, **t.run(a.mapper, value)}


def _pick(t: Tracer, p: RunnablePick, value: Any) -> Any:
    if not isinstance(value, dict):
        raise TypeError(f"the input to RunnablePick must be a dict, got {type(value).__name__}")
    if isinstance(p.keys, str):
        return value.get(p.keys)
    return {k: value[k] for k in p.keys if k in value}


def _each(t: Tracer, each: RunnableEachBase, value: Any) -> Any:
    if not isinstance(value, (list, tuple)):
        return t.client_side(each, value, "maps over a value that is not a list")
    return [t.run(each.bound, v) for v in value]


def _lambda(t: Tracer, lam: RunnableLambda, value: Any) -> Any:
    if isinstance(lam.func, operator.itemgetter) and isinstance(value, dict):
        return lam.func(value)  # pure indexing: symbols pass through unread
    return t.client_side(lam, value, "is Python code")


def _binding(t: Tracer, b: RunnableBinding, value: Any) -> Any:
    if isinstance(b.bound, (ParrotLLM, ChatParrot)):
        with t.named(b.config.get("run_name")):
            return _model_step(t, b.bound, value, dict(b.kwargs))
    if b.kwargs:
        return t.client_side(b, value, f"binds arguments {sorted(b.kwargs)} to a runnable that is not a Parrot model")
    with t.named(b.config.get("run_name")):
        return t.run(b.bound, value)


def _prompt(t: Tracer, prompt: BasePromptTemplate, value: Any) -> Any:
    if not isinstance(value, dict):
        if len(prompt.input_variables) != 1:
            raise TypeError(f"Expected mapping type as input to {prompt.get_name()}. Received {type(value)}.")
        value = {prompt.input_variables[0]: value}
    missing = sorted(set(prompt.input_variables) - set(value))
    if missing:
        raise KeyError(f"Input to {prompt.get_name()} is missing variables {missing}. Expected: "
                       f"{prompt.input_variables} Received: {sorted(value)}")
    names = list(prompt.input_variables) + [v for v in prompt.optional_variables if v in value]
    kwargs = {}
    for name in names:
        v = value[name]
        if isinstance(v, (str, SymText)):
            kwargs[name] = t.slot(v, name)
        else:  # messages for a MessagesPlaceholder, numbers, ...: formatted as LangChain would, once read
            if _symbolic(v):
                log.warning("%s: input %r is not a string; reading it here to format it (the chain waits)",
                            prompt.get_name(), name)
            kwargs[name] = t.materialize(v)
    if isinstance(prompt, BaseChatPromptTemplate):
        return SymPrompt(prompt, value, None, prompt.format_messages(**kwargs))
    return SymPrompt(prompt, value, prompt.format(**kwargs), None)


def _symbolic(value: Any) -> bool:
    """Whether ``value`` holds a symbol (reading it waits for the server)."""
    if isinstance(value, (SymText, SymPrompt)):
        return True
    if isinstance(value, dict):
        return any(_symbolic(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_symbolic(v) for v in value)


def _as_prompt(t: Tracer, value: Any, model: Runnable) -> SymPrompt:
    """A model's input as a SymPrompt: a prompt step's output, or a string / messages given directly."""
    if isinstance(value, SymPrompt):
        return value
    if isinstance(value, (str, SymText)):
        return SymPrompt(None, value, t.slot(value, "prompt"), None)
    if isinstance(value, PromptValue):  # built client-side: its text becomes input variables
        value = value.to_messages() if isinstance(value, ChatPromptValue) else value.to_string()
        return _as_prompt(t, value, model)
    if isinstance(value, (list, tuple)) and all(isinstance(m, BaseMessage) for m in value):
        messages = [m.model_copy(update={"content": t.slot(m.content, "message")}) if isinstance(m.content, str)
                    else m for m in value]
        return SymPrompt(None, list(value), None, messages)
    raise ValueError(f"Invalid input type {type(value)} for {model.get_name()}. Must be a PromptValue, str, or "
                     "list of BaseMessages.")


def _model_step(t: Tracer, model: ParrotLLM | ChatParrot, value: Any, kwargs: dict[str, Any]) -> SymText:
    """``prompt | model``: one semantic function call (a submit); its output variable is returned unread."""
    prompt = _as_prompt(t, value, model)
    chat = isinstance(model, ChatParrot)
    name = t.step_name(prompt, model.get_name())
    if chat:
        messages = prompt.messages if prompt.messages is not None else [HumanMessage(content=prompt.text)]
        text = render_chat(model.server_model(), message_dicts(messages))
    else:
        text = prompt.text if prompt.text is not None else ChatPromptValue(messages=prompt.messages).to_string()
    template, bindings = t.template(text, name)
    sampling = model.sampling(**kwargs)
    fn = SemanticFunction(template + "{{output:text}}", name=name,
                          defaults=Output(**dataclasses.asdict(sampling)), models=[model.model] if model.model else ())
    output = SemanticVariable(name="text", session=t.session)
    t.pending.append(PendingCall(fn, bindings, output))  # sent by the next flush (before anything is read)
    t.steps.append(TracedStep(name, type(model).__name__, "server"))
    return SymText(output, message=chat)


def _model(t: Tracer, model: ParrotLLM | ChatParrot, value: Any) -> SymText:
    return _model_step(t, model, value, {})


def _str_parser(t: Tracer, parser: StrOutputParser, value: Any) -> Any:
    if isinstance(value, SymText):
        return SymText(value.var, message=False)
    return t.client_side(parser, value, "parses a value not produced by a Parrot model", quiet=True)


def _parser(t: Tracer, parser: BaseOutputParser, value: Any) -> Any:
    return t.client_side(parser, value, "parses its input (client-side, as in LangChain)", quiet=True)


def _foreign_model(t: Tracer, model: BaseLanguageModel, value: Any) -> Any:
    return t.client_side(model, value, "is a model not served by Parrot")


Handler = Callable[[Tracer, Any, Any], Any]
_HANDLERS: dict[type, Handler] = {
    RunnableSequence: _sequence,
    RunnableParallel: _parallel,
    RunnablePassthrough: _passthrough,
    RunnableAssign: _assign,
    RunnablePick: _pick,
    RunnableEachBase: _each,
    RunnableLambda: _lambda,
    RunnableBinding: _binding,
    BasePromptTemplate: _prompt,
    ParrotLLM: _model,
    ChatParrot: _model,
    StrOutputParser: _str_parser,
    BaseOutputParser: _parser,
    BaseLanguageModel: _foreign_model,
}


def handler_for(runnable: Runnable) -> Handler | None:
    """The handler of the first class along ``runnable``'s MRO that has one (None: run it client-side)."""
    return next((_HANDLERS[c] for c in type(runnable).__mro__ if c in _HANDLERS), None)


def children(runnable: Runnable) -> list[Runnable]:
    """The runnables a compiled runnable contains (for static checks and finding the chain's models)."""
    if isinstance(runnable, RunnableSequence):
        return list(runnable.steps)
    if isinstance(runnable, RunnableParallel):
        return list(runnable.steps__.values())
    if isinstance(runnable, RunnableAssign):
        return [runnable.mapper]
    if isinstance(runnable, (RunnableBinding, RunnableEachBase)):
        return [runnable.bound]
    return []


def walk(runnable: Runnable) -> Iterator[Runnable]:
    yield runnable
    for child in children(runnable):
        yield from walk(child)


def unsupported(runnable: Runnable) -> list[str]:
    """Names of the runnables in a chain that would run client-side, output parsers aside (strict compilation
    refuses them)."""
    out = []
    for r in walk(runnable):
        handler = handler_for(r)
        client = (handler in (None, _foreign_model)
                  or (handler is _lambda and not isinstance(r.func, operator.itemgetter))
                  or (handler is _passthrough and (r.func is not None or r.afunc is not None))
                  or (handler is _binding and r.kwargs and not isinstance(r.bound, (ParrotLLM, ChatParrot))))
        if client:
            out.append(f"{r.get_name()} ({type(r).__name__})")
    return out
