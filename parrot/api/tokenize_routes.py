"""vLLM's tokenizer endpoints at the root: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Shapes as vLLM's (``{count, max_model_len, tokens}``, ``{prompt}``), so clients written for it work here, e.g.
lm-evaluation-harness's remote tokenizer (it probes ``/tokenizer_info`` and ``/tokenize``). ``model`` may be left
out while one model is served. Token counts equal the completion and chat paths' ``usage.prompt_tokens``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from parrot.api.openai_shapes import message_dicts
from parrot.api.request_fields import template_kwargs
from parrot.api.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from parrot.common.errors import InvalidRequestError
from parrot.manager.completions import CompletionService

router = APIRouter(tags=["tokenizer"])


def _service(request: Request) -> CompletionService:
    return request.app.state.completions


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of 'prompt' and 'messages'", param="prompt")
    result = await _service(request).tokenize(
        body.model, prompt=body.prompt, messages=message_dicts(body.messages) if body.messages is not None else None,
        add_special_tokens=body.add_special_tokens, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, template_kwargs=template_kwargs(body))
    return TokenizeResponse(count=len(result.token_ids), max_model_len=result.max_model_len, tokens=result.token_ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    return DetokenizeResponse(prompt=await _service(request).detokenize(body.model, body.tokens))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> dict:
    """The special tokens' texts, chat template and window (vLLM's ``/tokenizer_info`` keys)."""
    info = await _service(request).tokenizer_info(model)
    return {"model": info.model, "tokenizer_class": "parrot", "bos_token": info.bos_token,
            "eos_token": info.eos_token, "pad_token": None, "add_bos_token": info.add_bos,
            "chat_template": info.chat_template, "model_max_length": info.max_model_len}
