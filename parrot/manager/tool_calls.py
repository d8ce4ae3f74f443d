"""Tool (function) calling for chat: the tools a request offers, how a model whose chat template does not know
tools is told about them, the constraint a forced call puts on the output, and how an output becomes calls.

What the model writes, by ``tool_choice`` (the engine enforces the constrained ones)::

    {"function": {"name": f}}  f's arguments, one JSON object (constrained to f's ``parameters`` schema, with
                               ``additionalProperties: false`` unless the schema says otherwise)
    "required"                 [{"name": "f", "arguments": {...}}, ...]  (constrained: anyOf over the tools;
                               1..n items, exactly 1 when parallel_tool_calls is false)
    "auto"                     free text; Hermes / Qwen blocks  <tool_call>{"name": ..., "arguments": ...}</tool_call>
                               become calls, the text around them the content
    "none"                     free text; the tools are not shown to the model

A template that does not mention ``tools`` gets them as a system-prompt block asking for the ``<tool_call>``
format (as llama.cpp's generic format does); one that does not mention ``tool_calls`` sees earlier assistant
calls as ``<tool_call>`` blocks and tool results as a user turn of ``<tool_response>`` blocks
(:func:`polyfill_messages`). Plain data and text only: no HTTP shapes here.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from parrot.common.constraints import Constraint
from parrot.common.errors import BadSamplingParams, InvalidRequestError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolChoice(str, Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: Mapping[str, Any]  # a JSON schema of the arguments object

    def openai_dict(self) -> dict[str, Any]:
        """The OpenAI / HF-template shape ``{"type": "function", "function": {...}}``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object (as OpenAI sends it)


@dataclass(frozen=True)
class ToolOutput:
    """A choice's output read as tool calls: ``calls`` empty means a plain answer (``content`` the text)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[Tool, ...]
    choice: ToolChoice
    name: str | None = None  # the forced function (NAMED)
    parallel: bool = True  # REQUIRED: more than one call allowed

    @property
    def shown(self) -> list[dict[str, Any]]:
        """The tools as the prompt shows them (none for ``tool_choice: "none"``)."""
        return [] if self.choice is ToolChoice.NONE else [t.openai_dict() for t in self.tools]

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def constraint(self, param: str = "tool_choice") -> Constraint | None:
        """What the output must be (NAMED / REQUIRED), or None. A parameters schema that does not compile is a
        400 naming ``param``."""
        if self.choice is ToolChoice.NAMED:
            assert self.name is not None
            schema: dict[str, Any] = _closed(self.tool(self.name).parameters)
        elif self.choice is ToolChoice.REQUIRED:
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"const": t.name}, "arguments": _closed(t.parameters)},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]}}
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        try:
            return Constraint.json_schema(schema)
        except BadSamplingParams as e:
            raise BadSamplingParams(f"tool parameters: {e.message}", param=param) from None

    def parse(self, text: str) -> ToolOutput:
        """``text`` (a whole choice) as calls; text that is not in the expected format stays content."""
        if self.choice is ToolChoice.NAMED:
            assert self.name is not None
            return ToolOutput(None, (ToolCall(new_call_id(), self.name, text.strip()),))
        if self.choice is ToolChoice.REQUIRED:
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return ToolOutput(text)
            calls = _calls(items if isinstance(items, list) else [items], self.tools)
            return ToolOutput(None, calls) if calls else ToolOutput(text)
        if self.choice is ToolChoice.AUTO and CALL_OPEN in text:
            calls = _calls([_loads(m.group(1)) for m in _BLOCK.finditer(text)], self.tools)
            if calls:
                return ToolOutput(_BLOCK.sub("", text).strip() or None, calls)
        return ToolOutput(text)


def plan_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None,
               parallel_tool_calls: bool | None, *, name_param: str = "tools[{i}].function.name") -> ToolPlan | None:
    """The request's tools (OpenAI dicts ``{"type": "function", "function": {name, description, parameters}}``)
    and choice, checked: names unique and well formed, a named choice among them, a choice only with tools
    (400 naming the field otherwise; a bad name's field is ``name_param`` of the tool's index ``i``: the Responses
    API's tools are flat). None when the request has no tools."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    parsed: list[Tool] = []
    for i, t in enumerate(tools):
        f = t["function"]
        name = f["name"]
        if not _NAME.match(name):
            raise InvalidRequestError(f"tool name {name!r} must be 1..64 of a-z, A-Z, 0-9, '_', '-', '.'",
                                      param=name_param.format(i=i))
        if any(p.name == name for p in parsed):
            raise InvalidRequestError(f"two tools are named {name!r}", param=name_param.format(i=i))
        parameters = f.get("parameters")
        parsed.append(Tool(name, f.get("description"), dict(parameters) if parameters else dict(_EMPTY_PARAMETERS)))
    choice, name = ToolChoice.AUTO, None
    if isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
        if not any(t.name == name for t in parsed):
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools "
                                      f"{[t.name for t in parsed]}", param="tool_choice")
        choice = ToolChoice.NAMED
    elif tool_choice is not None:
        choice = ToolChoice(tool_choice)
    return ToolPlan(tuple(parsed), choice, name, parallel=parallel_tool_calls is not False)


