"""An in-process EngineClient over an engine core: the builtin LLMEngine (``concurrent.futures`` futures settled
by its thread, wrapped for asyncio) or the simulator's SimEngine (asyncio futures on the running loop, which
``asyncio.wrap_future`` passes through)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from parrot.common.errors import ParrotError
from parrot.common.sampling import SamplingParams
from parrot.engine.runtime.core import EngineCore
from parrot.protocol.interface import (
    EngineClient,
    EngineStatus,
    FillResult,
    GenerateChunk,
    GenerateResult,
    ModelInfo,
    OpHint,
    PauseResult,
    ToolHint,
)


log = logging.getLogger(__name__)

# how often a stream hands the tokens decoded meanwhile to the event loop (see generate_stream): ~3-6 decode steps
# of a small model on a CPU, well under what a reader notices
STREAM_INTERVAL_S = 0.02


class LocalEngineClient(EngineClient):
    def __init__(self, engine: EngineCore, *, owns_engine: bool = True,
                 stream_interval_s: float = STREAM_INTERVAL_S) -> None:
        """``owns_engine``: :meth:`close` shuts the engine down (a thread join, off the event loop);
        ``stream_interval_s``: see :meth:`generate_stream`."""
        if stream_interval_s < 0:
            raise ValueError(f"stream_interval_s must be >= 0, got {stream_interval_s!r}")
        self.engine = engine
        self.stream_interval_s = stream_interval_s
        self.name = engine.name
        self._owns = owns_engine
        tok = engine.tokenizer
        self._info = ModelInfo(
            name=engine.model_name, max_model_len=engine.max_model_len, vocab_size=tok.vocab_size,
            bos_token_id=tok.bos_token_id, eos_token_ids=tuple(tok.eos_token_ids), chat_template=tok.chat_template,
            add_bos=bool(getattr(tok, "add_bos", False)), numerics=dict(engine.numerics),
        )

    async def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None, *,
                   prompt_logprobs: int | None = None, hint: OpHint | None = None) -> FillResult:
        return await asyncio.wrap_future(self.engine.fill(token_ids, context_id, parent_context_id,
                                                          prompt_logprobs=prompt_logprobs, hint=hint))

    async def generate(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None, *,
        hint: OpHint | None = None,
    ) -> GenerateResult:
        return await asyncio.wrap_future(self.engine.generate(sampling, context_id, parent_context_id, hint=hint))

    async def generate_stream(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None, *,
        hint: OpHint | None = None,
    ) -> AsyncIterator[GenerateChunk]:
        """Increments of one generation, handed over at most every ``stream_interval_s`` of the engine's clock
        (the first one and the last one at once): the chunks of the tokens decoded meanwhile arrive merged (their
        tokens, text and logprobs in order). One wake-up of the event loop per interval instead of per token is
        what keeps streaming every output (the executor does) nearly free, here and behind an engine server.

            engine thread: on_chunk -> buffer (locked); first / final / interval elapsed -> wake the loop
            event loop:    wake -> take the buffer -> one merged chunk -> the consumer
        """
        loop = asyncio.get_running_loop()
        lock = threading.Lock()
        buffer: list[GenerateChunk] = []
        wake = asyncio.Event()
        clock, interval = self.engine.clock, self.stream_interval_s
        last_wake: list[float | None] = [None]

        def on_chunk(chunk: GenerateChunk) -> None:  # the engine's thread (or the loop, for the simulator)
            now = clock()
            with lock:
                buffer.append(chunk)
            due = last_wake[0] is None or chunk.finish_reason is not None or now - last_wake[0] >= interval
            if due:
                last_wake[0] = now
                loop.call_soon_threadsafe(wake.set)

        def take() -> list[GenerateChunk]:
            with lock:
                out = buffer[:]
                buffer.clear()
            return out

        fut = asyncio.wrap_future(self.engine.generate(sampling, context_id, parent_context_id, on_chunk=on_chunk,
                                                       hint=hint))
        fut.add_done_callback(lambda _: wake.set())  # the op is over: no chunk joins the buffer after this
        finished = False
        try:
            while True:
                if not fut.done():
                    await wake.wait()
                    wake.clear()
                chunks = take()
                if chunks:
                    chunk = merge_chunks(chunks)
                    yield chunk
                    if chunk.finish_reason is not None:
                        finished = True
                        break
                    continue
                if not fut.done():
                    continue
                res = fut.result()  # raises the typed error of a failed generate
                finished = True  # aborted (context freed) without a final token
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

    async def pause_context(self, context_id: str, tool: ToolHint) -> PauseResult | None:
        return await asyncio.wrap_future(self.engine.pause_context(context_id, tool))

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


def merge_chunks(chunks: list[GenerateChunk]) -> GenerateChunk:
    """Consecutive chunks of one generation as one (tokens, text and logprobs concatenated in order)."""
    if len(chunks) == 1:
        return chunks[0]
    return GenerateChunk(tuple(t for c in chunks for t in c.token_ids), "".join(c.text for c in chunks),
                         chunks[-1].finish_reason, tuple(lp for c in chunks for lp in c.logprobs))
