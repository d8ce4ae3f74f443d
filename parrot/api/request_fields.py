"""The request fields of the OpenAI-compatible API beyond sampling (docs/api.md, "Request fields").

What changes the result is honoured: ``request_id``, ``priority``, ``truncate_prompt_tokens``, ``prompt_logprobs``
and the answer's shape options (``return_tokens_as_token_ids``, ``stream_options.continuous_usage_stats``) become
the plan's :class:`RequestOptions`; the chat template's controls (``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``) go to the renderer. What cannot change it here is recorded
(one debug line) and otherwise ignored. What would change it and cannot be honoured (``use_beam_search: true``)
is a 400 naming the field. Unknown fields are the schemas' business (:class:`parrot.api.schemas._Lenient`).

``prompt_logprobs`` answer in vLLM's shape, one entry per prompt token::

    [null, {"<token id>": {"logprob": -1.2, "rank": 1, "decoded_token": " the"}, ...}, ...]
      ^ the first token: nothing predicts it       ^ the k most likely (rank 1..k) and the prompt's token
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from parrot.api.schemas import ChatCompletionRequest, TokenizeRequest, _SamplingRequest
from parrot.common.errors import InvalidRequestError
from parrot.common.sampling import MAX_LOGPROBS, PositionLogprobs, TokenLogprob
from parrot.manager.completion_types import CompletionPlan, RequestOptions, UnscoredToken

logger = logging.getLogger(__name__)

# accepted and logged, changing nothing here (docs/api.md "Request fields" says why each one)
RECORDED_FIELDS = ("user", "metadata", "store", "service_tier", "reasoning_effort", "cache_salt", "length_penalty")
# names the chat template is given by the server; chat_template_kwargs may not replace them
TEMPLATE_NAMES = frozenset({"messages", "tools", "bos_token", "eos_token", "add_generation_prompt",
                            "raise_exception", "strftime_now"})


def request_options(req: _SamplingRequest) -> RequestOptions:
    """The request's non-sampling options; refuses ``use_beam_search: true``, ``prompt_logprobs`` out of range
    or with ``stream`` (vLLM's rule: a stream does not carry them) and a ``truncate_prompt_tokens`` below 1 other
    than -1; records the no-effect fields."""
    if req.use_beam_search:
        raise InvalidRequestError("beam search is not supported by this server", param="use_beam_search")
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}",
                                      param="prompt_logprobs")
        if req.stream:
            raise InvalidRequestError("prompt_logprobs are not available with stream: true", param="prompt_logprobs")
    keep = req.truncate_prompt_tokens
    if keep is not None and keep < 1 and keep != -1:
        raise InvalidRequestError(f"truncate_prompt_tokens must be >= 1 (or -1: the model's window), got {keep}",
                                  param="truncate_prompt_tokens")
    recorded = {name: getattr(req, name) for name in RECORDED_FIELDS if getattr(req, name) is not None}
    if recorded:
        logger.debug("request fields recorded, without effect here: %s", recorded)
    so = req.stream_options
    return RequestOptions(request_id=req.request_id, priority=req.priority, truncate_prompt_tokens=keep,
                          prompt_logprobs=req.prompt_logprobs,
                          return_tokens_as_token_ids=req.return_tokens_as_token_ids,
                          continuous_usage_stats=bool(so and so.include_usage and so.continuous_usage_stats))


def template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """``chat_template_kwargs`` checked: none of the server's own template names, and not both
    ``continue_final_message`` and ``add_generation_prompt`` (vLLM's rule); each → 400 naming the field."""
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true (set "
                                  "add_generation_prompt: false to continue the last message)",
                                  param="continue_final_message")
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(TEMPLATE_NAMES & set(kwargs))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets it)",
                                  param=f"chat_template_kwargs.{reserved[0]}")
    return kwargs


def token_text(plan: CompletionPlan, t: TokenLogprob | UnscoredToken) -> str:
    """A token as logprobs show it: its text, or "token_id:N" (vLLM's ``return_tokens_as_token_ids``)."""
    return f"token_id:{t.token_id}" if plan.options.return_tokens_as_token_ids else t.token


def prompt_logprobs_body(plan: CompletionPlan, positions: Sequence[PositionLogprobs | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` (module docstring): the prompt token's ``rank`` is null when it is not among the
    k most likely (the engine reports those k, not the token's place in the whole vocabulary)."""
    out: list[dict | None] = []
    for p in positions:
        if p is None:
            out.append(None)
            continue
        entry: dict[str, dict] = {}
        for rank, t in enumerate(p.top, start=1):
            entry.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank,
                                               "decoded_token": token_text(plan, t)})
        entry.setdefault(str(p.chosen.token_id), {"logprob": p.chosen.logprob, "rank": None,
                                                  "decoded_token": token_text(plan, p.chosen)})
        out.append(entry)
    return out
