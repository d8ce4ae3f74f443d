"""llama.cpp's own server (``llama-server``) as an engine: ``/completion`` with token-id prompts.

Request and response fields follow llama.cpp's tools/server/README.md (the copy vendored by llama-cpp-python
0.3.36, which scripts/install-llama-server.sh builds):

* ``POST /completion`` ``{prompt: [ids], n_predict, temperature, top_k, top_p, min_p, repeat_penalty,
  presence_penalty, frequency_penalty, seed, stop, ignore_eos, cache_prompt, id_slot, return_tokens, stream}``
  -> ``{content, tokens, stop_type: none|eos|limit|word, stopping_word, tokens_cached, tokens_evaluated,
  timings: {prompt_ms, cache_n (prompt tokens its cache served), ...}}``; streamed as SSE events
  ``{content, tokens, stop, ...}`` (the last one with ``stop: true``, ``stop_type`` and ``timings``).
* ``POST /tokenize`` ``{content, add_special, parse_special}`` -> ``{tokens}``; ``POST /detokenize`` ``{tokens}``
  -> ``{content}``.
* ``GET /health`` -> 200 ``{status: ok}``, 503 while loading; ``GET /props`` -> ``{default_generation_settings:
  {n_ctx}, total_slots, model_path, chat_template, bos_token, eos_token}``; ``GET /slots`` -> one object per slot
  ``{id, n_ctx, is_processing}``; ``GET /v1/models`` -> ``{data: [{id, owned_by: llamacpp, meta: {n_vocab,
  n_ctx_train}}]}``.
* errors: ``{error: {code, message, type}}`` with ``type`` ``exceed_context_size_error`` for a prompt beyond the
  slot's context, ``invalid_request_error`` for bad parameters, ``unavailable_error`` while loading.

Prefix reuse: ``cache_prompt`` (on) makes a slot evaluate only the part of a prompt after what it already holds,
and the server sends a request to the idle slot whose cached prompt is most similar, so the forks of one context
find their shared prefix evaluated; the host-memory prompt cache (``--cache-ram``) keeps slot states between uses.
Sampling defaults differ from ours (top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.1), so every field is sent.
"""

from __future__ import annotations

import os

from parrot.backends.base import Completion, Dialect, Load, Prompt, default_error, error_fields
from parrot.common.errors import ContextLengthExceeded, EngineUnavailable, ParrotError
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.protocol.interface import ModelInfo

_FINISH = {"eos": FinishReason.STOP, "word": FinishReason.STOP, "limit": FinishReason.LENGTH}


