"""The universal engine abstraction (Parrot §7): Fill / Generate / FreeContext, plus status and tokenizer.

The manager talks to engines only through :class:`EngineClient`, so the builtin engine (in-process or over
HTTP), an OpenAI-compatible adapter and the simulated engine are interchangeable.

Contexts form a tree. ``fill(tokens, ctx, parent)`` creates ``ctx`` as a child of ``parent`` when ``ctx`` does
not exist yet (the child starts from the parent's KV, shared, not copied) and appends ``tokens`` to it;
filling an existing context appends. ``generate(sampling, ctx, parent)`` does the same for generated tokens:
the generated tokens become part of ``ctx``'s KV, so a later fill continues after them.

Tool calls (LAMPS): a generate may carry an :class:`OpHint` (predicted output length, an expected tool call);
``pause_context(ctx, tool)`` hands ``ctx`` to the engine while the tool runs instead of freeing it, and the engine
resumes it when a later context continues it (see :meth:`EngineClient.pause_context`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Mapping
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
    # on the final chunk: as GenerateResult.cached_prompt_tokens
    cached_prompt_tokens: int | None = None


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
    # prompt tokens the engine served from its prefix cache when this call prefilled them: an external server
    # (parrot.backends) prefills at generate time; None from engines whose fill reports it (FillResult.num_cached)
    cached_prompt_tokens: int | None = None


@dataclass(frozen=True)
class ToolHint:
    """A tool call expected after a generate (LAMPS §4.2): its name ("" when unknown) and predicted duration."""

    name: str
    expected_duration_s: float | None = None

    def to_wire(self) -> dict:
        return {"name": self.name, "expected_duration_s": self.expected_duration_s}

    @classmethod
    def from_wire(cls, d: Mapping) -> "ToolHint":
        dur = d.get("expected_duration_s")
        return cls(str(d.get("name") or ""), float(dur) if dur is not None else None)


@dataclass(frozen=True)
class OpHint:
    """Predictions the manager attaches to a generate (LAMPS 4.2); engines that cannot use them ignore them.

    ``later`` (optional): the hints of the request's segments after this one, in order, each with the tokens its
    tool call appends (``predicted_return_tokens``): what a request-level rank (``lamps-request``) scores the
    remaining calls by. Empty: only this segment is known (every field defaults, so older senders are unchanged).

    ``tpot_s`` (optional): the request's per-output-token target. While an op with a target runs, the engine keeps
    its iterations within the target by limiting the prompt tokens other ops (ops without a target: throughput
    work sharing the engine) add to them (:mod:`parrot.engine.scheduler.step_budget`); ops with a target are
    admitted first. Engines that cannot do this ignore it.

    ``elapsed_s`` (optional): how long the request this op belongs to has been running when the op was sent (on the
    sender's clock; no shared clock needed): a multi-call request's later segment arrives as a new context, and a
    request-level rank (``lamps-request``) ages it from the request's start, ``arrival - elapsed_s``.
    """

    predicted_output_tokens: int | None = None
    tool: ToolHint | None = None  # a tool call is expected right after this generate
    priority: int = 0  # the request's priority (vLLM's: lower is admitted earlier; ties by arrival)
    predicted_return_tokens: int | None = None  # tokens ``tool``'s result appends to the context
    later: tuple["OpHint", ...] = ()  # the request's later segments (their ``later`` empty)
    tpot_s: float | None = None  # per-output-token target (seconds); None: no target
    elapsed_s: float | None = None  # seconds the request had run when this op was sent; None: unknown

    def __post_init__(self) -> None:
        if self.tpot_s is not None and not (isinstance(self.tpot_s, (int, float)) and math.isfinite(self.tpot_s)
                                            and self.tpot_s > 0):
            raise ValueError(f"OpHint.tpot_s must be a finite number > 0 or None, got {self.tpot_s!r}")
        if self.elapsed_s is not None and not (isinstance(self.elapsed_s, (int, float))
                                               and math.isfinite(self.elapsed_s) and self.elapsed_s >= 0):
            raise ValueError(f"OpHint.elapsed_s must be a finite number >= 0 or None, got {self.elapsed_s!r}")

    def to_wire(self) -> dict:
        d = {"predicted_output_tokens": self.predicted_output_tokens,
             "tool": self.tool.to_wire() if self.tool is not None else None, "priority": self.priority}
        if self.predicted_return_tokens is not None:
            d["predicted_return_tokens"] = self.predicted_return_tokens
        if self.later:
            d["later"] = [h.to_wire() for h in self.later]
        if self.tpot_s is not None:
            d["tpot_s"] = self.tpot_s
        if self.elapsed_s is not None:
            d["elapsed_s"] = self.elapsed_s
        return d

    @classmethod
    def from_wire(cls, d: Mapping | None) -> "OpHint | None":
        if not d:
            return None
        out = d.get("predicted_output_tokens")
        tool = d.get("tool")
        ret = d.get("predicted_return_tokens")
        later = tuple(h for h in (cls.from_wire(x) for x in d.get("later") or ()) if h is not None)
        tpot, elapsed = d.get("tpot_s"), d.get("elapsed_s")
        return cls(int(out) if out is not None else None, ToolHint.from_wire(tool) if tool else None,
                   int(d.get("priority") or 0), int(ret) if ret is not None else None, later,
                   float(tpot) if tpot is not None else None, float(elapsed) if elapsed is not None else None)


@dataclass(frozen=True)
class PauseResult:
    """How an engine holds a context paused for a tool call (see :meth:`EngineClient.pause_context`)."""

    context_id: str
    handling: str  # Handling.value: "preserve" | "discard" | "swap"
    num_tokens: int  # context length at the pause
    num_blocks: int  # blocks kept (preserve) / freed (discard) / copied to the host store (swap)

    def to_wire(self) -> dict:
        return {"context_id": self.context_id, "handling": self.handling, "num_tokens": self.num_tokens,
                "num_blocks": self.num_blocks}

    @classmethod
    def from_wire(cls, d: Mapping) -> "PauseResult":
        return cls(str(d["context_id"]), str(d["handling"]), int(d["num_tokens"]), int(d["num_blocks"]))


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
                   prompt_logprobs: int | None = None, hint: OpHint | None = None) -> FillResult:
        """Append ``token_ids`` to ``context_id`` (created as a fork of ``parent_context_id`` if new).

        ``prompt_logprobs=k`` (0..MAX_LOGPROBS) also reports, per filled token, its logprob given everything
        before it and the ``k`` most likely tokens there (``FillResult.prompt_logprobs``); an engine that cannot
        raises BadSamplingParams naming ``prompt_logprobs``. ``hint``: the predictions of the generate this prompt
        is filled for (an engine ranking by LAMPS' memory over time admits the fill as that whole request
        segment); engines that cannot use it ignore it."""

    @abc.abstractmethod
    async def generate(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None, *,
        hint: OpHint | None = None,
    ) -> GenerateResult:
        """Decode from ``context_id`` until a stop condition; generated tokens are appended to the context.

        ``hint``: the manager's predictions (output length, an expected tool call); engines may ignore it."""

    @abc.abstractmethod
    def generate_stream(
        self, sampling: SamplingParams, context_id: str, parent_context_id: str | None = None, *,
        hint: OpHint | None = None,
    ) -> AsyncIterator[GenerateChunk]:
        """Like :meth:`generate`, yielding increments; the last chunk carries ``finish_reason``."""

    @abc.abstractmethod
    async def free_context(self, context_id: str) -> None:
        """Drop ``context_id``. Children keep their (shared) KV; freeing an unknown id raises UnknownContext."""

    async def pause_context(self, context_id: str, tool: ToolHint) -> PauseResult | None:
        """Hand ``context_id`` to the engine while ``tool`` runs (instead of :meth:`free_context`): the engine
        keeps, swaps or discards its KV and resumes it when a later context continues it (prefix match, fork
        or an op on it); the caller no longer owns the context. Unknown id -> UnknownContext. This default
        (engines without tool handling) frees the context and returns None."""
        await self.free_context(context_id)
        return None

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
    # how the engine computes (builtin engine: parrot.engine.runtime.numerics.NumericsPlan.to_dict(): CPU model and
    # family, CPU path, dtypes, matmul kernels); empty when the engine does not say
    numerics: dict = field(default_factory=dict, compare=False)
