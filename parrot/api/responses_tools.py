"""Function tools of the OpenAI Responses API, in its flat shapes, over the chat path's tool machinery
(:mod:`parrot.manager.tool_calls`): one :class:`ToolPlan` per request, as chat completions build it.

In::

    tools        [{"type": "function", "name", "description"?, "parameters"?, "strict"?}]
    tool_choice  "none" | "auto" | "required" | {"type": "function", "name"}
    input items  {"type": "function_call", "call_id", "name", "arguments", "id"?, "status"?}
                     -> the preceding assistant message's ``tool_calls`` (a new assistant message if none)
                 {"type": "function_call_output", "call_id", "output", "id"?, "status"?}
                     -> {"role": "tool", "tool_call_id", "content"}

Out: a call is a ``function_call`` output item ``{id: "fc_...", type, status, arguments, call_id, name}``. Any
other tool type, an unknown key or a value of the wrong type is a 400 naming its field.
"""

from __future__ import annotations

from typing import Any

from parrot.common.errors import InvalidRequestError
from parrot.manager.responses_output import call_item_id, tool_call_dict
from parrot.manager.tool_calls import ToolCall, ToolChoice, ToolPlan, plan_tools

_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_CALL_KEYS = {"type", "id", "call_id", "name", "arguments", "status"}
_OUTPUT_KEYS = {"type", "id", "call_id", "output", "status"}
_CHOICES = ("none", "auto", "required")


def no_unknown(obj: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise InvalidRequestError(f"{where}: unknown field {unknown[0]!r}", param=f"{where}.{unknown[0]}")


def _typed(obj: dict, key: str, kind: type | tuple[type, ...], where: str, *, required: bool = False) -> Any:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, kind):
        what = "a JSON schema (an object)" if kind is dict else "a string" if kind is str else "a boolean"
        raise InvalidRequestError(f"{where}.{key} must be {what}, got {value!r}", param=f"{where}.{key}")
    return value


# ---- request -> ToolPlan ----------------------------------------------------------------------------------------
def response_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The request's function tools and choice as the chat path's plan (None without tools); 400 naming the
    field for another tool type, a malformed tool or choice, a choice naming no tool."""
    nested = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        if tool.get("type") != "function":
            raise InvalidRequestError(f"{where}.type: tools of type {tool.get('type')!r} are not supported "
                                      "(function tools only)", param=f"{where}.type")
        no_unknown(tool, _TOOL_KEYS, where)
        function = {"name": _typed(tool, "name", str, where, required=True)}
        description = _typed(tool, "description", str, where)
        if description is not None:
            function["description"] = description
        parameters = _typed(tool, "parameters", dict, where)
        if parameters is not None:
            function["parameters"] = parameters
        _typed(tool, "strict", bool, where)  # accepted: a forced call is always held to its schema
        nested.append({"type": "function", "function": function})
    if not nested and tool_choice in (None, "auto", "none"):
        return None  # nothing to choose from: as OpenAI does, not an error
    return plan_tools(nested, _choice(tool_choice), parallel_tool_calls, name_param="tools[{i}].name")


def _choice(tool_choice: Any) -> str | dict[str, Any] | None:
    """``tool_choice`` in the chat shape."""
    if tool_choice is None or tool_choice in _CHOICES:
        return tool_choice
    if not isinstance(tool_choice, dict):
        raise InvalidRequestError(f"tool_choice must be one of {list(_CHOICES)} or {{'type': 'function', 'name': "
                                  f"...}}, got {tool_choice!r}", param="tool_choice")
    if tool_choice.get("type") != "function":
        raise InvalidRequestError(f"tool_choice.type must be 'function', got {tool_choice.get('type')!r}",
                                  param="tool_choice.type")
    no_unknown(tool_choice, {"type", "name"}, "tool_choice")
    return {"type": "function", "function": {"name": _typed(tool_choice, "name", str, "tool_choice", required=True)}}


# ---- input items -> chat messages ---------------------------------------------------------------------------------
def add_function_call(messages: list[dict[str, Any]], item: dict, where: str) -> None:
    """Append the ``function_call`` input ``item`` to ``messages``: to the assistant message it follows (one
    turn's text and calls are one chat message), else as an assistant message of its own."""
    no_unknown(item, _CALL_KEYS, where)
    call = tool_call_dict(_typed(item, "call_id", str, where, required=True),
                          _typed(item, "name", str, where, required=True),
                          _typed(item, "arguments", str, where, required=True))
    if messages and messages[-1]["role"] == "assistant":
        last = messages[-1]
        messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", ()), call]}
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def function_call_output(item: dict, where: str) -> dict[str, Any]:
    """The ``function_call_output`` input ``item`` as a ``tool`` message (its output: text, or text parts)."""
    no_unknown(item, _OUTPUT_KEYS, where)
    call_id = _typed(item, "call_id", str, where, required=True)
    output = item.get("output")
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            at = f"{where}.output[{j}]"
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise InvalidRequestError(f"{at}: only text parts (input_text) are supported", param=f"{at}.type")
            texts.append(_typed(part, "text", str, at, required=True))
        output = "\n".join(texts)
    elif not isinstance(output, str):
        raise InvalidRequestError(f"{where}.output must be a string or a list of text parts", param=f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


# ---- plan and calls -> response fields ----------------------------------------------------------------------------
def tools_body(tools: ToolPlan | None) -> list[dict[str, Any]]:
    """The response's ``tools`` (``strict``: the arguments are held to the schema, as a forced call's are)."""
    if tools is None:
        return []
    forced = tools.choice in (ToolChoice.NAMED, ToolChoice.REQUIRED)
    return [{"type": "function", "name": t.name, "description": t.description, "parameters": dict(t.parameters),
             "strict": forced} for t in tools.tools]


def tool_choice_body(tools: ToolPlan | None) -> str | dict[str, str]:
    if tools is None:
        return "auto"
    if tools.choice is ToolChoice.NAMED:
        assert tools.name is not None
        return {"type": "function", "name": tools.name}
    return tools.choice.value


def call_item(call: ToolCall, status: str, *, arguments: str | None = None) -> dict[str, Any]:
    """The ``function_call`` output item of ``call`` (``arguments``: as sent so far, while streaming)."""
    return {"id": call_item_id(call), "type": "function_call", "status": status,
            "arguments": call.arguments if arguments is None else arguments, "call_id": call.id, "name": call.name}
