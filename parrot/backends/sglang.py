"""SGLang's server as an engine: its native ``/generate`` with ``input_ids``.

Shapes from SGLang's code (python/sglang/srt/managers/io_struct.py ``GenerateReqInput``,
python/sglang/srt/entrypoints/http_server.py) and docs (docs/basic_usage/sampling_params.md, native_api):

* ``POST /generate`` ``{input_ids: [ids], sampling_params: {max_new_tokens, temperature, top_p, top_k (-1 = off),
  min_new_tokens, repetition_penalty, presence_penalty, frequency_penalty, stop, stop_token_ids, ignore_eos,
  no_stop_trim, skip_special_tokens, sampling_seed}, stream}`` -> ``{text, output_ids, meta_info: {id,
  finish_reason: {type: stop|length|abort, matched}, prompt_tokens, completion_tokens, cached_tokens}}``.
  Streamed as SSE ``data: {...}`` events ending with ``data: [DONE]``; by default each event carries the text and
  output ids *so far* (cumulative; the server flag --incremental-streaming-output switches to deltas, which
  this adapter also handles: a chunk that does not extend what came before is taken as a delta).
* ``POST /tokenize`` ``{prompt, add_special_tokens}`` -> ``{tokens, count, max_model_len}``; ``POST /detokenize``
  ``{tokens}`` -> ``{text}``.
* ``GET /health`` -> 200; ``GET /get_server_info`` (``/server_info`` in newer releases) -> the server args
  (``model_path``, ``served_model_name``, ``context_length``) plus ``max_total_num_tokens`` (top level, or in
  ``internal_states[0]``), and load in ``internal_states[0]`` where reported.
* ``GET /get_model_info`` -> ``{model_path, is_generation}``.
* errors: ``{error: {message, type, code}}`` (an ``object: error`` body in older releases).

The radix cache matches our forks' shared prefix token by token.
"""

from __future__ import annotations

from parrot.backends.base import Completion, Dialect, Load, Prompt
from parrot.common.errors import EngineError
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.protocol.interface import ModelInfo

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def _finish(meta: dict) -> FinishReason | None:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        reason = reason.get("type")
    return _FINISH.get(reason) if isinstance(reason, str) else None


class SglangDialect(Dialect):
    kind = "sglang"
    token_prompts = True
    prefix_cache = True

    def __init__(self, http) -> None:
        super().__init__(http)
        self._info: dict = {}

    async def server_info(self) -> dict:
        for path in ("/get_server_info", "/server_info"):
            try:
                body = await self.get(path, probe=True)
            except EngineError:
                continue
            if isinstance(body, dict):
                return body
        raise EngineError(f"engine {self.http.name}: no /get_server_info or /server_info")

    async def model_info(self) -> ModelInfo:
        self._info = info = await self.server_info()
        path = str(info.get("served_model_name") or info.get("model_path") or "sglang")
        window = info.get("context_length") or self.http.settings.max_model_len or 2048
        # what the tokenizer adds to an empty text (a BOS, for models that want one): the manager puts it first
        added = (await self.post("/tokenize", {"prompt": "", "add_special_tokens": True}, probe=True)).get("tokens") \
            or []
        return ModelInfo(name=path, max_model_len=int(window), vocab_size=2**31 - 1,
                         bos_token_id=int(added[0]) if added else None, eos_token_ids=(), chat_template=None,
                         add_bos=bool(added),
                         numerics={"backend": self.kind, "version": str(info.get("version") or "")})

    async def load(self) -> Load:
        await self.http.request("GET", "/health", probe=True, errors=self.error)
        info = await self.server_info()
        state = (info.get("internal_states") or [{}])[0] or {}
        kv = info.get("max_total_num_tokens") or state.get("max_total_num_tokens")
        return Load(num_running=state.get("num_running_reqs"), num_waiting=state.get("num_waiting_reqs"),
                    kv_tokens=int(kv) if kv else None, kv_used_tokens=state.get("num_used_tokens"))

    async def tokenize(self, text: str) -> list[int]:
        body = await self.post("/tokenize", {"prompt": text, "add_special_tokens": False})
        return [int(t) for t in body.get("tokens", [])]

    async def detokenize(self, token_ids: list[int]) -> str:
        return str((await self.post("/detokenize", {"tokens": token_ids})).get("text", ""))

    def completion_request(self, prompt: Prompt, sampling: SamplingParams, max_tokens: int,
                           stream: bool) -> tuple[str, dict]:
        self.unsupported(sampling, fields=("logprobs", "constraint"))
        params = {
            "max_new_tokens": max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1, "min_new_tokens": sampling.min_tokens,
            "repetition_penalty": sampling.repetition_penalty, "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty, "stop": list(sampling.stop),
            "stop_token_ids": list(sampling.stop_token_ids), "ignore_eos": sampling.ignore_eos,
            "no_stop_trim": sampling.include_stop_str_in_output, "skip_special_tokens": True,
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        if sampling.logit_bias:
            params["logit_bias"] = {str(t): b for t, b in sampling.logit_bias}
        if sampling.min_p > 0.0:
            params["min_p"] = sampling.min_p
        return "/generate", {"input_ids": prompt, "sampling_params": params, "stream": stream}

    def parse(self, body: dict) -> Completion:
        meta = body.get("meta_info") or {}
        ids = body.get("output_ids")
        return Completion(text=str(body.get("text", "")),
                          token_ids=tuple(int(t) for t in ids) if ids is not None else None,
                          finish_reason=_finish(meta) or FinishReason.STOP, prompt_tokens=meta.get("prompt_tokens"),
                          cached_tokens=meta.get("cached_tokens"))

    def parse_event(self, event: dict, state: dict) -> Completion:
        """Cumulative events become increments: a text extending what was seen yields only its new part
        (``state`` holds what this stream has seen)."""
        meta = event.get("meta_info") or {}
        text = str(event.get("text", ""))
        raw = event.get("output_ids")
        ids = tuple(int(t) for t in raw) if raw is not None else None
        seen_text, seen_ids = state.get("text", ""), state.get("ids", ())
        if text.startswith(seen_text) and (ids is None or ids[:len(seen_ids)] == seen_ids):
            delta_text, delta_ids = text[len(seen_text):], ids[len(seen_ids):] if ids is not None else None
            state["text"], state["ids"] = text, ids if ids is not None else seen_ids
        else:  # an incremental stream
            delta_text, delta_ids = text, ids
            state["text"], state["ids"] = seen_text + text, seen_ids + (ids or ())
        return Completion(text=delta_text, token_ids=delta_ids, finish_reason=_finish(meta),
                          cached_tokens=meta.get("cached_tokens"))
