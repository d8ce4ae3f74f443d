"""OpenAI Responses API shapes around :mod:`parrot.manager.responses_store` (text and function tools).

In: a ``ResponsesRequest`` becomes a :class:`ResponseSpec` (input items checked here: message items with string
content or ``input_text`` / ``output_text`` parts, joined with newlines; ``function_call`` /
``function_call_output`` items and function ``tools`` / ``tool_choice`` via :mod:`parrot.api.responses_tools`;
``text.format`` json_object / json_schema or a forced call becomes the output's one constraint; anything else --
other tools, images, files, reasoning, background -- is a 400 naming the field). Out: the finished turn becomes a
``response`` whose ``output`` is an assistant ``message`` (when it wrote text, or made no call) then one
``function_call`` item per call; a stream is the official event sequence, each event with ``type`` and
``sequence_number``, each item's events with its ``output_index``::

    response.created, response.in_progress,
    message:  response.output_item.added, response.content_part.added, response.output_text.delta ...,
              response.output_text.done, response.content_part.done, response.output_item.done
    call:     response.output_item.added, response.function_call_arguments.delta ...,
              response.function_call_arguments.done, response.output_item.done
    response.completed (response.incomplete at max_output_tokens)

A forced call's arguments stream as the engine writes them; other calls come whole when the turn ends. A failure
after the stream started ends it with ``response.failed`` (its ``error`` names the typed error).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from parrot.api import responses_tools
from parrot.api.openai_shapes import format_constraint
from parrot.api.responses_tools import no_unknown as _no_unknown
from parrot.api.schemas import ResponsesRequest
from parrot.common.constraints import Constraint, ConstraintKind
from parrot.common.errors import BadSamplingParams, InvalidRequestError, ParrotError
from parrot.common.sampling import FinishReason
from parrot.manager.responses_output import CallDelta, TextDelta, call_item_id
from parrot.manager.responses_store import Message, ResponsePlan, ResponseResult, ResponseSpec
from parrot.manager.tool_calls import ToolCall, ToolChoice

_ROLES = ("user", "assistant", "system", "developer")
_ITEM_KEYS = {"type", "role", "content", "id", "status"}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}


# ---- request -> spec ------------------------------------------------------------------------------------------
def response_spec(req: ResponsesRequest) -> ResponseSpec:
    _reject_unsupported(req)
    tools = responses_tools.response_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    constraint = text_constraint(req.text)
    if tools is not None and tools.choice in (ToolChoice.NAMED, ToolChoice.REQUIRED):
        if constraint is not None:
            raise InvalidRequestError("at most one constraint per request: a forced tool call (tool_choice) and "
                                      "text.format json output exclude each other", param="tool_choice")
        constraint = tools.constraint()
    sampling = {"temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p, "constraint": constraint}
    return ResponseSpec(req.model, input_messages(req.input), instructions=req.instructions,
                        previous_response_id=req.previous_response_id, max_output_tokens=req.max_output_tokens,
                        sampling=sampling, store=req.store, metadata=dict(req.metadata or {}), tools=tools)


def input_messages(value: str | list[dict[str, Any]]) -> list[Message]:
    """``input`` as chat messages: a string is one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise InvalidRequestError("input must not be empty", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "function_call":
            responses_tools.add_function_call(out, item, where)
            continue
        if kind == "function_call_output":
            out.append(responses_tools.function_call_output(item, where))
            continue
        if kind != "message":
            raise InvalidRequestError(f"{where}: items of type {kind!r} are not supported (messages, function_call "
                                      "and function_call_output only)", param=f"{where}.type")
        _no_unknown(item, _ITEM_KEYS, where)
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {list(_ROLES)}, got {role!r}",
                                      param=f"{where}.role")
        out.append({"role": role, "content": _content_text(item.get("content"), f"{where}.content")})
    return out


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text"):
            raise InvalidRequestError(f"{at}: content of type {kind!r} is not supported (input_text / output_text "
                                      "only)", param=f"{at}.type")
        _no_unknown(part, _PART_KEYS, at)
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{at}.text must be a string", param=f"{at}.text")
        texts.append(part["text"])
    return "\n".join(texts)


