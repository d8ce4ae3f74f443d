"""The universal engine abstraction (Parrot §7): Fill / Generate / FreeContext, plus status and tokenizer.

The manager talks to engines only through :class:`EngineClient`, so the builtin engine (in-process or over
HTTP), an OpenAI-compatible adapter and the simulated engine are interchangeable.

Contexts form a tree. ``fill(tokens, ctx, parent)`` creates ``ctx`` as a child of ``parent`` when ``ctx`` does
not exist yet (the child starts from the parent's KV, shared, not copied) and appends ``tokens`` to it;
filling an existing context appends. ``generate(sampling, ctx, parent)`` does the same for generated tokens:
the generated tokens become part of ``ctx``'s KV, so a later fill continues after them.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from parrot.common.sampling import FinishReason, PositionLogprobs, SamplingParams


@dataclass(frozen=True)
class FillResult:
    context_id: str
    num_filled: int  # tokens appended by this call
    context_len: int  # total tokens in the context (inherited prefix included)
    num_cached: int = 0  # of the filled tokens, how many were served from the prefix cache
    # with ``prompt_logprobs=k``: one entry per filled token (None for the first token of a context: nothing
    # predicts it); empty otherwise
    prompt_logprobs: tuple[PositionLogprobs | None, ...] = ()


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed increment. ``text`` is the newly decodable text (may be empty mid-codepoint)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[PositionLogprobs, ...] = ()  # one per token of token_ids when sampling.logprobs is set


@dataclass(frozen=True)
class GenerateResult:
    context_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    prompt_len: int  # context length before generation
    ttft_s: float = 0.0  # queueing + first token latency inside the engine
    latency_s: float = 0.0
    logprobs: tuple[PositionLogprobs, ...] = ()  # one per token of token_ids when sampling.logprobs is set
    # with sampling.constraint: whether the output is complete under it (False: cut by max_tokens, a stop string
    # or the window, so it would not parse); None without a constraint
    constraint_complete: bool | None = None


@dataclass(frozen=True)
class EngineStatus:
    """A load snapshot, reported in heartbeats and the /status endpoint."""

    name: str
    model: str
    max_model_len: int
    num_running: int
    num_waiting: int
    running_tokens: int
    waiting_tokens: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_shared: int
    kv_blocks_cached: int
    block_size: int
    num_contexts: int
    num_preempted_total: int = 0
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine advertises about itself for placement, in ``EngineStatus.extra["capabilities"]``.

    ``shared_prefix_attention``: decode reads a prefix shared by forked contexts once per step (paper §7), so the
    global scheduler may count such a prefix once toward the engine's running tokens; ``fork``: contexts can be
    created as children of others (Fill/Generate with a parent); ``prefix_cache``: unreferenced KV blocks are
    kept and matched by content; ``kv_tokens``: tokens the KV pool holds. An engine that advertises nothing
    (an external adapter, an older engine) gets :meth:`from_status`'s None: assume none of them."""

    shared_prefix_attention: bool = False
    fork: bool = False
    prefix_cache: bool = False
    kv_tokens: int | None = None

    def to_wire(self) -> dict:
        return {"shared_prefix_attention": self.shared_prefix_attention, "fork": self.fork,
                "prefix_cache": self.prefix_cache, "kv_tokens": self.kv_tokens}

    @classmethod
    def from_status(cls, status: "EngineStatus | None") -> "EngineCapabilities | None":
        raw = status.extra.get("capabilities") if status is not None else None
        if not isinstance(raw, dict):
            return None
        kv = raw.get("kv_tokens")
        return cls(bool(raw.get("shared_prefix_attention")), bool(raw.get("fork")), bool(raw.get("prefix_cache")),
                   int(kv) if isinstance(kv, int) else None)


class EngineClient(abc.ABC):
    """What the manager needs from an engine. All methods are safe to call concurrently.

    Errors: unknown context -> ``UnknownContext``; prompt beyond the model window ->
    ``ContextLengthExceeded``; bad sampling -> ``BadSamplingParams``; transport / engine failure ->
    ``EngineError`` (``EngineUnavailable`` when the engine cannot be reached).
    """

    name: str

    @abc.abstractmethod
    async def fill(self, token_ids: list[int], context_id: str, parent_context_id: str | None = None, *,
                   prompt_logprobs: int | None = None) -> FillResult:
        """Append ``token_ids`` to ``context_id`` (created as a fork of ``parent_context_id`` if new).

        ``prompt_logprobs=k`` (0..MAX_LOGPROBS) also reports, per filled token, its logprob given everything
        before it and the ``k`` most likely tokens there (``FillResult.prompt_logprobs``); an engine that cannot
        raises BadSamplingParams naming ``prompt_logprobs``."""

    @abc.abstractmethod
    async def generate(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None
    ) -> GenerateResult:
        """Decode from ``context_id`` until a stop condition; generated tokens are appended to the context."""

    @abc.abstractmethod
    def generate_stream(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None
    ) -> AsyncIterator[GenerateChunk]:
        """Like :meth:`generate`, yielding increments; the last chunk carries ``finish_reason``."""

    @abc.abstractmethod
    async def free_context(self, context_id: str) -> None:
        """Drop ``context_id``. Children keep their (shared) KV; freeing an unknown id raises UnknownContext."""

    @abc.abstractmethod
    async def status(self) -> EngineStatus:
        """Current load snapshot."""

    @abc.abstractmethod
    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` with this engine's tokenizer (no BOS added)."""

    @abc.abstractmethod
    async def detokenize(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``."""

    @abc.abstractmethod
    async def model_info(self) -> "ModelInfo":
        """Model name, context window, special tokens and chat template."""

    async def close(self) -> None:
        """Release client resources (HTTP connections). Engines with none need not override."""
        return None

    async def set_token_cap(self, max_running_tokens: int | None) -> bool:
        """Placement hint from the global scheduler (paper §5.4): admit no new op while the running ops'
        contexts hold ``max_running_tokens`` tokens or more (None = no cap beyond the engine's own budgets; an
        op is always admitted when nothing runs). Returns True if the engine applies caps; this default
        answers False ("not supported"), and the manager then stops sending them."""
        return False


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    add_bos: bool = False
    # how the engine computes (builtin engine: parrot.engine.numerics.NumericsPlan.to_dict(): CPU model and family,
    # CPU path, dtypes, matmul kernels); empty when the engine does not say
    numerics: dict = field(default_factory=dict, compare=False)
