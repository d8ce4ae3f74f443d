"""JSON shapes of the engine's HTTP protocol (shared by the engine server and its HTTP client)."""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel, ConfigDict, Field

from parrot.common.sampling import FinishReason
from parrot.engine.interface import EngineStatus, FillResult, GenerateChunk, GenerateResult, ModelInfo

_ID = Field(min_length=1, max_length=256)


class FillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_ids: list[int] = Field(max_length=1_000_000)
    context_id: str = _ID
    parent_context_id: str | None = Field(None, min_length=1, max_length=256)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sampling: dict = Field(default_factory=dict)
    context_id: str = _ID
    parent_context_id: str | None = Field(None, min_length=1, max_length=256)
    stream: bool = False


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
    d = dataclasses.asdict(obj)
    for k, v in d.items():
        if isinstance(v, tuple):
            d[k] = list(v)
        elif isinstance(v, FinishReason):
            d[k] = v.value
    return d


def fill_result(d: dict) -> FillResult:
    return FillResult(**d)


def generate_result(d: dict) -> GenerateResult:
    d = dict(d)
    d["token_ids"] = tuple(d["token_ids"])
    d["finish_reason"] = FinishReason(d["finish_reason"])
    return GenerateResult(**d)


def generate_chunk(d: dict) -> GenerateChunk:
    fr = d.get("finish_reason")
    return GenerateChunk(tuple(d["token_ids"]), d["text"], FinishReason(fr) if fr else None)


def engine_status(d: dict) -> EngineStatus:
    return EngineStatus(**d)


def model_info(d: dict) -> ModelInfo:
    d = dict(d)
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return ModelInfo(**d)
