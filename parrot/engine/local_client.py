"""An in-process EngineClient over an engine core: the builtin LLMEngine (``concurrent.futures`` futures settled
by its thread, wrapped for asyncio) or the simulator's SimEngine (asyncio futures on the running loop, which
``asyncio.wrap_future`` passes through)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from parrot.common.errors import ParrotError
from parrot.common.sampling import SamplingParams
from parrot.engine.core import EngineCore
from parrot.engine.interface import (
    EngineClient,
    EngineStatus,
    FillResult,
    GenerateChunk,
    GenerateResult,
    ModelInfo,
)


log = logging.getLogger(__name__)


class LocalEngineClient(EngineClient):
    def __init__(self, engine: EngineCore, *, owns_engine: bool = True) -> None:
        """``owns_engine``: :meth:`close` shuts the engine down (a thread join, off the event loop)."""
        self.engine = engine
        self.name = engine.name
        self._owns = owns_engine
        tok = engine.tokenizer
        self._info = ModelInfo(
            name=engine.model_name, max_model_len=engine.max_model_len, vocab_size=tok.vocab_size,
            bos_token_id=tok.bos_token_id, eos_token_ids=tuple(tok.eos_token_ids), chat_template=tok.chat_template,
            add_bos=bool(getattr(tok, "add_bos", False)), numerics=dict(engine.numerics),
        )

    async def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None, *,
                   prompt_logprobs: int | None = None) -> FillResult:
        return await asyncio.wrap_future(self.engine.fill(token_ids, context_id, parent_context_id,
                                                          prompt_logprobs=prompt_logprobs))

    async def generate(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None
    ) -> GenerateResult:
        return await asyncio.wrap_future(self.engine.generate(sampling, context_id, parent_context_id))

    async def generate_stream(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None
    ) -> AsyncIterator[GenerateChunk]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[GenerateChunk] = asyncio.Queue()

        def on_chunk(chunk: GenerateChunk) -> None:
            loop.call_soon_threadsafe(q.put_nowait, chunk)

        fut = asyncio.wrap_future(self.engine.generate(sampling, context_id, parent_context_id, on_chunk=on_chunk))
        finished = False
        try:
            while True:
                getter = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait({getter, fut}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    chunk = getter.result()
                    yield chunk
                    if chunk.finish_reason is not None:
                        finished = True
                        break
                    continue
                getter.cancel()
                res = fut.result()  # raises the typed error of a failed generate
                while not q.empty():
                    chunk = q.get_nowait()
                    yield chunk
                    if chunk.finish_reason is not None:
                        finished = True
                if not finished:  # aborted (context freed) without a final token
                    finished = True
                    yield GenerateChunk((), "", res.finish_reason)
                break
        finally:
            if not finished and not fut.done():
                # the consumer went away mid-stream: stop decoding by freeing the context
                try:
                    await asyncio.wrap_future(self.engine.free_context(context_id))
                except ParrotError as e:  # already freed by its owner: nothing left to stop
                    log.debug("free after abandoned stream of %s: %s", context_id, e)

    async def free_context(self, context_id: str) -> None:
        await asyncio.wrap_future(self.engine.free_context(context_id))

    async def status(self) -> EngineStatus:
        return self.engine.status()

    async def set_token_cap(self, max_running_tokens: int | None) -> bool:
        await asyncio.wrap_future(self.engine.set_token_cap(max_running_tokens))
        return True

    async def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    async def detokenize(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(self.engine.check_tokens(token_ids))  # ids outside the vocabulary: 400

    async def model_info(self) -> ModelInfo:
        return self._info

    async def close(self) -> None:
        if self._owns:
            await asyncio.to_thread(self.engine.shutdown)
