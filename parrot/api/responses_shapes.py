"""OpenAI Responses API shapes around :mod:`parrot.manager.responses_store` (text in, text out).

In: a ``ResponsesRequest`` becomes a :class:`ResponseSpec` (input items checked here: message items with string
content or ``input_text`` / ``output_text`` parts, joined with newlines; ``text.format`` json_object / json_schema
becomes the output's constraint; anything else -- tools, images, files, reasoning, background -- is a 400 naming
the field). Out: the finished turn becomes a ``response`` object with
one assistant ``message`` output item; a stream is the official event sequence, each event with ``type`` and
``sequence_number``::

    response.created, response.in_progress, response.output_item.added, response.content_part.added,
    response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done, response.completed (response.incomplete at max_output_tokens)

A failure after the stream started ends it with ``response.failed`` (its ``error`` names the typed error).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from parrot.api.openai_shapes import format_constraint
from parrot.api.schemas import ResponsesRequest
from parrot.common.constraints import Constraint, ConstraintKind
from parrot.common.errors import BadSamplingParams, InvalidRequestError, ParrotError
from parrot.common.sampling import FinishReason
from parrot.manager.completion_types import ChoiceDelta
from parrot.manager.responses_store import Message, ResponsePlan, ResponseResult, ResponseSpec

_ROLES = ("user", "assistant", "system", "developer")
_ITEM_KEYS = {"type", "role", "content", "id", "status"}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}


# ---- request -> spec ------------------------------------------------------------------------------------------
def response_spec(req: ResponsesRequest) -> ResponseSpec:
    _reject_unsupported(req)
    sampling = {"temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p, "constraint": text_constraint(req.text)}
    return ResponseSpec(req.model, input_messages(req.input), instructions=req.instructions,
                        previous_response_id=req.previous_response_id, max_output_tokens=req.max_output_tokens,
                        sampling=sampling, store=req.store, metadata=dict(req.metadata or {}))


def input_messages(value: str | list[dict[str, Any]]) -> list[Message]:
    """``input`` as chat messages: a string is one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise InvalidRequestError("input must not be empty", param="input")
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind != "message":
            raise InvalidRequestError(f"{where}: items of type {kind!r} are not supported (text messages only)",
                                      param=f"{where}.type")
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


def _no_unknown(obj: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise InvalidRequestError(f"{where}: unknown field {unknown[0]!r}", param=f"{where}.{unknown[0]}")


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
        "tools": bool(req.tools),
        "tool_choice": req.tool_choice not in (None, "auto", "none"),
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
            raise InvalidRequestError(f"'{name}' is not supported by this server (text in, text out)", param=name)


# ---- results -> bodies and events -----------------------------------------------------------------------------
def response_body(plan: ResponsePlan, result: ResponseResult | None = None, *, status: str | None = None,
                  error: ParrotError | None = None) -> dict:
    """The ``response`` object: finished (``result``) or, while streaming, ``status`` without output."""
    spec = plan.spec
    body: dict[str, Any] = {
        "id": plan.id, "object": "response", "created_at": plan.created_at, "status": status,
        "background": False, "error": None, "incomplete_details": None, "instructions": spec.instructions,
        "max_output_tokens": spec.max_output_tokens, "max_tool_calls": None, "model": spec.model, "output": [],
        "parallel_tool_calls": True, "previous_response_id": spec.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": spec.store,
        "temperature": spec.sampling.get("temperature"), "text": text_body(spec.sampling.get("constraint")),
        "tool_choice": "auto", "tools": [], "top_p": spec.sampling.get("top_p"), "truncation": "disabled",
        "usage": None, "user": None, "metadata": dict(spec.metadata),
    }
    if error is not None:
        body["error"] = {"code": error.code, "message": error.message}
    if result is not None:
        body["status"] = _status(result)
        if body["status"] == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["output"] = [_message_item(plan, result.text, _status(result))]
        u = result.usage
        body["usage"] = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                         "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": u.prompt_tokens + u.completion_tokens}
    return body


def deleted_body(response_id: str) -> dict:
    return {"id": response_id, "object": "response", "deleted": True}


async def response_events(plan: ResponsePlan,
                          events: AsyncIterator[ChoiceDelta | ResponseResult]) -> AsyncIterator[dict]:
    """The Responses event stream of ``events``; closing it closes ``events`` (freeing the engine contexts)."""
    seq = itertools.count()
    where = {"item_id": plan.message_id, "output_index": 0, "content_index": 0}

    def event(kind: str, **fields: Any) -> dict:
        return {"type": kind, "sequence_number": next(seq), **fields}

    yield event("response.created", response=response_body(plan, status="in_progress"))
    yield event("response.in_progress", response=response_body(plan, status="in_progress"))
    yield event("response.output_item.added", output_index=0, item=_message_item(plan, None, "in_progress"))
    yield event("response.content_part.added", **where, part=_text_part(""))
    result: ResponseResult | None = None
    async with aclosing(events):
        try:
            async for e in events:
                if isinstance(e, ResponseResult):
                    result = e
                elif e.text:
                    yield event("response.output_text.delta", **where, delta=e.text, logprobs=[])
        except ParrotError as err:
            yield event("response.failed", response=response_body(plan, status="failed", error=err))
            return
    assert result is not None  # the service ends every stream with its result
    status = _status(result)
    yield event("response.output_text.done", **where, text=result.text, logprobs=[])
    yield event("response.content_part.done", **where, part=_text_part(result.text))
    yield event("response.output_item.done", output_index=0, item=_message_item(plan, result.text, status))
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
