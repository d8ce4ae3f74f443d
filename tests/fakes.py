"""TEST DOUBLE ONLY: a small deterministic in-memory :class:`EngineClient` for manager and API unit tests.

It is not an engine (no model, no KV cache): it implements the EngineClient contract over byte-level
"tokens" so the manager and the HTTP layer can be tested fast and exactly. Conformance against the real
builtin engine is covered by the engine's own tests.

Tokenizer: one token per UTF-8 byte, id = byte + 3 (0 = pad, 1 = BOS, 2 = EOS); vocab 259.
"Model": the reply to a context is :meth:`FakeEngine.reply_for` of the context text, followed by
``"\\nrest of the answer"`` (so a stop at ``"\\n"`` ends it at the reply), then EOS. Sampled generations
(temperature > 0) append ``#<seed>`` (or ``#<n>``, a per-engine counter, without a seed).
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

from parrot.common.errors import ContextLengthExceeded, EngineError, EngineUnavailable, UnknownContext
from parrot.common.sampling import FinishReason, SamplingParams
from parrot.engine.interface import (
    EngineClient,
    EngineStatus,
    FillResult,
    GenerateChunk,
    GenerateResult,
    ModelInfo,
)

BOS, EOS, OFFSET = 1, 2, 3
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

    async def tokenize(self, text: str) -> list[int]:
        self.tokenized.append(text)
        return self.encode(text)

    async def detokenize(self, token_ids: list[int]) -> str:
        return self.decode(token_ids)

    async def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.model, max_model_len=self.max_model_len, vocab_size=256 + OFFSET,
                         bos_token_id=BOS, eos_token_ids=(EOS,), chat_template=self.chat_template,
                         add_bos=self.add_bos)

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

    async def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None) -> FillResult:
        self.calls.append(("fill", context_id, parent_context_id, list(token_ids)))
        await asyncio.sleep(0)
        if self.fill_gate is not None:
            await self.fill_gate.wait()
        if self.fail_fill_when is not None and self.fail_fill_when in context_id:
            raise EngineError(f"fake engine fill failure on context {context_id!r}")
        tokens = self._context(context_id, parent_context_id)
        if len(tokens) + len(token_ids) > self.max_model_len:
            raise ContextLengthExceeded(f"context {context_id!r} would hold {len(tokens) + len(token_ids)} tokens "
                                        f"(window {self.max_model_len})")
        tokens.extend(token_ids)
        return FillResult(context_id, len(token_ids), len(tokens))

    async def generate(self, sampling: SamplingParams, context_id: str,
                       parent_context_id: str | None = None) -> GenerateResult:
        started = time.monotonic()
        ids: list[int] = []
        text = ""
        finish = FinishReason.STOP
        first = 0.0
        prompt_len = 0
        async for chunk in self.generate_stream(sampling, context_id, parent_context_id):
            if not first:
                first = time.monotonic() - started
            ids.extend(chunk.token_ids)
            text += chunk.text
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
        prompt_len = len(self.contexts.get(context_id, ())) - len(ids)
        return GenerateResult(context_id, tuple(ids), text, finish, prompt_len, ttft_s=first,
                              latency_s=time.monotonic() - started)

    async def generate_stream(self, sampling: SamplingParams, context_id: str,
                              parent_context_id: str | None = None) -> AsyncIterator[GenerateChunk]:
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
                    yield GenerateChunk((EOS,), "", FinishReason.STOP)
                    return
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                tokens.append(tok)
                start = len(tokens) - i - 1  # first generated token
                text = self.decode(tokens[start:])
                hit = next((s for s in sampling.stop if s in text), None)
                if hit is not None:
                    final = text[:text.index(hit)]
                    del tokens[start + len(self.encode(final)):]  # the stop string is not kept
                    yield GenerateChunk((tok,), final[emitted:], FinishReason.STOP)
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
                yield GenerateChunk((tok,), text[emitted:upto], FinishReason.LENGTH if last else None)
                emitted = upto
        finally:
            self.generating -= 1

    async def free_context(self, context_id: str) -> None:
        self.calls.append(("free", context_id, None))
        if context_id not in self.contexts:
            raise UnknownContext(f"unknown context {context_id!r}")
        del self.contexts[context_id]
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

    async def fill(self, token_ids, context_id, parent_context_id=None):
        self._check()
        return await super().fill(token_ids, context_id, parent_context_id)

    async def generate(self, sampling, context_id, parent_context_id=None):
        self._check()
        return await super().generate(sampling, context_id, parent_context_id)

    async def generate_stream(self, sampling, context_id, parent_context_id=None):
        self._check()
        async for chunk in super().generate_stream(sampling, context_id, parent_context_id):
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
