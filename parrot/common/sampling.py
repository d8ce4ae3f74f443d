"""One definition of the sampling parameters, shared by the engine, the manager and the APIs."""

from __future__ import annotations

import dataclasses
from enum import Enum
from dataclasses import dataclass

from parrot.common.constraints import Constraint
from parrot.common.errors import BadSamplingParams


MAX_LOGPROBS = 20  # most alternatives per position a request may ask for (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # |bias| limit of one logit_bias entry (OpenAI's)
MAX_LOGIT_BIAS_TOKENS = 1024  # tokens one logit_bias may name
MAX_BAD_WORDS = 256  # token sequences one request may ban


@dataclass(frozen=True)
class TokenLogprob:
    """One token with its log probability: ``token`` is its own text (``token_bytes`` decoded, errors replaced:
    a token holding part of a UTF-8 character shows U+FFFD there), ``token_bytes`` its raw bytes."""

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True)
class PositionLogprobs:
    """Logprobs at one position: the token that is there (chosen by the sampler, or the prompt's) and the ``k``
    most likely tokens at that position, most likely first (``k`` = the request's ``logprobs``)."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How one Generate call samples and when it stops.

    ``temperature == 0`` means greedy. ``max_tokens`` counts generated tokens. Stop strings are matched on
    the detokenized text and are not included in the returned text; stop token ids (and EOS unless
    ``ignore_eos``) end generation without being returned in the text (the token id is still reported).
    ``seed`` makes a sampled generation reproducible regardless of batching.

    Logit shaping, in the sampler's order: ``logit_bias`` ((token id, bias) pairs, OpenAI's: added to those
    logits), ``bad_words_ids`` (vLLM's ``bad_words`` as token sequences: a sequence's last token is banned where
    the output so far ends with the rest of it; a one-token sequence is banned everywhere), penalties, then for
    sampled rows temperature, ``min_p`` (vLLM's: tokens less likely than ``min_p`` x the most likely one are
    dropped; 1.0 keeps only the most likely), top-k and top-p. ``skip_special_tokens`` leaves special tokens
    (e.g. ``<|im_start|>``) out of the text (their ids are still reported); by default they are kept.
    """

    max_tokens: int = 128
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output (CTRL-style)
    presence_penalty: float = 0.0  # OpenAI-style, subtracted once per token present in the output
    frequency_penalty: float = 0.0  # OpenAI-style, subtracted per occurrence in the output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    include_stop_str_in_output: bool = False
    # report per generated token its logprob and the ``logprobs`` most likely alternatives (0 = the chosen token's
    # only; None = off), from the logits the sampler used after penalties, before temperature / top-k / top-p
    logprobs: int | None = None
    # what the output must be (a JSON schema, a regex, one of some choices, a grammar): the engine masks every
    # token the constraint cannot continue with, and ends the generation when the constraint is complete
    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by token id; a dict is accepted
    min_p: float = 0.0  # 0 = disabled
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    skip_special_tokens: bool = False

    def __post_init__(self) -> None:
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            object.__setattr__(self, "constraint", Constraint.from_dict(self.constraint))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "bad_words_ids", _id_sequences(self.bad_words_ids))
        # normalise list inputs to tuples so the object stays hashable / immutable
        if not isinstance(self.stop, tuple):
            if not isinstance(self.stop, (str, list)):
                raise BadSamplingParams(f"stop must be a string or a list of strings, got {self.stop!r}", param="stop")
            object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            if not isinstance(self.stop_token_ids, list):
                raise BadSamplingParams(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                                        param="stop_token_ids")
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> BadSamplingParams:
            return BadSamplingParams(f"{name} {why}", param=name)

        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(name, f"must be a number, got {v!r}")
        for name in ("max_tokens", "min_tokens", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, f"must be an integer, got {v!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {v!r}")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be at most 16 non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise bad("logit_bias", f"may name at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                                        f"{MAX_LOGIT_BIAS:g}], got {bias!r}")
        if len(self.bad_words_ids) > MAX_BAD_WORDS:
            raise bad("bad_words", f"at most {MAX_BAD_WORDS} token sequences, got {len(self.bad_words_ids)}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether the sampler changes this row's logits before choosing (bias, bad words, penalties); the
        min_tokens ban depends on the output's length and is checked apart."""
        return bool(self.logit_bias or self.bad_words_ids) or self.needs_penalties

    def max_token_id(self) -> int | None:
        """The largest token id the parameters name (to check against a vocabulary), None when they name none."""
        ids = [t for t, _ in self.logit_bias] + [t for seq in self.bad_words_ids for t in seq]
        return max(ids, default=None)

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["constraint"] = self.constraint.to_dict() if self.constraint is not None else None
        d["logit_bias"] = [list(p) for p in self.logit_bias]
        d["bad_words_ids"] = [list(seq) for seq in self.bad_words_ids]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise BadSamplingParams(f"unknown sampling field(s): {sorted(unknown)}", param=sorted(unknown)[0])
        try:
            return cls(**d)
        except TypeError as e:  # wrong types reach here only through bad keyword shapes
            raise BadSamplingParams(str(e)) from None


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs sorted by id: from a dict {id: bias} (ids may be digit strings, as
    JSON keys are) or pairs. Raises BadSamplingParams naming ``logit_bias`` for anything else."""
    items = value.items() if isinstance(value, dict) else value
    out: dict[int, float] = {}
    try:
        for token, bias in items:  # type: ignore[union-attr]
            if isinstance(token, bool) or isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ValueError
            tid = int(token) if isinstance(token, str) and token.strip().isdigit() else token
            if not isinstance(tid, int) or tid < 0:
                raise ValueError
            out[tid] = float(bias)
    except (TypeError, ValueError):
        raise BadSamplingParams(f"logit_bias must map token ids (integers >= 0) to numbers, got {value!r}",
                                param="logit_bias") from None
    return tuple(sorted(out.items()))


def _id_sequences(value: object) -> tuple[tuple[int, ...], ...]:
    """``bad_words_ids`` as a tuple of non-empty tuples of token ids; raises BadSamplingParams naming
    ``bad_words`` otherwise."""
    if isinstance(value, (list, tuple)) and all(
            isinstance(seq, (list, tuple)) and seq and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in seq) for seq in value):
        return tuple(tuple(seq) for seq in value)
    raise BadSamplingParams(f"bad_words must be non-empty sequences of token ids, got {value!r}", param="bad_words")


class FinishReason(str, Enum):
    """Why a generation ended (OpenAI vocabulary)."""

    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context window
    ABORT = "abort"  # cancelled (client went away, context freed)