def _closed(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments schema without arguments the function does not declare (``additionalProperties: false``
    unless the schema says otherwise): a forced call never invents parameters nobody reads."""
    schema = dict(parameters)
    if schema.get("type") == "object" and "properties" in schema:
        schema.setdefault("additionalProperties", False)
    return schema


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _calls(items: list[Any], tools: Sequence[Tool]) -> tuple[ToolCall, ...]:
    """Calls of ``items`` ({"name", "arguments" | "parameters"}); () if any item is not a call of a known tool."""
    names = {t.name for t in tools}
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return ()
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
            arguments = _loads(arguments)
        if not isinstance(arguments, dict):
            return ()
        calls.append(ToolCall(new_call_id(), item["name"], json.dumps(arguments, ensure_ascii=False)))
    return tuple(calls)


# ---- streaming ("auto") -----------------------------------------------------------------------------------------
class AutoCallStream:
    """Splits one streamed choice of a ``tool_choice: "auto"`` request: text before any ``<tool_call>`` goes out
    as content at once (minus a tail that may begin the tag); from the first tag on it is held, and
    :meth:`finish` reads it as calls or, failing that, gives it back as content."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""  # text not yet sent: a possible tag prefix, or everything from the first tag on
        self.in_call = False

    def push(self, text: str) -> str:
        """The content of ``text`` that may be sent now."""
        self.held += text
        if self.in_call:
            return ""
        at = self.held.find(CALL_OPEN)
        if at >= 0:
            self.in_call = True
            out, self.held = self.held[:at], self.held[at:]
            return out
        keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self.held)), 0, -1)
                     if CALL_OPEN.startswith(self.held[-k:])), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> ToolOutput:
        """The held text as calls (content: the text after them), or as content when it holds none."""
        held, self.held = self.held, ""
        out = self.plan.parse(held) if self.in_call else ToolOutput(held)
        return out if out.calls or out.content else ToolOutput(None)


# ---- rendering for templates that do not know tools ---------------------------------------------------------------
def tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call the following tools (functions), described in JSON:\n" + listing + "\n\n"
            "To call a tool, answer with one block per call and nothing else:\n"
            f'{CALL_OPEN}\n{{"name": "<tool name>", "arguments": {{<the arguments, a JSON object>}}}}\n{CALL_CLOSE}\n'
            "Results come back as " + RESPONSE_OPEN + " blocks. If no tool fits, answer directly.")


def call_text(name: str, arguments: Any) -> str:
    """One call as a ``<tool_call>`` block (``arguments`` a dict or its JSON text)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def with_tools_prompt(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tools block at the end of the system message (one is put first if none)."""
    block = tools_system_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{block}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def polyfill_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` as ``<tool_call>`` blocks after the content, and each run of ``tool`` messages as
    one user message of ``<tool_response>`` blocks (for templates without tool support)."""
    out: list[dict[str, Any]] = []
    last_was_tool = False
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if m.get("role") == "tool":
            response = f"{RESPONSE_OPEN}\n{m.get('content') or ''}\n{RESPONSE_CLOSE}"
            if last_was_tool:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            last_was_tool = True
            continue
        if m.get("role") == "assistant" and calls:
            blocks = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            m["content"] = "\n".join([*([m["content"]] if m.get("content") else []), *blocks])
        out.append(m)
        last_was_tool = False
    return out
