"""vLLM's OpenAI-compatible server as an engine: ``/v1/completions`` with token-id prompts.

Shapes from vLLM's code (vllm/entrypoints/openai/protocol.py, api_server.py) and docs (serving/
openai_compatible_server.md, "Extra parameters"; design/metrics.md):

* ``POST /v1/completions`` ``{model, prompt: [ids], max_tokens, temperature, top_p, top_k (-1 = off),
  min_tokens, repetition_penalty, presence_penalty, frequency_penalty, seed, stop, stop_token_ids, ignore_eos,
  include_stop_str_in_output, skip_special_tokens, return_token_ids, stream, [logit_bias {id: bias}, min_p]}`` ->
  ``{choices: [{text, token_ids, finish_reason: stop|length}], usage: {prompt_tokens, completion_tokens,
  prompt_tokens_details: {cached_tokens}}}``; streamed as SSE chunks of the same shape (``token_ids`` the delta)
  ending with ``data: [DONE]``.
* ``POST /tokenize`` ``{model, prompt, add_special_tokens}`` -> ``{count, max_model_len, tokens}``;
  ``POST /detokenize`` ``{model, tokens}`` -> ``{prompt}``.
* ``GET /v1/models`` -> ``{data: [{id, owned_by: vllm, max_model_len}]}``; ``GET /health`` -> 200;
  ``GET /version`` -> ``{version}``.
* ``GET /metrics`` (Prometheus text): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before v1), and ``vllm:cache_config_info`` whose
  labels carry ``block_size`` and ``num_gpu_blocks``.
* errors: ``{error: {message, type: BadRequestError, code: 400}}`` (flat ``{object: error, message, type, code}``
  in older versions).

Automatic prefix caching (on by default in vLLM v1) reuses the shared prefix of our forks' prompts.
"""

from __future__ import annotations

import logging

from parrot.backends.base import Completion, Dialect, Load, Prompt
from parrot.backends.metrics import parse_prometheus
from parrot.common.errors import ParrotError
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.protocol.interface import ModelInfo

logger = logging.getLogger(__name__)
FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def openai_finish(value: object) -> FinishReason | None:
    return FINISH.get(value) if isinstance(value, str) else None


class VllmDialect(Dialect):
    kind = "vllm"
    token_prompts = True
    prefix_cache = True

    def __init__(self, http) -> None:
        super().__init__(http)
        self.model = ""

    async def model_info(self) -> ModelInfo:
        models = await self.get("/v1/models", probe=True)
        card = (models.get("data") or [{}])[0]
        self.model = str(card.get("id") or "")
        window = card.get("max_model_len") or self.http.settings.max_model_len or 2048
        info = await self.optional("/tokenizer_info")  # served with --enable-tokenizer-info-endpoint
        if not info.get("chat_template"):
            logger.warning("vLLM server %s (model %s) publishes no chat template (start it with "
                           "--enable-tokenizer-info-endpoint): chat completions on it answer 400 "
                           "bad_chat_template; completions and semantic functions work", self.http.url, self.model)
        bos = await self._special(info.get("bos_token"))
        eos = await self._special(info.get("eos_token"))
        # what the tokenizer adds to an empty text (a BOS, for models that want one): the manager puts it first,
        # since a token-id prompt is taken as it is
        added = (await self.post("/tokenize", {"model": self.model, "prompt": "", "add_special_tokens": True},
                                 probe=True)).get("tokens") or []
        return ModelInfo(name=self.model, max_model_len=int(window), vocab_size=2**31 - 1,
                         bos_token_id=int(added[0]) if added else bos, eos_token_ids=(eos,) if eos is not None else (),
                         chat_template=info.get("chat_template"), add_bos=bool(added), numerics={"backend": self.kind})

    async def _special(self, token: object) -> int | None:
        if isinstance(token, dict):  # tokenizer_info may give an AddedToken as a dict
            token = token.get("content")
        if not isinstance(token, str) or not token:
            return None
        ids = (await self.post("/tokenize", {"model": self.model, "prompt": token, "add_special_tokens": False},
                               probe=True)).get("tokens") or []
        return int(ids[0]) if len(ids) == 1 else None

    async def load(self) -> Load:
        await self.http.request("GET", "/health", probe=True, errors=self.error)
        try:
            r = await self.http.request("GET", "/metrics", probe=True, errors=self.error)
        except ParrotError:  # metrics are optional; health decided liveness
            return Load()
        m = parse_prometheus(r.text)
        blocks = m.label_int("vllm:cache_config_info", "num_gpu_blocks")
        block_size = m.label_int("vllm:cache_config_info", "block_size")
        kv = blocks * block_size if blocks and block_size else None
        usage = m.value("vllm:kv_cache_usage_perc", m.value("vllm:gpu_cache_usage_perc"))
        return Load(num_running=m.int_value("vllm:num_requests_running"),
                    num_waiting=m.int_value("vllm:num_requests_waiting"), kv_tokens=kv,
                    kv_used_tokens=int(usage * kv) if kv is not None and usage is not None else None)

    async def tokenize(self, text: str) -> list[int]:
        body = await self.post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return [int(t) for t in body.get("tokens", [])]

    async def detokenize(self, token_ids: list[int]) -> str:
        return str((await self.post("/detokenize", {"model": self.model, "tokens": token_ids})).get("prompt", ""))

    def completion_request(self, prompt: Prompt, sampling: SamplingParams, max_tokens: int,
                           stream: bool) -> tuple[str, dict]:
        self.unsupported(sampling, fields=("logprobs", "constraint"))
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "min_tokens": sampling.min_tokens, "repetition_penalty": sampling.repetition_penalty,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            "stop": list(sampling.stop), "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": sampling.ignore_eos, "include_stop_str_in_output": sampling.include_stop_str_in_output,
            "skip_special_tokens": True, "return_token_ids": True, "stream": stream,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if stream:  # a last usage chunk: what the server's prefix cache served (usage.prompt_tokens_details)
            body["stream_options"] = {"include_usage": True}
        if sampling.logit_bias:  # the server's own token ids (prompts are its tokens too)
            body["logit_bias"] = {str(t): b for t, b in sampling.logit_bias}
        if sampling.min_p > 0.0:
            body["min_p"] = sampling.min_p
        return "/v1/completions", body

    def parse(self, body: dict) -> Completion:
        choice = (body.get("choices") or [{}])[0]
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        ids = choice.get("token_ids")
        return Completion(text=str(choice.get("text", "")),
                          token_ids=tuple(int(t) for t in ids) if ids is not None else None,
                          finish_reason=openai_finish(choice.get("finish_reason")) or FinishReason.STOP,
                          prompt_tokens=usage.get("prompt_tokens"), cached_tokens=details.get("cached_tokens"))

    def parse_event(self, event: dict, state: dict) -> Completion:
        choices = event.get("choices") or []
        if not choices:  # the usage-only chunk (stream_options.include_usage): the server's prefix-cache hit
            details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
            return Completion("", (), None, cached_tokens=details.get("cached_tokens"))
        choice = choices[0]
        ids = choice.get("token_ids")
        return Completion(text=str(choice.get("text") or ""),
                          token_ids=tuple(int(t) for t in ids) if ids is not None else None,
                          finish_reason=openai_finish(choice.get("finish_reason")))
