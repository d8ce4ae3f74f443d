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
    # SamplingParams fields except max_tokens; validated when planned (BadSamplingParams)
    sampling: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CompletionSpec:
    model: str
    prompts: Sequence[str | Sequence[int]]  # each a text or token ids
    choices: ChoiceSpec = field(default_factory=ChoiceSpec)
    echo: bool = False  # each choice's text (and logprobs) starts with its prompt


@dataclass(frozen=True)
class ChatSpec:
    model: str
    # {"role", "content"[, "name", "tool_calls", "tool_call_id"]}, as chat templates take them
    messages: Sequence[Mapping[str, Any]]
    choices: ChoiceSpec = field(default_factory=ChoiceSpec)
    tools: ToolPlan | None = None  # shown to the model (rendering); its constraint is in choices.sampling


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


@dataclass(frozen=True)
class ChoiceDelta:
    """New text of one choice (an echoed prompt comes first, whole); the choice's last delta carries its finish
    reason. ``logprobs``: the positions this delta adds (empty when none, or when logprobs were not asked)."""

    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: tuple[Position, ...] = ()


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
