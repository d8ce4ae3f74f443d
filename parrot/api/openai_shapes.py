"""OpenAI request and response shapes around :mod:`parrot.manager.completions`.

In: a validated ``CompletionRequest`` / ``ChatCompletionRequest`` becomes the service's plain
:class:`CompletionSpec` / :class:`ChatSpec` (features this server does not support are a 400 here, naming the
field; OpenAI's defaults and vLLM's extras map onto the one :class:`SamplingParams` field set). Out: the
service's typed results become OpenAI bodies and stream chunks (``text_completion`` or ``chat.completion``).

Structured output: ``response_format`` (json_object / json_schema), vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` and ``structured_outputs``, and a forced tool call (``tool_choice`` named
or ``"required"``) each become the one :class:`Constraint` of the request's sampling (two at once: 400 naming
them; one that does not compile: 400 naming its field). Tools (:mod:`parrot.manager.tool_calls`): each chat
choice's text is read as tool calls (``message.tool_calls``, finish reason ``tool_calls``); streamed, a forced
call's arguments stream as ``delta.tool_calls`` fragments, other calls come whole when the choice ends.

Request fields (docs/api.md, "Request fields"): sampling fields become :class:`SamplingParams` fields here; the
rest of the policy (request options, recorded and refused fields, prompt logprobs' shape) is
:mod:`parrot.api.request_fields`.

Logprobs, per choice (docs/api.md): completions use the legacy shape ``{tokens, token_logprobs, top_logprobs,
text_offset}`` (``top_logprobs[i]`` = the k most likely tokens plus the chosen one, ``{token: logprob}``; an echoed
prompt's first token has ``null`` for both; ``text_offset[i]`` = the summed lengths of the tokens before it, as
vLLM counts); chat uses ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

from parrot.api.request_fields import prompt_logprobs_body, request_options, template_kwargs, token_text
from parrot.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    _SamplingRequest,
)
from parrot.common.constraints import Constraint
from parrot.common.errors import BadSamplingParams, InvalidRequestError
from parrot.common.sampling import MAX_LOGPROBS, FinishReason, TokenLogprob
from parrot.manager.completion_types import (
    ChatSpec,
    ChoiceDelta,
    ChoiceResult,
    ChoiceSpec,
    CompletionPlan,
    CompletionResult,
    CompletionSpec,
    Position,
    UnscoredToken,
    Usage,
)
from parrot.manager.tool_calls import (
    AutoCallStream,
    ToolCall,
    ToolChoice,
    ToolOutput,
    ToolPlan,
    new_call_id,
    plan_tools,
)

# ---- requests -> specs ------------------------------------------------------------------------------------------
def completion_spec(req: CompletionRequest) -> CompletionSpec:
    _reject_unsupported(req, {"suffix": req.suffix is not None,
                              "best_of": req.best_of is not None and req.best_of != req.n})
    # one text, one list of token ids, or a list of either
    prompts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else list(req.prompt)
    return CompletionSpec(req.model, prompts, _choices(req, req.max_tokens, req.logprobs, constraint(req)),
                          echo=req.echo, options=request_options(req))


def chat_spec(req: ChatCompletionRequest) -> ChatSpec:
    _reject_unsupported(req, {})
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                                  param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    tools = plan_tools([t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None, choice,
                       req.parallel_tool_calls)
    forced: dict[str, Builder] = {}
    if tools is not None and tools.choice in (ToolChoice.NAMED, ToolChoice.REQUIRED):
        forced["tool_choice"] = tools.constraint
    return ChatSpec(req.model, message_dicts(req.messages),
                    _choices(req, asked, logprobs, constraint(req, forced)), tools=tools,
                    options=request_options(req), template_kwargs=template_kwargs(req),
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message)


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the plain dicts templates expect; a list of text parts is joined with newlines; a call's
    arguments become a dict when they are JSON (HF templates expect one; OpenAI sends text)."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# ---- structured output --------------------------------------------------------------------------------------------
Builder = Callable[[], Constraint]


def constraint(req: _SamplingRequest, more: dict[str, Builder] | None = None) -> Constraint | None:
    """The request's one constraint (``more``: others by field, e.g. a forced tool call); several → 400 naming
    them, one that does not compile → 400 naming its field (``param``)."""
    asked: dict[str, Builder] = {}
    rf = req.response_format
    if rf is not None and rf.type != "text":
        asked["response_format"] = lambda: format_constraint(rf.type, rf.json_schema and rf.json_schema.schema_,
                                                             "response_format.json_schema.schema")
    vllm: dict[str, Any] = {"guided_json": (req.guided_json, Constraint.json_schema),
                            "guided_regex": (req.guided_regex, Constraint.regex),
                            "guided_choice": (req.guided_choice, Constraint.choice),
                            "guided_grammar": (req.guided_grammar, Constraint.grammar)}
    so = req.structured_outputs
    if so is not None:
        vllm.update({"structured_outputs.json": (so.json_, Constraint.json_schema),
                     "structured_outputs.regex": (so.regex, Constraint.regex),
                     "structured_outputs.choice": (so.choice, Constraint.choice),
                     "structured_outputs.grammar": (so.grammar, Constraint.grammar),
                     "structured_outputs.json_object": (so.json_object or None, lambda _: Constraint.json_object())})
    for name, (value, build) in vllm.items():
        if value is not None:
            asked[name] = lambda value=value, build=build: build(value)
    asked.update(more or {})
    if len(asked) > 1:
        names = sorted(asked)
        raise InvalidRequestError(f"at most one constraint per request; got {', '.join(names)}", param=names[0])
    for name, build in asked.items():
        try:
            return build()
        except BadSamplingParams as e:
            raise BadSamplingParams(f"{name}: {e.message}", param=e.param if e.param != "constraint" else name) \
                from None
    return None


def format_constraint(kind: str, schema: dict[str, Any] | None, schema_param: str) -> Constraint | None:
    """OpenAI's output formats: ``text`` (none), ``json_object``, ``json_schema`` (``schema`` required)."""
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        if schema is None:
            raise BadSamplingParams("a json_schema format needs its schema", param=schema_param)
        return Constraint.json_schema(schema)
    return None