_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"},
                "json_schema": {"type", "name", "schema", "strict", "description"}}


def text_constraint(text: dict[str, Any] | None) -> Constraint | None:
    """``text: {"format": {"type": "text" | "json_object" | "json_schema", ...}}`` as the output's constraint
    (400 naming ``text.format...`` when malformed or when the schema does not compile)."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in _FORMAT_KEYS:
        raise InvalidRequestError(f"text.format.type must be one of {sorted(_FORMAT_KEYS)}, got {kind!r}",
                                  param="text.format.type")
    _no_unknown(fmt, _FORMAT_KEYS[kind], "text.format")
    if kind == "json_schema" and not isinstance(fmt.get("name"), str):
        raise InvalidRequestError("text.format.name is required for json_schema", param="text.format.name")
    schema = fmt.get("schema")
    if kind == "json_schema" and not isinstance(schema, dict):
        raise InvalidRequestError("text.format.schema must be a JSON schema (an object)", param="text.format.schema")
    try:
        return format_constraint(kind, schema, "text.format.schema")
    except BadSamplingParams as e:
        raise BadSamplingParams(f"text.format: {e.message}", param="text.format.schema") from None


def text_body(constraint: Constraint | None) -> dict[str, Any]:
    """The response's ``text`` (its output format), from the constraint it ran under."""
    if constraint is None:
        return {"format": {"type": "text"}}
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        return {"format": {"type": "json_object"}}
    return {"format": {"type": "json_schema", "name": "response", "schema": constraint.schema, "strict": True}}


def _reject_unsupported(req: ResponsesRequest) -> None:
    unsupported = {
        "max_tool_calls": req.max_tool_calls is not None,
        "reasoning": bool(req.reasoning) and any(v is not None for v in req.reasoning.values()),
        "background": bool(req.background),
        "include": bool(req.include),
        "text": set(req.text or {}) - {"format"} != set(),
        "truncation": req.truncation not in (None, "disabled"),
        "top_logprobs": req.top_logprobs is not None,
        "conversation": req.conversation is not None,
        "prompt": req.prompt is not None,
        "service_tier": req.service_tier not in (None, "auto", "default"),
    }
    for name, used in unsupported.items():
        if used:
            raise InvalidRequestError(f"'{name}' is not supported by this server (text and function tools)",
                                      param=name)


