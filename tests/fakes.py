"""TEST DOUBLE ONLY: a small deterministic in-memory :class:`EngineClient` for manager and API unit tests.

It is not an engine (no model, no KV cache): it implements the EngineClient contract over byte-level
"tokens" so the manager and the HTTP layer can be tested fast and exactly. Conformance against the real
builtin engine is covered by the engine's own tests.

Tokenizer: one token per UTF-8 byte, id = byte + 3 (0 = pad, 1 = BOS, 2 = EOS); vocab 259.
"Model": the reply to a context is :meth:`FakeEngine.reply_for` of the context text, followed by
``"\\nrest of the answer"`` (so a stop at ``"\\n"`` ends it at the reply), then EOS. Sampled generations
(temperature > 0) append ``#<seed>`` (or ``#<n>``, a per-engine counter, without a seed).
Logprobs (deterministic, not a distribution): the logprob of token ``t`` after token ``p`` is
``-0.05 - ((t - p - 1) mod 259) / 10`` (:meth:`FakeEngine.fake_logprob`), so the ``k`` most likely tokens after
``p`` are ``p+1 .. p+k``; a token's text is its byte (BOS / EOS / pad show as ``<s>`` / ``</s>`` / ``<pad>``:
detokenize shows them, decode drops them). Generation reports logprobs per token when ``sampling.logprobs`` is
set, fill per filled token with ``prompt_logprobs`` (None for a context's first token). Prefix cache: a root
fill reports as ``num_cached`` the tokens (whole blocks of ``cache_block``) it shares with a context filled or
freed before.
Knobs: ``reply_lead`` (text put before every reply, e.g. ``" "`` like a BPE model whose first generated
token carries the word's leading space), ``fail_generate_when`` (a substring of the context text that makes
generate raise EngineError), ``fail_fill_when`` (a substring of the context id that makes fill raise
EngineError before creating it), ``gate`` (an asyncio.Event generate waits on), ``fill_gate`` (one fill waits
on), ``token_delay_s`` (stream pacing), ``max_model_len``. Forks are fills with a parent: see
:meth:`FakeEngine.forks`; every text given to tokenize is recorded in ``tokenized``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

from parrot.common.errors import (
    BadSamplingParams,
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    UnknownContext,
)
from parrot.common.sampling import FinishReason, PositionLogprobs, SamplingParams, TokenLogprob
from parrot.protocol.interface import (
    EngineClient,
    EngineStatus,
    FillResult,
    GenerateChunk,
    GenerateResult,
    ModelInfo,
    OpHint,
)

BOS, EOS, OFFSET = 1, 2, 3
VOCAB = 256 + OFFSET
SPECIAL_TEXT = {0: b"<pad>", BOS: b"<s>", EOS: b"</s>"}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TAIL = "\nrest of the answer"


class FakeEngine(EngineClient):
    def __init__(self, name: str = "fake0", *, model: str = "fake-model", max_model_len: int = 512,
                 add_bos: bool = True, chat_template: str | None = CHAT_TEMPLATE) -> None:
        self.name = name
        self.model = model
        self.max_model_len = max_model_len
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.contexts: dict[str, list[int]] = {}
        self.calls: list[tuple] = []  # ("fill"|"generate"|"free", context_id, parent_context_id or None, ...)
        self.freed: list[str] = []
        self.tokenized: list[str] = []  # every text passed to tokenize, in order
        self.reply_lead = ""
        self.fail_generate_when: str | None = None
        self.fail_fill_when: str | None = None
        self.gate: asyncio.Event | None = None
        self.fill_gate: asyncio.Event | None = None
        self.token_delay_s: float = 0.0
        self.generating = 0  # generate calls in progress
        self.cache_block = 16
        self._cached: list[tuple[int, ...]] = []  # contexts the "prefix cache" holds, newest last
        self._counter = itertools.count(1)

    # ---- the "model" ------------------------------------------------------------------------------------------
    @staticmethod
    def reply_for(context_text: str) -> str:
        """Deterministic reply: the last 24 characters of the context, newlines shown as '|', in brackets."""
        return "<" + context_text.replace("\n", "|")[-24:] + ">"

    def _answer(self, context_text: str, sampling: SamplingParams) -> str:
        reply = self.reply_for(context_text)
        if not sampling.greedy:
            reply += f"#{sampling.seed if sampling.seed is not None else next(self._counter)}"
        return self.reply_lead + reply + TAIL

    # ---- tokenizer ----------------------------------------------------------------------------------------------
    @staticmethod
    def encode(text: str) -> list[int]:
        return [b + OFFSET for b in text.encode("utf-8")]

    @staticmethod
    def decode(token_ids: list[int] | tuple[int, ...]) -> str:
        return bytes(t - OFFSET for t in token_ids if t >= OFFSET).decode("utf-8", errors="replace")

    @staticmethod
    def decode_complete(token_ids: list[int]) -> str:
        """The text of ``token_ids`` up to the last complete UTF-8 character (a stream holds back the rest)."""
        raw = bytes(t - OFFSET for t in token_ids if t >= OFFSET)
        for cut in range(4):
            try:
                return raw[:len(raw) - cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return raw.decode("utf-8", errors="replace")

    async def tokenize(self, text: str) -> list[int]:
        self.tokenized.append(text)
        return self.encode(text)

    @staticmethod
    def token_bytes(token_id: int) -> bytes:
        return SPECIAL_TEXT.get(token_id, bytes([token_id - OFFSET]) if token_id >= OFFSET else b"")

    async def detokenize(self, token_ids: list[int]) -> str:
        """Like a real tokenizer's decode: special tokens show as their text (``decode`` drops them)."""
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")

    async def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.model, max_model_len=self.max_model_len, vocab_size=VOCAB,
                         bos_token_id=BOS, eos_token_ids=(EOS,), chat_template=self.chat_template,
                         add_bos=self.add_bos)

    # ---- logprobs -------------------------------------------------------------------------------------------------
    @staticmethod
    def fake_logprob(token_id: int, prev: int) -> float:
        return -0.05 - ((token_id - prev - 1) % VOCAB) / 10

    @classmethod
    def token_logprob(cls, token_id: int, prev: int) -> TokenLogprob:
        raw = cls.token_bytes(token_id)
        return TokenLogprob(token_id, raw.decode("utf-8", errors="replace"), raw, cls.fake_logprob(token_id, prev))

    @classmethod
    def position_logprobs(cls, token_id: int, prev: int, k: int) -> PositionLogprobs:
        """``token_id`` after ``prev`` and the ``k`` most likely tokens there."""
        return PositionLogprobs(cls.token_logprob(token_id, prev),
                                tuple(cls.token_logprob((prev + 1 + i) % VOCAB, prev) for i in range(k)))

    def _num_cached(self, before: int, tokens: list[int]) -> int:
        """Tokens of ``tokens[before:]`` in whole cache blocks shared with a context seen before."""
        shared = 0
        for seen in self._cached:
            n = 0
            for a, b in zip(seen, tokens):
                if a != b:
                    break
                n += 1
            shared = max(shared, n)
        return max(0, shared // self.cache_block * self.cache_block - before)

    def _remember(self, tokens: list[int]) -> None:
        self._cached.append(tuple(tokens))
        del self._cached[:-64]

    # ---- contexts -----------------------------------------------------------------------------------------------
    def _context(self, context_id: str, parent_context_id: str | None) -> list[int]:
        if context_id in self.contexts:
            return self.contexts[context_id]
        if parent_context_id is not None:
            if parent_context_id not in self.contexts:
                raise UnknownContext(f"unknown parent context {parent_context_id!r}")
            self.contexts[context_id] = list(self.contexts[parent_context_id])
        else:
            self.contexts[context_id] = []
        return self.contexts[context_id]

    def context_text(self, context_id: str) -> str:
        return self.decode(self.contexts[context_id])

    async def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None, *,
                   prompt_logprobs: int | None = None, hint=None) -> FillResult:
        self.calls.append(("fill", context_id, parent_context_id, list(token_ids)))
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= 20:
            raise BadSamplingParams(f"prompt_logprobs must be in [0, 20], got {prompt_logprobs}",
                                    param="prompt_logprobs")
        await asyncio.sleep(0)
        if self.fill_gate is not None:
            await self.fill_gate.wait()
        if self.fail_fill_when is not None and self.fail_fill_when in context_id:
            raise EngineError(f"fake engine fill failure on context {context_id!r}")
        tokens = self._context(context_id, parent_context_id)
        if len(tokens) + len(token_ids) > self.max_model_len:
            raise ContextLengthExceeded(f"context {context_id!r} would hold {len(tokens) + len(token_ids)} tokens "
                                        f"(window {self.max_model_len})")
        before = len(tokens)
        tokens.extend(token_ids)
        cached = self._num_cached(before, tokens) if parent_context_id is None else 0
        self._remember(tokens)
        positions: tuple[PositionLogprobs | None, ...] = ()
        if prompt_logprobs is not None:
            positions = tuple(None if j == 0 else self.position_logprobs(tokens[j], tokens[j - 1], prompt_logprobs)
                              for j in range(before, len(tokens)))
        return FillResult(context_id, len(token_ids), len(tokens), num_cached=min(cached, len(token_ids)),
                          prompt_logprobs=positions)

    async def generate(self, sampling: SamplingParams, context_id: str,
                       parent_context_id: str | None = None, *, hint: OpHint | None = None) -> GenerateResult:
        started = time.monotonic()
        ids: list[int] = []
        logprobs: list[PositionLogprobs] = []
        text = ""
        finish = FinishReason.STOP
        first = 0.0
        prompt_len = 0
        async for chunk in self.generate_stream(sampling, context_id, parent_context_id, hint=hint):
            if not first:
                first = time.monotonic() - started
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            text += chunk.text
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
        prompt_len = len(self.contexts.get(context_id, ())) - len(ids)
        return GenerateResult(context_id, tuple(ids), text, finish, prompt_len, ttft_s=first,
                              latency_s=time.monotonic() - started, logprobs=tuple(logprobs))

    async def generate_stream(self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None,
                              *, hint: OpHint | None = None) -> AsyncIterator[GenerateChunk]:
        self.calls.append(("generate", context_id, parent_context_id, sampling))
        tokens = self._context(context_id, parent_context_id)
        self.generating += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)
            if context_id not in self.contexts:
                raise UnknownContext(f"context {context_id!r} was freed")
            context_text = self.decode(tokens)
            if self.fail_generate_when is not None and self.fail_generate_when in context_text:
                raise EngineError(f"fake engine failure on context {context_id!r}")
            answer = self.encode(self._answer(context_text, sampling))
            text = ""
            emitted = 0

            def lp(tok: int) -> tuple[PositionLogprobs, ...]:  # the logprobs of tok, appended after tokens[-1]
                if sampling.logprobs is None:
                    return ()
                return (self.position_logprobs(tok, tokens[-1] if tokens else BOS, sampling.logprobs),)

            for i in range(sampling.max_tokens):
                if context_id not in self.contexts:  # freed while generating: abort
                    yield GenerateChunk((), "", FinishReason.ABORT)
                    return
                if len(tokens) >= self.max_model_len:
                    yield GenerateChunk((), "", FinishReason.LENGTH)
                    return
                if i < len(answer):
                    tok = answer[i]
                elif sampling.ignore_eos:
                    tok = self.encode(".")[0]
                else:
                    yield GenerateChunk((EOS,), "", FinishReason.STOP, lp(EOS))
                    return
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                logprobs = lp(tok)
                tokens.append(tok)
                start = len(tokens) - i - 1  # first generated token
                text = self.decode_complete(tokens[start:])
                hit = next((s for s in sampling.stop if s in text), None)
                if hit is not None:
                    final = text[:text.index(hit)]
                    del tokens[start + len(self.encode(final)):]  # the stop string is not kept
                    yield GenerateChunk((tok,), final[emitted:], FinishReason.STOP, logprobs)
                    return
                # hold back text that could be the start of a stop string
                safe = len(text)
                for s in sampling.stop:
                    for k in range(min(len(s) - 1, len(text)), 0, -1):
                        if text.endswith(s[:k]):
                            safe = min(safe, len(text) - k)
                            break
                last = i + 1 == sampling.max_tokens
                upto = len(text) if last else safe
                yield GenerateChunk((tok,), text[emitted:upto], FinishReason.LENGTH if last else None, logprobs)
                emitted = upto
        finally:
            self.generating -= 1

    async def free_context(self, context_id: str) -> None:
        self.calls.append(("free", context_id, None))
        if context_id not in self.contexts:
            raise UnknownContext(f"unknown context {context_id!r}")
        self._remember(self.contexts.pop(context_id))
        self.freed.append(context_id)

    async def status(self) -> EngineStatus:
        used = sum(len(t) for t in self.contexts.values())
        return EngineStatus(name=self.name, model=self.model, max_model_len=self.max_model_len,
                            num_running=self.generating, num_waiting=0, running_tokens=used, waiting_tokens=0,
                            kv_blocks_total=1024, kv_blocks_used=used // 16, kv_blocks_shared=0,
                            kv_blocks_cached=0, block_size=16, num_contexts=len(self.contexts))

    # ---- test helpers ---------------------------------------------------------------------------------------------
    def calls_of(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]

    def forks(self) -> list[tuple]:
        """Fill calls that created a context as a child of another (``parent_context_id`` given)."""
        return [c for c in self.calls if c[0] in ("fill", "generate") and c[2] is not None]


class UnreachableEngine(FakeEngine):
    """A FakeEngine that can go down: once ``down`` is set, every call raises EngineUnavailable (as a refused
    connection would). Subclasses in the failover tests decide when it goes down."""

    def __init__(self, name: str, **kw) -> None:
        super().__init__(name, **kw)
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise EngineUnavailable(f"engine {self.name} unreachable (connection refused)")

    async def fill(self, token_ids, context_id, parent_context_id=None, *, prompt_logprobs=None, hint=None):
        self._check()
        return await super().fill(token_ids, context_id, parent_context_id, prompt_logprobs=prompt_logprobs,
                                  hint=hint)

    async def generate(self, sampling, context_id, parent_context_id=None, *, hint=None):
        self._check()
        return await super().generate(sampling, context_id, parent_context_id, hint=hint)

    async def generate_stream(self, sampling, context_id, parent_context_id=None, *, hint=None):
        self._check()
        async for chunk in super().generate_stream(sampling, context_id, parent_context_id, hint=hint):
            yield chunk

    async def tokenize(self, text):
        self._check()
        return await super().tokenize(text)

    async def status(self):
        self._check()
        return await super().status()

    async def free_context(self, context_id):
        self._check()
        return await super().free_context(context_id)
