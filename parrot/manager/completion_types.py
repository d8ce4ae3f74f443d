"""The plain data of the completion service (:mod:`parrot.manager.completions`): what comes in (specs the API
layer builds from OpenAI requests), the validated plan, and what goes out (typed results and stream events the
API layer shapes into OpenAI JSON). No behaviour beyond small derived properties.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from parrot.common.sampling import FinishReason, PositionLogprobs, SamplingParams
from parrot.manager.tool_calls import ToolPlan


# ---- what comes in ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceSpec:
    """How many choices each prompt gets and how they sample."""

    n: int = 1
    max_tokens: int | None = None  # per choice; None: up to the model's context window; 0 only with echo
    # SamplingParams fields except max_tokens (bad_words_ids: made from bad_words when planned); validated when
    # planned (BadSamplingParams)
    sampling: Mapping[str, Any] = field(default_factory=dict)
    bad_words: tuple[str, ...] = ()  # vLLM's bad_words: tokenized when planned into sampling's bad_words_ids


@dataclass(frozen=True)
class RequestOptions:
    """What a request asks beyond sampling (vLLM's extras): its id (the response's), its priority (lower first, at
    the dispatcher and in the engines), its prompt cut to the last ``truncate_prompt_tokens`` tokens, and
    ``prompt_logprobs`` (each prompt token's logprob and this many alternatives)."""

    request_id: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None  # -1: up to the model's window
    prompt_logprobs: int | None = None
    # how the API layer shapes the answer: logprobs tokens as "token_id:N"; usage on every streamed chunk
    return_tokens_as_token_ids: bool = False
    continuous_usage_stats: bool = False


@dataclass(frozen=True)
class CompletionSpec:
    model: str
    prompts: Sequence[str | Sequence[int]]  # each a text or token ids
    choices: ChoiceSpec = field(default_factory=ChoiceSpec)
    echo: bool = False  # each choice's text (and logprobs) starts with its prompt
    options: RequestOptions = field(default_factory=RequestOptions)


@dataclass(frozen=True)
class ChatSpec:
    model: str
    # {"role", "content"[, "name", "tool_calls", "tool_call_id"]}, as chat templates take them
    messages: Sequence[Mapping[str, Any]]
    choices: ChoiceSpec = field(default_factory=ChoiceSpec)
    tools: ToolPlan | None = None  # shown to the model (rendering); its constraint is in choices.sampling
    options: RequestOptions = field(default_factory=RequestOptions)
    # the chat template's controls (vLLM's): extra template variables, whether the prompt ends with the
    # assistant's opening, or instead continues the last (assistant) message, left open
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass(frozen=True)
class PromptJob:
    index: int  # position of the prompt in the request
    token_ids: list[int]
    samplings: tuple[SamplingParams, ...]  # one per choice
    echo_text: str | None = None  # echo: the prompt as text, put before each choice's output


@dataclass(frozen=True)
class CompletionPlan:
    chat: bool
    id: str
    created: int
    model: str
    n: int
    jobs: list[PromptJob]
    # False for echo with max_tokens 0: fill only (samplings are validated with max_tokens 1, never run)
    generate: bool = True
    tools: ToolPlan | None = None  # chat with tools: how each choice's text is read as tool calls
    # the client's request id makes ``id`` (vLLM: "cmpl-<request_id>"), which then need not be unique:
    # ``run_id`` names this run's engine contexts and dispatch requests
    run_id: str = ""
    options: RequestOptions = field(default_factory=RequestOptions)

    @property
    def key(self) -> str:
        """Unique per run: the prefix of its engine contexts and dispatch request ids."""
        return self.run_id or self.id

    @property
    def prompt_tokens(self) -> int:
        return sum(len(j.token_ids) for j in self.jobs)

    @property
    def num_choices(self) -> int:
        return len(self.jobs) * self.n

    @property
    def logprobs(self) -> int | None:
        """Alternatives per position (0..MAX_LOGPROBS), or None when the request asked for no logprobs."""
        return self.jobs[0].samplings[0].logprobs

    @property
    def echo(self) -> bool:
        return self.jobs[0].echo_text is not None


# ---- what goes out ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UnscoredToken:
    """An echoed prompt's first token: nothing before it predicts it, so it has a text and no logprob."""

    token_id: int
    token: str


Position = PositionLogprobs | UnscoredToken  # one entry of a choice's logprobs (layout: module docstring)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the engines served from their prefix cache


@dataclass(frozen=True)
class ChoiceResult:
    text: str  # the echoed prompt (echo) + the generated text
    finish_reason: FinishReason
    token_ids: tuple[int, ...]  # generated tokens
    logprobs: tuple[Position, ...] | None = None  # None: not asked


@dataclass(frozen=True)
class CompletionResult:
    choices: list[ChoiceResult]  # by choice index
    usage: Usage
    # plan.prompt_logprobs: per prompt (job index), one entry per prompt token (the first is None: nothing
    # predicts it); None when not asked
    prompt_logprobs: list[tuple[PositionLogprobs | None, ...]] | None = None


@dataclass(frozen=True)
class ChoiceDelta:
    """New text of one choice (an echoed prompt comes first, whole); the choice's last delta carries its finish
    reason. ``logprobs``: the positions this delta adds (empty when none, or when logprobs were not asked)."""

    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: tuple[Position, ...] = ()
    completion_tokens: int = 0  # tokens the whole request (every choice) has generated so far, this delta's too


@dataclass(frozen=True)
class Tokenized:
    token_ids: list[int]
    max_model_len: int


@dataclass(frozen=True)
class TokenizerInfo:
    model: str
    bos_token: str | None  # texts of the special tokens (None: the model has none)
    eos_token: str | None
    chat_template: str | None
    max_model_len: int
    add_bos: bool