# ---- results -> bodies and events -----------------------------------------------------------------------------
def response_body(plan: ResponsePlan, result: ResponseResult | None = None, *, status: str | None = None,
                  error: ParrotError | None = None) -> dict:
    """The ``response`` object: finished (``result``) or, while streaming, ``status`` without output."""
    spec = plan.spec
    body: dict[str, Any] = {
        "id": plan.id, "object": "response", "created_at": plan.created_at, "status": status,
        "background": False, "error": None, "incomplete_details": None, "instructions": spec.instructions,
        "max_output_tokens": spec.max_output_tokens, "max_tool_calls": None, "model": spec.model, "output": [],
        "parallel_tool_calls": spec.tools.parallel if spec.tools is not None else True,
        "previous_response_id": spec.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": spec.store,
        "temperature": spec.sampling.get("temperature"), "text": text_body(spec.sampling.get("constraint")),
        "tool_choice": responses_tools.tool_choice_body(spec.tools), "tools": responses_tools.tools_body(spec.tools),
        "top_p": spec.sampling.get("top_p"), "truncation": "disabled",
        "usage": None, "user": None, "metadata": dict(spec.metadata),
    }
    if error is not None:
        body["error"] = {"code": error.code, "message": error.message}
    if result is not None:
        body["status"] = _status(result)
        if body["status"] == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["output"] = output_items(plan, result)
        u = result.usage
        # cache_write_tokens: no prompt-cache writes are counted apart here (the openai types require the field)
        body["usage"] = {"input_tokens": u.prompt_tokens,
                         "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                         "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": u.prompt_tokens + u.completion_tokens}
    return body


def output_items(plan: ResponsePlan, result: ResponseResult) -> list[dict]:
    """The turn's message (when it wrote text, or made no call), then its function calls."""
    status, out = _status(result), result.output
    items = [_message_item(plan, out.content or "", status)] if out.content is not None or not out.calls else []
    return items + [responses_tools.call_item(c, status) for c in out.calls]


def deleted_body(response_id: str) -> dict:
    return {"id": response_id, "object": "response", "deleted": True}


async def response_events(plan: ResponsePlan,
                          events: AsyncIterator[TextDelta | CallDelta | ResponseResult]) -> AsyncIterator[dict]:
    """The Responses event stream of ``events``; closing it closes ``events`` (freeing the engine contexts).
    Items open as their first text or arguments come (the message before any call, as in ``output``)."""
    seq = itertools.count()
    message: int | None = None  # the message's output_index, once opened
    calls: dict[str, int] = {}  # call id -> its output_index, once opened

    def event(kind: str, **fields: Any) -> dict:
        return {"type": kind, "sequence_number": next(seq), **fields}

    def open_message() -> list[dict]:
        nonlocal message
        message = len(calls)  # the items opened before it
        return [event("response.output_item.added", output_index=message, item=_message_item(plan, None,
                                                                                             "in_progress")),
                event("response.content_part.added", item_id=plan.message_id, output_index=message, content_index=0,
                      part=_text_part(""))]

    def open_call(call: ToolCall) -> dict:
        calls[call.id] = (message is not None) + len(calls)
        return event("response.output_item.added", output_index=calls[call.id],
                     item=responses_tools.call_item(call, "in_progress", arguments=""))

    def arguments(call: ToolCall, delta: str) -> dict:
        return event("response.function_call_arguments.delta", item_id=call_item_id(call),
                     output_index=calls[call.id], delta=delta)

    yield event("response.created", response=response_body(plan, status="in_progress"))
    yield event("response.in_progress", response=response_body(plan, status="in_progress"))
    result: ResponseResult | None = None
    async with aclosing(events):
        try:
            async for e in events:
                if isinstance(e, ResponseResult):
                    result = e
                elif isinstance(e, TextDelta):
                    for opened in open_message() if message is None else ():
                        yield opened
                    yield event("response.output_text.delta", item_id=plan.message_id, output_index=message,
                                content_index=0, delta=e.text, logprobs=[])
                else:
                    call = ToolCall(e.call_id, e.name, "")
                    if call.id not in calls:
                        yield open_call(call)
                    yield arguments(call, e.arguments)
        except ParrotError as err:
            yield event("response.failed", response=response_body(plan, status="failed", error=err))
            return
    assert result is not None  # the service ends every stream with its result
    status, out = _status(result), result.output
    if message is None and (out.content is not None or not out.calls):
        for opened in open_message():
            yield opened
    if message is not None:
        where = {"item_id": plan.message_id, "output_index": message, "content_index": 0}
        text = out.content or ""
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part=_text_part(text))
        yield event("response.output_item.done", output_index=message, item=_message_item(plan, text, status))
    for call in out.calls:
        if call.id not in calls:  # not forced: the call comes whole
            yield open_call(call)
            yield arguments(call, call.arguments)
        yield event("response.function_call_arguments.done", item_id=call_item_id(call), output_index=calls[call.id],
                    name=call.name, arguments=call.arguments)
        yield event("response.output_item.done", output_index=calls[call.id],
                    item=responses_tools.call_item(call, status))
    yield event("response.completed" if status == "completed" else "response.incomplete",
                response=response_body(plan, result))


def _status(result: ResponseResult) -> str:
    return "incomplete" if result.finish_reason is FinishReason.LENGTH else "completed"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(plan: ResponsePlan, text: str | None, status: str) -> dict:
    """The assistant message output item; ``text`` None: just opened (no content part yet)."""
    return {"id": plan.message_id, "type": "message", "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}