class LlamaCppDialect(Dialect):
    kind = "llamacpp"
    token_prompts = True
    prefix_cache = True

    def __init__(self, http) -> None:
        super().__init__(http)
        self._slot_ctx: int | None = None

    def error(self, name: str, status: int, body: dict) -> ParrotError:
        message, etype, _ = error_fields(body)
        if etype == "exceed_context_size_error":
            return ContextLengthExceeded(f"engine {name}: {message}")
        if etype == "unavailable_error":
            return EngineUnavailable(f"engine {name} is not ready: {message}")
        return default_error(name, status, body)

    async def model_info(self) -> ModelInfo:
        props = await self.get("/props", probe=True)
        models = await self.get("/v1/models", probe=True)
        card = (models.get("data") or [{}])[0] if isinstance(models, dict) else {}
        meta = card.get("meta") or {}
        n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx") or meta.get("n_ctx_train") or 0)
        self._slot_ctx = n_ctx
        # the model file's name, as the builtin engine names the model it loads: the same GGUF served by both is one
        # model to the manager (requests naming it may go to either)
        name = os.path.basename(str(props.get("model_path") or card.get("id") or "llamacpp"))
        bos = await self._special(props.get("bos_token"))
        eos = await self._special(props.get("eos_token"))
        # a token-id prompt gets no BOS from the server: where the model wants one (what its tokenizer adds to an
        # empty text with add_special), the manager puts it first, as for the builtin engine
        added = (await self.post("/tokenize", {"content": "", "add_special": True}, probe=True)).get("tokens") or []
        return ModelInfo(name=name, max_model_len=n_ctx or (self.http.settings.max_model_len or 2048),
                         vocab_size=int(meta.get("n_vocab") or 2**31 - 1),
                         bos_token_id=int(added[0]) if added else bos,
                         eos_token_ids=(eos,) if eos is not None else (), chat_template=props.get("chat_template"),
                         add_bos=bool(added),
                         numerics={"backend": "llamacpp", "build": str(props.get("build_info") or "")})

    async def _special(self, text: object) -> int | None:
        if not isinstance(text, str) or not text:
            return None
        ids = (await self.post("/tokenize", {"content": text, "add_special": False, "parse_special": True},
                               probe=True)).get("tokens") or []
        return int(ids[0]) if len(ids) == 1 else None

    async def load(self) -> Load:
        await self.get("/health", probe=True)  # 503 while loading -> EngineUnavailable
        slots = await self.get("/slots", probe=True)
        if not isinstance(slots, list):
            return Load()
        busy = [s for s in slots if s.get("is_processing")]
        # a slot's n_ctx is the whole cache with --kv-unified (shared by all slots), its share without: the
        # largest one never overstates what the server holds
        kv = max((int(s.get("n_ctx") or 0) for s in slots), default=0)
        return Load(num_running=len(busy), num_waiting=0, kv_tokens=kv or None)

    async def tokenize(self, text: str) -> list[int]:
        body = await self.post("/tokenize", {"content": text, "add_special": False, "parse_special": False})
        return [int(t) for t in body.get("tokens", [])]

    async def detokenize(self, token_ids: list[int]) -> str:
        return str((await self.post("/detokenize", {"tokens": token_ids})).get("content", ""))

    def completion_request(self, prompt: Prompt, sampling: SamplingParams, max_tokens: int,
                           stream: bool) -> tuple[str, dict]:
        self.unsupported(sampling, fields=("logprobs", "constraint", "min_tokens", "stop_token_ids",
                                           "include_stop_str_in_output"))
        body = {
            "prompt": prompt, "n_predict": max_tokens, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p, "typical_p": 1.0,
            "repeat_penalty": sampling.repetition_penalty, "repeat_last_n": -1 if sampling.needs_penalties else 0,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            "stop": list(sampling.stop), "ignore_eos": sampling.ignore_eos, "cache_prompt": True, "id_slot": -1,
            "return_tokens": True, "stream": stream,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.logit_bias:
            body["logit_bias"] = [[t, b] for t, b in sampling.logit_bias]
        return "/completion", body

    @staticmethod
    def _finish(body: dict) -> FinishReason | None:
        stop_type = body.get("stop_type")
        if stop_type in _FINISH:
            return _FINISH[stop_type]
        if body.get("stop"):  # a final event without a known stop_type
            return FinishReason.LENGTH if body.get("truncated") else FinishReason.STOP
        return None

    def parse(self, body: dict) -> Completion:
        timings = body.get("timings") or {}
        prompt_ms = timings.get("prompt_ms")
        tokens = body.get("tokens")
        return Completion(
            text=str(body.get("content", "")), token_ids=tuple(int(t) for t in tokens) if tokens is not None else None,
            finish_reason=self._finish(body) or FinishReason.STOP, prompt_tokens=body.get("tokens_evaluated"),
            cached_tokens=_cache_n(body),
            ttft_s=float(prompt_ms) / 1000 if isinstance(prompt_ms, (int, float)) else None)

    def parse_event(self, event: dict, state: dict) -> Completion:
        tokens = event.get("tokens")
        return Completion(text=str(event.get("content", "")),
                          token_ids=tuple(int(t) for t in tokens) if tokens is not None else None,
                          finish_reason=self._finish(event) if event.get("stop") else None,
                          cached_tokens=_cache_n(event) if event.get("stop") else None)


def _cache_n(body: dict) -> int | None:
    """Prompt tokens the slot's cache served (``timings.cache_n``; ``tokens_cached`` counts the whole cache after
    the call, generated tokens included, so it is not that)."""
    n = (body.get("timings") or {}).get("cache_n")
    return n if isinstance(n, int) and not isinstance(n, bool) else None
