"""Any OpenAI-compatible server as an engine: ``/v1/completions`` with text prompts, ``/v1/models``.

Only the OpenAI Completions API is assumed (https://platform.openai.com/docs/api-reference/completions):
``POST /v1/completions`` ``{model, prompt: str, max_tokens, temperature, top_p, presence_penalty,
frequency_penalty, seed, stop (at most 4 strings in OpenAI's API), stream}`` -> ``{choices: [{text,
finish_reason}], usage: {prompt_tokens, completion_tokens}}``; SSE chunks of the same shape ending with
``data: [DONE]``; ``GET /v1/models`` -> ``{data: [{id, ...}]}`` (doubles as the health check). A ``max_model_len``
on the model card (vLLM, Parrot) gives the window; else ``PARROT_BACKEND_MAX_MODEL_LEN`` or 2048.

With no tokenizer on the server side, the adapter's contexts hold UTF-8 bytes (one pseudo token per byte), so a
context's text is exact and a fork shares its parent's text; the server's window is enforced by the server, and
by the adapter at ``text_window_bytes_per_token`` bytes per token. ``ignore_eos`` and ``repetition_penalty``
are sent as the common extensions (vLLM, llama.cpp, Parrot accept them) only when set.
"""

from __future__ import annotations

from parrot.backends.base import Completion, Dialect, Load, Prompt
from parrot.backends.vllm import openai_finish
from parrot.common.errors import EngineError
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.protocol.interface import ModelInfo


class OpenAIDialect(Dialect):
    kind = "openai"
    token_prompts = False
    prefix_cache = False  # unknown: nothing is promised

    def __init__(self, http) -> None:
        super().__init__(http)
        self.model = ""

    async def model_info(self) -> ModelInfo:
        card = await self._card()
        self.model = str(card.get("id") or "")
        window = card.get("max_model_len") or self.http.settings.max_model_len or 2048
        # the chat template, where the server shares it (vLLM's and Parrot's /tokenizer_info): the manager renders
        # chat requests itself and sends the text
        template = (await self.optional("/tokenizer_info")).get("chat_template")
        return ModelInfo(name=self.model, max_model_len=int(window), vocab_size=256, bos_token_id=None,
                         eos_token_ids=(), chat_template=template if isinstance(template, str) else None,
                         add_bos=False, numerics={"backend": self.kind})

    async def _card(self) -> dict:
        models = await self.get("/v1/models", probe=True)
        data = models.get("data") if isinstance(models, dict) else None
        if not data or not isinstance(data[0], dict):
            raise EngineError(f"engine {self.http.name}: /v1/models lists no model")
        return data[0]

    async def load(self) -> Load:
        await self._card()
        return Load()

    async def tokenize(self, text: str) -> list[int]:
        raise EngineError("text-prompt backends tokenize on the adapter's side (UTF-8 bytes)")

    async def detokenize(self, token_ids: list[int]) -> str:
        raise EngineError("text-prompt backends detokenize on the adapter's side (UTF-8 bytes)")

    def completion_request(self, prompt: Prompt, sampling: SamplingParams, max_tokens: int,
                           stream: bool) -> tuple[str, dict]:
        # logit_bias names token ids, and a text-prompt server's tokenizer is not known to be ours
        self.unsupported(sampling, fields=("logprobs", "constraint", "min_tokens", "top_k", "stop_token_ids",
                                           "include_stop_str_in_output", "logit_bias", "min_p"))
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p,
                "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
                "stream": stream}
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.ignore_eos:
            body["ignore_eos"] = True
        if sampling.repetition_penalty != 1.0:
            body["repetition_penalty"] = sampling.repetition_penalty
        return "/v1/completions", body

    def parse(self, body: dict) -> Completion:
        choice = (body.get("choices") or [{}])[0]
        usage = body.get("usage") or {}
        return Completion(text=str(choice.get("text", "")), token_ids=None,
                          finish_reason=openai_finish(choice.get("finish_reason")) or FinishReason.STOP,
                          prompt_tokens=usage.get("prompt_tokens"))

    def parse_event(self, event: dict, state: dict) -> Completion:
        choices = event.get("choices") or []
        if not choices:
            return Completion("", None, None)
        choice = choices[0]
        return Completion(text=str(choice.get("text") or ""), token_ids=None,
                          finish_reason=openai_finish(choice.get("finish_reason")))
