"""JSON shapes of the engine's HTTP protocol (shared by the engine server and its HTTP client).

Results are their dataclasses as JSON objects (tuples as lists, enums as values). Logprobs keep their shape:
``{"chosen": {"token_id", "token", "token_bytes", "logprob"}, "top": [...]}`` per position (``null`` for a context's
first token in ``prompt_logprobs``), with ``token_bytes`` a list of byte values (JSON has no bytes).
"""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel, ConfigDict, Field

from enum import Enum

from parrot.common.sampling import FinishReason, PositionLogprobs, TokenLogprob
from parrot.protocol.interface import EngineStatus, FillResult, GenerateChunk, GenerateResult, ModelInfo

# the header an engine proves itself with to the manager (registration, heartbeats): the manager's engine secret
ENGINE_SECRET_HEADER = "X-Parrot-Engine-Secret"

_ID = Field(min_length=1, max_length=256)


class FillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_ids: list[int] = Field(max_length=1_000_000)
    context_id: str = _ID
    parent_context_id: str | None = Field(None, min_length=1, max_length=256)
    prompt_logprobs: int | None = None  # validated by the engine (BadSamplingParams naming the field)
    # names this fill and its retries: the engine applies it once and answers a repeat with the first result
    # (parrot.engine.server.op_memo); None = not retried (applied as sent)
    op_id: str | None = Field(None, min_length=8, max_length=64)
    hint: dict | None = None  # OpHint.to_wire() of the generate this fill's prompt is for


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sampling: dict = Field(default_factory=dict)
    context_id: str = _ID
    parent_context_id: str | None = Field(None, min_length=1, max_length=256)
    stream: bool = False
    hint: dict | None = None  # OpHint.to_wire(): the manager's predictions (output length, an expected tool call)


class ToolWire(BaseModel):
    """ToolHint.to_wire()."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field("", max_length=256)
    expected_duration_s: float | None = Field(None, ge=0)


class PauseRequest(BaseModel):
    """Hand a context to the engine while a tool runs (EngineClient.pause_context)."""

    model_config = ConfigDict(extra="forbid")
    context_id: str = _ID
    tool: ToolWire = Field(default_factory=ToolWire)


class FreeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    context_id: str = _ID


class TokenCapRequest(BaseModel):
    """The global scheduler's placement hint (EngineClient.set_token_cap)."""

    model_config = ConfigDict(extra="forbid")
    max_running_tokens: int | None = Field(None, ge=1)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(max_length=4_000_000)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_ids: list[int] = Field(max_length=1_000_000)


def to_json(obj) -> dict:
    return _plain(dataclasses.asdict(obj))


def _plain(v):
    """asdict's output as JSON values: tuples -> lists, bytes -> lists of ints, enums -> their values."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, bytes):
        return list(v)
    if isinstance(v, Enum):
        return v.value
    return v


def _token_logprob(d: dict) -> TokenLogprob:
    return TokenLogprob(d["token_id"], d["token"], bytes(d["token_bytes"]), d["logprob"])


def position_logprobs(d: dict | None) -> PositionLogprobs | None:
    if d is None:
        return None
    return PositionLogprobs(_token_logprob(d["chosen"]), tuple(_token_logprob(t) for t in d["top"]))


def fill_result(d: dict) -> FillResult:
    d = dict(d)
    d["prompt_logprobs"] = tuple(position_logprobs(p) for p in d.get("prompt_logprobs") or ())
    return FillResult(**d)


def generate_result(d: dict) -> GenerateResult:
    d = dict(d)
    d["token_ids"] = tuple(d["token_ids"])
    d["finish_reason"] = FinishReason(d["finish_reason"])
    d["logprobs"] = tuple(position_logprobs(p) for p in d.get("logprobs") or ())
    return GenerateResult(**d)


def generate_chunk(d: dict) -> GenerateChunk:
    fr = d.get("finish_reason")
    return GenerateChunk(tuple(d["token_ids"]), d["text"], FinishReason(fr) if fr else None,
                         tuple(position_logprobs(p) for p in d.get("logprobs") or ()), d.get("cached_prompt_tokens"))


def engine_status(d: dict) -> EngineStatus:
    return EngineStatus(**d)


def model_info(d: dict) -> ModelInfo:
    d = dict(d)
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return ModelInfo(**d)
