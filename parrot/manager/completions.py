"""The completion service (:class:`CompletionService`): request-centric completions over the engine abstraction
(what the OpenAI-compatible API runs; no Semantic Variables) -- planning, the tokenizer endpoints, and
``complete`` / ``stream`` over a :class:`~parrot.manager.completion_run.CompletionRun`.

The API layer turns an HTTP request into a plain :class:`CompletionSpec` / :class:`ChatSpec`; the service
makes it a :class:`CompletionPlan` (validated, tokenized, sampling resolved) before any engine work, so bad
input is a 4xx before a stream starts. Results are typed (:class:`CompletionResult`, or :class:`ChoiceDelta`
events then one :class:`Usage`); the API layer shapes them into OpenAI JSON. Running a plan (leases, the fill
and the forked choice contexts, failover, tool-call pauses, freeing everything at the end) is
:mod:`parrot.manager.completion_run`'s.

Choice ``j`` of prompt ``i`` has index ``i * n + j`` in results and events.

Chat with tools (:mod:`parrot.manager.tool_calls`): the tools are rendered into the prompt (the template's
``tools`` variable or a system block) and the plan carries the :class:`ToolPlan`, by which the API layer reads
each choice's text as tool calls; a forced call's constraint is already in the sampling. Results stay text.

Logprobs (``sampling["logprobs"] = k``) and echo. A choice's logprobs are one entry per position::

    | prompt tokens (echo only; fill(prompt_logprobs=k)) | generated tokens (generate with logprobs=k) |
      ^ the first is an UnscoredToken: nothing predicts it

Completions list every generated token (a final EOS / stop token too: ``len == echoed prompt + completion
tokens``, the positions an evaluation harness slices by). Chat lists the tokens of the message text: a token is
listed once its first byte is in the text sent (:class:`~parrot.manager.logprob_align.TextAligned`), so a final
stop token and the tail of a cut stop string are left out and the listed tokens' bytes spell the content. Echo
with ``max_tokens == 0`` fills the prompt (with its logprobs) and generates nothing (finish reason ``length``).
``Usage.cached_tokens`` sums the engines' ``FillResult.num_cached`` (each prompt is filled once, whatever ``n``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import anyio

from parrot.common.errors import BadSamplingParams, ContextLengthExceeded, EngineUnavailable, InvalidRequestError
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.protocol.interface import EngineClient, GenerateChunk, ModelInfo
from parrot.manager.chat_template import ChatRenderer
from parrot.manager.completion_run import CompletionRun, gather_or_cancel
from parrot.manager.completion_types import (
    ChatSpec,
    ChoiceDelta,
    ChoiceSpec,
    CompletionPlan,
    CompletionResult,
    CompletionSpec,
    PromptJob,
    RequestOptions,
    Tokenized,
    TokenizerInfo,
    Usage,
)
from parrot.manager.dispatcher import Dispatcher
from parrot.manager.failover import Failover, OrphanContexts
from parrot.manager.logprob_align import aligner, generated_positions
from parrot.manager.metrics import ManagerMetrics
from parrot.manager.recent import RecentRequests
from parrot.manager.tool_context import PausedChats
from parrot.manager.tool_predict import Predictors

logger = logging.getLogger(__name__)

MAX_PROMPTS = 256


class CompletionService:
    def __init__(self, dispatcher: Dispatcher, *, max_n: int = 16, renderer: ChatRenderer | None = None,
                 max_attempts: int = 3, recent: RecentRequests | None = None,
                 metrics: ManagerMetrics | None = None, predictors: Predictors | None = None) -> None:
        """``max_attempts``: runs of a prompt in all when its engine dies under it (1 = no restart); ``recent``:
        where each prompt is recorded with its timings when it ends (the manager's, for the web view);
        ``predictors``: output lengths and tool durations (the manager's, shared with the graph executor)."""
        self.failover = Failover(dispatcher, max_attempts=max_attempts)  # raises ValueError for max_attempts < 1
        self.recent = recent or RecentRequests()
        self.metrics = metrics or ManagerMetrics()  # the manager's: requests, TTFT / TPOT / end-to-end
        self.predictors = predictors or Predictors()
        self.paused_chats = PausedChats()  # chat contexts paused for a tool call, until their follow-up is filled
        self.dispatcher = dispatcher
        self.max_n = max_n
        self.renderer = renderer or ChatRenderer()
        self.orphans = OrphanContexts(dispatcher.registry)  # contexts left on dead engines
        self._special_text: dict[tuple[str, int], str] = {}  # (model, token id) -> text

    @property
    def num_restarted(self) -> int:
        """Prompts restarted on another engine after theirs died."""
        return self.failover.num_restarts

    # ---- planning (all validation happens here) ---------------------------------------------------------------
    async def plan_completion(self, spec: CompletionSpec) -> CompletionPlan:
        client, info = self._tokenizer_for(spec.model)
        if len(spec.prompts) > MAX_PROMPTS:
            raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(spec.prompts)}",
                                      param="prompt")
        if spec.choices.max_tokens == 0 and not spec.echo:
            raise BadSamplingParams("max_tokens must be >= 1 (0 only with echo: the prompt scored, nothing generated)",
                                    param="max_tokens")
        jobs = []
        choices = await self._resolve_bad_words(client, spec.choices)
        for i, p in enumerate(spec.prompts):
            ids = await self._encode(client, info, p) if isinstance(p, str) else _check_ids(p, info, "prompt")
            cut = _truncate(ids, spec.options, info)
            max_tokens = _max_tokens(spec.choices, info, len(cut), "prompt")
            echo_text = None
            if spec.echo:
                echo_text = p if isinstance(p, str) and cut is ids else await client.detokenize(cut)
            jobs.append(PromptJob(i, cut, _samplings(choices, max_tokens, self.max_n, info), echo_text))
        rid, run = _ids("cmpl", spec.options)
        return CompletionPlan(False, rid, int(time.time()), spec.model, spec.choices.n, jobs,
                              generate=spec.choices.max_tokens != 0, run_id=run, options=spec.options)

    async def plan_chat(self, spec: ChatSpec) -> CompletionPlan:
        client, info = self._tokenizer_for(spec.model)
        tools = spec.tools.shown if spec.tools is not None else []
        text = await self._render(client, info, spec.messages, tools=tools,
                                  add_generation_prompt=spec.add_generation_prompt,
                                  continue_final_message=spec.continue_final_message,
                                  template_kwargs=spec.template_kwargs)
        ids = _truncate(await self._encode(client, info, text), spec.options, info)
        max_tokens = _max_tokens(spec.choices, info, len(ids), "messages")
        if max_tokens == 0:
            raise BadSamplingParams("max_tokens must be >= 1", param="max_tokens")
        choices = await self._resolve_bad_words(client, spec.choices)
        rid, run = _ids("chatcmpl", spec.options)
        return CompletionPlan(True, rid, int(time.time()), spec.model, spec.choices.n,
                              [PromptJob(0, ids, _samplings(choices, max_tokens, self.max_n, info))],
                              tools=spec.tools, run_id=run, options=spec.options)

    async def _resolve_bad_words(self, client: EngineClient, choices: ChoiceSpec) -> ChoiceSpec:
        """``choices`` with its ``bad_words`` as token sequences in ``sampling["bad_words_ids"]``, as vLLM makes
        them: each word as written and, when that gives other tokens of the same count, with one leading space
        (so the word is banned at the start of the text and after a space)."""
        if not choices.bad_words:
            return choices
        seqs: list[list[int]] = []
        for word in choices.bad_words:
            plain = await client.tokenize(word.lstrip())
            if not plain:
                raise InvalidRequestError(f"bad_words: {word!r} has no tokens", param="bad_words")
            seqs.append(plain)
            spaced = await client.tokenize(" " + word.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                seqs.append(spaced)
        return dataclasses.replace(choices, sampling={**choices.sampling, "bad_words_ids": seqs}, bad_words=())

    # ---- tokenizer endpoints ------------------------------------------------------------------------------------
    async def tokenize(self, model: str | None, *, prompt: str | None = None,
                       messages: Sequence[Mapping[str, Any]] | None = None, add_special_tokens: bool = True,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       template_kwargs: Mapping[str, Any] | None = None) -> Tokenized:
        """Token ids of ``prompt``, or of ``messages`` rendered with the chat template, as the completion and
        chat paths count them (``add_special_tokens``: BOS when the model adds one). One of the two is given."""
        client, info = self._tokenizer_for(self._model_or_only(model))
        if messages is not None:
            text = await self._render(client, info, messages, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        else:
            assert prompt is not None
            text = prompt
        ids = await self._encode(client, info, text, add_bos=add_special_tokens, allow_empty=True)
        return Tokenized(ids, info.max_model_len)

    async def detokenize(self, model: str | None, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; ids outside the vocabulary are a 400 naming ``tokens``."""
        client, info = self._tokenizer_for(self._model_or_only(model))
        return await client.detokenize(_check_ids(token_ids, info, "tokens"))

    async def tokenizer_info(self, model: str | None) -> TokenizerInfo:
        client, info = self._tokenizer_for(self._model_or_only(model))
        bos = await self._token_text(client, info, info.bos_token_id) if info.bos_token_id is not None else None
        eos_id = info.eos_token_ids[0] if info.eos_token_ids else None
        eos = await self._token_text(client, info, eos_id) if eos_id is not None else None
        return TokenizerInfo(info.name, bos, eos, info.chat_template, info.max_model_len, info.add_bos)

    def _model_or_only(self, model: str | None) -> str:
        """``model``, or the one served model when not named (several served: 400 naming ``model``)."""
        if model is not None:
            return model
        names = sorted({i.name for i in self.dispatcher.registry.model_infos()})
        if len(names) > 1:
            raise InvalidRequestError(f"name the model: this server serves {names}", param="model")
        if not names:
            raise EngineUnavailable("no live engine")
        return names[0]

    def _tokenizer_for(self, model: str) -> tuple[EngineClient, ModelInfo]:
        entry = self.dispatcher.registry.candidates((model,))[0]  # engines of one model share a tokenizer
        assert entry.info is not None
        return entry.client, entry.info

    async def _render(self, client: EngineClient, info: ModelInfo, messages: Sequence[Mapping[str, Any]], *,
                      add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] = (),
                      continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> str:
        bos = await self._token_text(client, info, info.bos_token_id)
        eos = await self._token_text(client, info, info.eos_token_ids[0] if info.eos_token_ids else None)
        return self.renderer.render(info.chat_template, messages, bos_token=bos, eos_token=eos,
                                    add_generation_prompt=add_generation_prompt, tools=tools,
                                    continue_final_message=continue_final_message, template_kwargs=template_kwargs)

    async def _encode(self, client: EngineClient, info: ModelInfo, text: str, *, add_bos: bool = True,
                      allow_empty: bool = False) -> list[int]:
        ids = await client.tokenize(text)
        if add_bos and info.add_bos and info.bos_token_id is not None and (not ids or ids[0] != info.bos_token_id):
            ids = [info.bos_token_id, *ids]
        if not ids and not allow_empty:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    async def _token_text(self, client: EngineClient, info: ModelInfo, token_id: int | None) -> str:
        if token_id is None:
            return ""
        key = (info.name, token_id)
        if key not in self._special_text:
            self._special_text[key] = await client.detokenize([token_id])
        return self._special_text[key]

    # ---- execution ----------------------------------------------------------------------------------------------
    def _new_run(self, plan: CompletionPlan) -> CompletionRun:
        return CompletionRun(plan, dispatcher=self.dispatcher, failover=self.failover, recent=self.recent,
                             metrics=self.metrics, predictors=self.predictors, paused_chats=self.paused_chats,
                             orphans=self.orphans)

    async def complete(self, plan: CompletionPlan) -> CompletionResult:
        """Run every prompt and choice."""
        run = self._new_run(plan)
        try:
            per_job = await gather_or_cancel([run.generate_all(job) for job in plan.jobs])
        except BaseException as e:
            run.timer.done(e)
            raise
        else:
            run.timer.done(None)
        finally:
            await run.close()
        choices = [res for results in per_job for res in results]
        return CompletionResult(choices, Usage(plan.prompt_tokens, sum(len(r.token_ids) for r in choices),
                                               run.cached_tokens), run.prompt_logprobs())

    async def stream(self, plan: CompletionPlan) -> AsyncIterator[ChoiceDelta | Usage]:
        """Deltas as the engines produce them (choices interleaved), then one :class:`Usage`. Every choice
        ends with a delta carrying a finish reason. Raises the first failure (typed) after the deltas sent."""
        run = self._new_run(plan)
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(run.pump(job, queue)) for job in plan.jobs]
        aligners = [aligner(plan) for _ in range(plan.num_choices)]
        finished: set[int] = set()
        completion_tokens = 0
        try:
            done = 0
            while done < plan.num_choices:
                kind, index, item = await queue.get()
                if kind == "error":
                    raise item
                if kind == "done":
                    done += 1
                    if index not in finished:  # an engine stream that ended without a finish reason
                        finished.add(index)
                        yield ChoiceDelta(index, "", FinishReason.STOP, aligners[index].push((), "", final=True),
                                      completion_tokens)
                    continue
                if kind == "echo":
                    text, positions = item
                    reason = None if plan.generate else FinishReason.LENGTH
                    if reason is not None:
                        finished.add(index)
                    yield ChoiceDelta(index, text, reason, positions, completion_tokens)
                    continue
                chunk: GenerateChunk = item
                completion_tokens += len(chunk.token_ids)
                final = chunk.finish_reason is not None
                run.timer.chunk(index, len(chunk.token_ids), final)
                if final:
                    finished.add(index)
                positions = aligners[index].push(generated_positions(plan, chunk.token_ids, chunk.logprobs),
                                                 chunk.text, final=final)
                if chunk.text or final or positions:
                    yield ChoiceDelta(index, chunk.text, chunk.finish_reason, positions, completion_tokens)
            yield Usage(plan.prompt_tokens, completion_tokens, run.cached_tokens)
        except BaseException as e:  # a failure, or the client went away (GeneratorExit)
            run.timer.done(e)
            raise
        else:
            run.timer.done(None)
        finally:
            for t in pumps:
                t.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*pumps, return_exceptions=True)
                await run.close()


# ---- spec -> sampling -------------------------------------------------------------------------------------------
def _max_tokens(choices: ChoiceSpec, info: ModelInfo, prompt_len: int, what: str) -> int:
    """Tokens each choice may generate: as asked, or up to the context window; either must fit in it."""
    max_tokens = choices.max_tokens if choices.max_tokens is not None else info.max_model_len - prompt_len
    if prompt_len + (max(max_tokens, 1) if choices.max_tokens != 0 else 0) > info.max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {info.max_model_len} tokens. However, you requested "
            f"{prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the {what}, {max(max_tokens, 0)} in the "
            f"completion). Please reduce the length of the {what} or completion.", param=what)
    return max_tokens


def _samplings(choices: ChoiceSpec, max_tokens: int, max_n: int, info: ModelInfo) -> tuple[SamplingParams, ...]:
    if choices.n > max_n:
        raise InvalidRequestError(f"n must be <= {max_n}, got {choices.n}", param="n")
    # max_tokens 0 (echo only) never generates: the other fields are still validated
    base = SamplingParams.from_dict({**choices.sampling, "max_tokens": max(max_tokens, 1)})
    top = base.max_token_id()
    if top is not None and top >= info.vocab_size:  # bad words come from the tokenizer: a bad id is logit_bias's
        raise InvalidRequestError(f"logit_bias: token id {top} is out of the vocabulary [0, {info.vocab_size})",
                                  param="logit_bias")
    # choice i of a seeded request uses seed + i: reproducible, yet the n choices differ
    return tuple(base if base.seed is None or i == 0 else base.replace(seed=base.seed + i)
                 for i in range(choices.n))


def _ids(prefix: str, options: RequestOptions) -> tuple[str, str]:
    """(the response's id, the run's unique key): vLLM's "<prefix>-<request_id>" for a client's request id, else
    a random one (then both are the same)."""
    run = f"{prefix}-{secrets.token_hex(12)}"
    return (f"{prefix}-{options.request_id}", run) if options.request_id is not None else (run, run)


def _truncate(ids: list[int], options: RequestOptions, info: ModelInfo) -> list[int]:
    """The prompt's last ``truncate_prompt_tokens`` tokens (-1: the model's window); ``ids`` itself when whole."""
    keep = options.truncate_prompt_tokens
    if keep == -1:
        keep = info.max_model_len
    return ids[len(ids) - keep:] if keep is not None and len(ids) > keep else ids


def _check_ids(ids: Sequence[int], info: ModelInfo, param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequestError(f"token id(s) {bad[:5]} out of the vocabulary [0, {info.vocab_size})",
                                  param=param)
    return list(ids)