def _reject_unsupported(req: _SamplingRequest, flags: dict[str, bool]) -> None:
    for name, used in flags.items():
        if used:
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)


def _choices(req: _SamplingRequest, max_tokens: int | None, logprobs: int | None = None,
             constraint: Constraint | None = None) -> ChoiceSpec:
    """OpenAI defaults (temperature and top_p 1) and vLLM conventions (top_k -1 disables) in our terms."""
    sampling = {
        "min_tokens": req.min_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None or req.top_k == -1 else req.top_k,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "presence_penalty": req.presence_penalty or 0.0, "frequency_penalty": req.frequency_penalty or 0.0,
        "stop": (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        "stop_token_ids": tuple(req.stop_token_ids or ()), "ignore_eos": req.ignore_eos, "seed": req.seed,
        "include_stop_str_in_output": req.include_stop_str_in_output, "logprobs": logprobs,
        "constraint": constraint, "logit_bias": dict(req.logit_bias or {}),
        "min_p": 0.0 if req.min_p is None else req.min_p, "skip_special_tokens": req.skip_special_tokens,
    }
    return ChoiceSpec(n=req.n, max_tokens=max_tokens, sampling=sampling, bad_words=tuple(req.bad_words or ()))


def include_usage(req: _SamplingRequest) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


# ---- results -> bodies and chunks -------------------------------------------------------------------------------
def completion_body(plan: CompletionPlan, result: CompletionResult) -> dict:
    """The whole answer. With ``prompt_logprobs`` (vLLM's shape): chat has them at the top, completions on each
    choice (its prompt's)."""
    choices = [_choice(plan, index, res) for index, res in enumerate(result.choices)]
    body = {"id": plan.id, "object": "chat.completion" if plan.chat else "text_completion",
            "created": plan.created, "model": plan.model, "choices": choices, "usage": usage_body(result.usage)}
    if result.prompt_logprobs is not None:
        per_prompt = [prompt_logprobs_body(plan, positions) for positions in result.prompt_logprobs]
        if plan.chat:
            body["prompt_logprobs"] = per_prompt[0]
        else:
            for index, choice in enumerate(choices):
                choice["prompt_logprobs"] = per_prompt[index // plan.n]
    return body


async def stream_chunks(plan: CompletionPlan, events: AsyncIterator[ChoiceDelta | Usage], *,
                        with_usage: bool) -> AsyncIterator[dict]:
    """The OpenAI stream of ``events`` (without the final ``[DONE]``, which the SSE response adds). Closing
    this iterator closes ``events`` (which frees the request's engine contexts)."""
    offsets = [0] * plan.num_choices  # completions: text_offset of each choice's next token
    tools = plan.tools if plan.tools is not None and plan.tools.choice is not ToolChoice.NONE else None
    calls = [_ToolDeltas(tools) for _ in range(plan.num_choices)] if tools is not None else []
    # vLLM's continuous_usage_stats (only with include_usage): every chunk carries the usage so far
    so_far: Usage | None = Usage(plan.prompt_tokens, 0) if with_usage and plan.options.continuous_usage_stats \
        else None
    async with aclosing(events):
        if plan.chat:  # every chat choice opens with its role
            for index in range(plan.num_choices):
                yield _chunk(plan, index, {"role": "assistant", "content": ""}, None, None, with_usage, so_far)
        async for event in events:
            if isinstance(event, ChoiceDelta):
                if so_far is not None:
                    so_far = Usage(plan.prompt_tokens, event.completion_tokens)
                reason = event.finish_reason.value if event.finish_reason is not None else None
                logprobs = None
                if plan.logprobs is not None:
                    logprobs, offsets[event.index] = _logprobs(plan, event.logprobs, offsets[event.index])
                delta = _delta(plan, event.text)
                if calls:
                    delta, reason = calls[event.index].push(event.text, event.finish_reason)
                    if not delta and reason is None and not (logprobs and logprobs["content"]):
                        continue
                yield _chunk(plan, event.index, delta, reason, logprobs, with_usage, so_far)
            elif with_usage:
                yield {"id": plan.id, "object": _chunk_object(plan), "created": plan.created, "model": plan.model,
                       "choices": [], "usage": usage_body(event)}


def usage_body(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _choice(plan: CompletionPlan, index: int, res: ChoiceResult) -> dict:
    logprobs = _logprobs(plan, res.logprobs, 0)[0] if res.logprobs is not None else None
    if plan.chat:
        out = plan.tools.parse(res.text) if plan.tools is not None else ToolOutput(res.text)
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if out.calls:
            message["tool_calls"] = [_call_body(i, c) for i, c in enumerate(out.calls)]
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": _reason(res.finish_reason, bool(out.calls))}
    return {"index": index, "text": res.text, "logprobs": logprobs, "finish_reason": res.finish_reason.value}


# ---- tool calls ---------------------------------------------------------------------------------------------------
def _reason(reason: FinishReason, called: bool) -> str:
    """``tool_calls`` when a choice ended by itself with calls; ``length`` (cut calls) stays."""
    return "tool_calls" if called and reason is FinishReason.STOP else reason.value


def _call_body(index: int, call: ToolCall, *, streamed: bool = False) -> dict:
    body = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": index, **body} if streamed else body


class _ToolDeltas:
    """One streamed chat choice of a request with tools: engine text in, OpenAI ``delta`` out. A forced call
    (NAMED) streams its arguments as they come; ``"required"`` sends its calls when the choice ends; ``"auto"``
    sends content until a ``<tool_call>`` begins and the calls when the choice ends."""

    def __init__(self, tools: ToolPlan) -> None:
        self.tools = tools
        self.auto = AutoCallStream(tools) if tools.choice is ToolChoice.AUTO else None
        self.text = ""  # REQUIRED: the whole output so far
        self.opened = False  # NAMED: the call's first delta (id, type, name) was sent

    def push(self, text: str, finish: FinishReason | None) -> tuple[dict, str | None]:
        """The delta for ``text`` (``{}``: nothing to send yet) and the choice's finish reason, if it ended."""
        if self.tools.choice is ToolChoice.NAMED:
            return self._named(text, finish)
        if self.auto is None:  # REQUIRED
            self.text += text
            if finish is None:
                return {}, None
            out = self.tools.parse(self.text)
        else:
            content = self.auto.push(text)
            if finish is None:
                return ({"content": content} if content else {}), None
            out = self.auto.finish()
            out = ToolOutput(content + (out.content or "") or None, out.calls)
        delta: dict[str, Any] = {"content": out.content} if out.content else {}
        if out.calls:
            delta["tool_calls"] = [_call_body(i, c, streamed=True) for i, c in enumerate(out.calls)]
        return delta, _reason(finish, bool(out.calls))

    def _named(self, text: str, finish: FinishReason | None) -> tuple[dict, str | None]:
        reason = _reason(finish, True) if finish is not None else None
        if not self.opened and (text or finish is not None):
            assert self.tools.name is not None
            self.opened = True
            call = ToolCall(new_call_id(), self.tools.name, text)
            return {"tool_calls": [_call_body(0, call, streamed=True)]}, reason
        return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), reason


# ---- logprobs ---------------------------------------------------------------------------------------------------
def _logprobs(plan: CompletionPlan, positions: Sequence[Position], offset: int) -> tuple[dict, int]:
    """The choice's ``logprobs`` object for ``positions`` (chat, or completions starting at ``offset``), and
    the offset after them."""
    if plan.chat:
        return {"content": [_chat_position(plan, p) for p in positions if not isinstance(p, UnscoredToken)]}, offset
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for p in positions:
        text_offset.append(offset)
        if isinstance(p, UnscoredToken):
            tokens.append(token_text(plan, p))
            token_logprobs.append(None)
            top_logprobs.append(None)
            offset += len(p.token)
            continue
        tokens.append(token_text(plan, p.chosen))
        token_logprobs.append(p.chosen.logprob)
        top: dict[str, float] = {}
        for t in (*p.top, p.chosen):  # the k most likely, then the chosen one; the likelier wins a repeated text
            top.setdefault(token_text(plan, t), t.logprob)
        top_logprobs.append(top)
        offset += len(p.chosen.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}, offset


def token_logprob_body(t: TokenLogprob, token: str | None = None) -> dict:
    """Chat's record of one token (``token``: its text as shown, when not its own; ``bytes`` stay its bytes)."""
    return {"token": t.token if token is None else token, "logprob": t.logprob, "bytes": list(t.token_bytes)}


def _chat_position(plan: CompletionPlan, p: Position) -> dict:
    assert not isinstance(p, UnscoredToken)  # chat never echoes
    return {**token_logprob_body(p.chosen, token_text(plan, p.chosen)),
            "top_logprobs": [token_logprob_body(t, token_text(plan, t)) for t in p.top]}


def _chunk_object(plan: CompletionPlan) -> str:
    return "chat.completion.chunk" if plan.chat else "text_completion"


def _delta(plan: CompletionPlan, text: str) -> dict | str:
    return {"content": text} if plan.chat else text


def _chunk(plan: CompletionPlan, index: int, delta: dict | str, finish_reason: str | None, logprobs: dict | None,
           with_usage: bool, usage: Usage | None = None) -> dict:
    """One choice's chunk; with ``include_usage`` it has ``usage``: null, or the usage so far (``usage``: vLLM's
    continuous_usage_stats)."""
    choice: dict[str, Any] = {"index": index}
    if plan.chat:  # the last chunk of a choice carries no empty content
        choice["delta"] = delta if finish_reason is None or delta != {"content": ""} else {}
    else:
        choice["text"] = delta
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    chunk = {"id": plan.id, "object": _chunk_object(plan), "created": plan.created, "model": plan.model,
             "choices": [choice]}
    if with_usage:
        chunk["usage"] = None if usage is None else {  # cached tokens are known at the end (the last chunk)
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
    return chunk
