"""OpenAI request and response shapes around :mod:`parrot.manager.completions`.

In: a validated ``CompletionRequest`` / ``ChatCompletionRequest`` becomes the service's plain
:class:`CompletionSpec` / :class:`ChatSpec` (features this server does not support are a 400 here, naming the
field; OpenAI's defaults and vLLM's extras map onto the one :class:`SamplingParams` field set). Out: the
service's typed results become OpenAI bodies and stream chunks (``text_completion`` or ``chat.completion``).

Logprobs, per choice (docs/api.md): completions use the legacy shape ``{tokens, token_logprobs, top_logprobs,
text_offset}`` (``top_logprobs[i]`` = the k most likely tokens plus the chosen one, ``{token: logprob}``; an echoed
prompt's first token has ``null`` for both; ``text_offset[i]`` = the summed lengths of the tokens before it, as
vLLM counts); chat uses ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from parrot.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingRequest
from parrot.common.errors import InvalidRequestError
from parrot.common.sampling import MAX_LOGPROBS, TokenLogprob
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


# ---- requests -> specs ------------------------------------------------------------------------------------------
def completion_spec(req: CompletionRequest) -> CompletionSpec:
    _reject_unsupported(req, {"suffix": req.suffix is not None,
                              "best_of": req.best_of is not None and req.best_of != req.n})
    # one text, one list of token ids, or a list of either
    prompts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else list(req.prompt)
    return CompletionSpec(req.model, prompts, _choices(req, req.max_tokens, req.logprobs), echo=req.echo)


def chat_spec(req: ChatCompletionRequest) -> ChatSpec:
    _reject_unsupported(req, {})
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                                  param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return ChatSpec(req.model, message_dicts(req.messages), _choices(req, asked, logprobs))


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the plain dicts templates expect; a list of text parts is joined with newlines."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        d = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _reject_unsupported(req: _SamplingRequest, flags: dict[str, bool]) -> None:
    flags = {**flags, "logit_bias": bool(req.logit_bias)}
    for name, used in flags.items():
        if used:
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)


def _choices(req: _SamplingRequest, max_tokens: int | None, logprobs: int | None = None) -> ChoiceSpec:
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
    }
    return ChoiceSpec(n=req.n, max_tokens=max_tokens, sampling=sampling)


def include_usage(req: _SamplingRequest) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


# ---- results -> bodies and chunks -------------------------------------------------------------------------------
def completion_body(plan: CompletionPlan, result: CompletionResult) -> dict:
    return {"id": plan.id, "object": "chat.completion" if plan.chat else "text_completion",
            "created": plan.created, "model": plan.model,
            "choices": [_choice(plan, index, res) for index, res in enumerate(result.choices)],
            "usage": usage_body(result.usage)}


async def stream_chunks(plan: CompletionPlan, events: AsyncIterator[ChoiceDelta | Usage], *,
                        with_usage: bool) -> AsyncIterator[dict]:
    """The OpenAI stream of ``events`` (without the final ``[DONE]``, which the SSE response adds). Closing
    this iterator closes ``events`` (which frees the request's engine contexts)."""
    offsets = [0] * plan.num_choices  # completions: text_offset of each choice's next token
    async with aclosing(events):
        if plan.chat:  # every chat choice opens with its role
            for index in range(plan.num_choices):
                yield _chunk(plan, index, {"role": "assistant", "content": ""}, None, None, with_usage)
        async for event in events:
            if isinstance(event, ChoiceDelta):
                reason = event.finish_reason.value if event.finish_reason is not None else None
                logprobs = None
                if plan.logprobs is not None:
                    logprobs, offsets[event.index] = _logprobs(plan, event.logprobs, offsets[event.index])
                yield _chunk(plan, event.index, _delta(plan, event.text), reason, logprobs, with_usage)
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
        return {"index": index, "message": {"role": "assistant", "content": res.text}, "logprobs": logprobs,
                "finish_reason": res.finish_reason.value}
    return {"index": index, "text": res.text, "logprobs": logprobs, "finish_reason": res.finish_reason.value}


# ---- logprobs ---------------------------------------------------------------------------------------------------
def _logprobs(plan: CompletionPlan, positions: Sequence[Position], offset: int) -> tuple[dict, int]:
    """The choice's ``logprobs`` object for ``positions`` (chat, or completions starting at ``offset``), and
    the offset after them."""
    if plan.chat:
        return {"content": [_chat_position(p) for p in positions if not isinstance(p, UnscoredToken)]}, offset
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for p in positions:
        text_offset.append(offset)
        if isinstance(p, UnscoredToken):
            tokens.append(p.token)
            token_logprobs.append(None)
            top_logprobs.append(None)
            offset += len(p.token)
            continue
        tokens.append(p.chosen.token)
        token_logprobs.append(p.chosen.logprob)
        top: dict[str, float] = {}
        for t in (*p.top, p.chosen):  # the k most likely, then the chosen one; the likelier wins a repeated text
            top.setdefault(t.token, t.logprob)
        top_logprobs.append(top)
        offset += len(p.chosen.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}, offset


def token_logprob_body(t: TokenLogprob) -> dict:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}


def _chat_position(p: Position) -> dict:
    assert not isinstance(p, UnscoredToken)  # chat never echoes
    return {**token_logprob_body(p.chosen), "top_logprobs": [token_logprob_body(t) for t in p.top]}


def _chunk_object(plan: CompletionPlan) -> str:
    return "chat.completion.chunk" if plan.chat else "text_completion"


def _delta(plan: CompletionPlan, text: str) -> dict | str:
    return {"content": text} if plan.chat else text


def _chunk(plan: CompletionPlan, index: int, delta: dict | str, finish_reason: str | None, logprobs: dict | None,
           with_usage: bool) -> dict:
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
        chunk["usage"] = None
    return chunk
