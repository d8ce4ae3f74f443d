"""OpenAI request and response shapes around :mod:`parrot.manager.completions`.

In: a validated ``CompletionRequest`` / ``ChatCompletionRequest`` becomes the service's plain
:class:`CompletionSpec` / :class:`ChatSpec` (features this server does not support are a 400 here, naming the
field; OpenAI's defaults and vLLM's extras map onto the one :class:`SamplingParams` field set). Out: the
service's typed results become OpenAI bodies and stream chunks (``text_completion`` or ``chat.completion``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from parrot.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingRequest
from parrot.common.errors import InvalidRequestError
from parrot.engine.interface import GenerateResult
from parrot.manager.completions import (
    ChatSpec,
    ChoiceDelta,
    ChoiceSpec,
    CompletionPlan,
    CompletionResult,
    CompletionSpec,
    Usage,
)


# ---- requests -> specs ------------------------------------------------------------------------------------------
def completion_spec(req: CompletionRequest) -> CompletionSpec:
    _reject_unsupported(req, {"echo": req.echo, "logprobs": req.logprobs is not None,
                              "suffix": req.suffix is not None,
                              "best_of": req.best_of is not None and req.best_of != req.n})
    # one text, one list of token ids, or a list of either
    prompts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else list(req.prompt)
    return CompletionSpec(req.model, prompts, _choices(req, req.max_tokens))


def chat_spec(req: ChatCompletionRequest) -> ChatSpec:
    _reject_unsupported(req, {"logprobs": bool(req.logprobs), "top_logprobs": req.top_logprobs is not None})
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return ChatSpec(req.model, message_dicts(req.messages), _choices(req, asked))


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


def _choices(req: _SamplingRequest, max_tokens: int | None) -> ChoiceSpec:
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
        "include_stop_str_in_output": req.include_stop_str_in_output,
    }
    return ChoiceSpec(n=req.n, max_tokens=max_tokens, sampling=sampling)


def include_usage(req: _SamplingRequest) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


# ---- results -> bodies and chunks -------------------------------------------------------------------------------
def completion_body(plan: CompletionPlan, result: CompletionResult) -> dict:
    return {"id": plan.id, "object": "chat.completion" if plan.chat else "text_completion",
            "created": plan.created, "model": plan.model,
            "choices": [_choice(plan, index, res) for index, res in enumerate(result.choices)],
            "usage": _usage(result.usage)}


async def stream_chunks(plan: CompletionPlan, events: AsyncIterator[ChoiceDelta | Usage], *,
                        with_usage: bool) -> AsyncIterator[dict]:
    """The OpenAI stream of ``events`` (without the final ``[DONE]``, which the SSE response adds). Closing
    this iterator closes ``events`` (which frees the request's engine contexts)."""
    async with aclosing(events):
        if plan.chat:  # every chat choice opens with its role
            for index in range(plan.num_choices):
                yield _chunk(plan, index, {"role": "assistant", "content": ""}, None, with_usage)
        async for event in events:
            if isinstance(event, ChoiceDelta):
                reason = event.finish_reason.value if event.finish_reason is not None else None
                yield _chunk(plan, event.index, _delta(plan, event.text), reason, with_usage)
            elif with_usage:
                yield {"id": plan.id, "object": _chunk_object(plan), "created": plan.created, "model": plan.model,
                       "choices": [], "usage": _usage(event)}


def _usage(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _choice(plan: CompletionPlan, index: int, res: GenerateResult) -> dict:
    if plan.chat:
        return {"index": index, "message": {"role": "assistant", "content": res.text}, "logprobs": None,
                "finish_reason": res.finish_reason.value}
    return {"index": index, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason.value}


def _chunk_object(plan: CompletionPlan) -> str:
    return "chat.completion.chunk" if plan.chat else "text_completion"


def _delta(plan: CompletionPlan, text: str) -> dict | str:
    return {"content": text} if plan.chat else text


def _chunk(plan: CompletionPlan, index: int, delta: dict | str, finish_reason: str | None,
           with_usage: bool) -> dict:
    choice: dict[str, Any] = {"index": index}
    if plan.chat:  # the last chunk of a choice carries no empty content
        choice["delta"] = delta if finish_reason is None or delta != {"content": ""} else {}
    else:
        choice["text"] = delta
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    chunk = {"id": plan.id, "object": _chunk_object(plan), "created": plan.created, "model": plan.model,
             "choices": [choice]}
    if with_usage:
        chunk["usage"] = None
    return chunk
