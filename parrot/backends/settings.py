"""Settings of the external-engine adapter: one validated object fed by init kwargs and ``PARROT_BACKEND_*``."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class BackendSettings(BaseSettings):
    """How the adapter talks to an OpenAI-compatible server. Invalid values raise a ValidationError naming the
    field; unknown keyword arguments are rejected."""

    model_config = SettingsConfigDict(env_prefix="PARROT_BACKEND_", extra="forbid", frozen=True)

    connect_timeout_s: float = Field(5.0, gt=0, description="TCP connect timeout of every call")
    request_timeout_s: float = Field(600.0, gt=0, description="longest wait for one generation (read timeout)")
    connection_retries: int = Field(1, ge=0, le=5, description="calls that got no answer at all (connection refused "
                                    "or closed under them) are sent again this many times on a fresh connection")
    probe_timeout_s: float = Field(5.0, gt=0, description="timeout of health / status / detection probes")
    api_key: str | None = Field(None, min_length=1, description="sent as 'Authorization: Bearer' to the server")
    max_model_len: int | None = Field(None, ge=16, description="context window when the server does not report one")
    text_window_bytes_per_token: int = Field(
        4, ge=1, le=16, description="text-only servers: the adapter counts UTF-8 bytes, and allows this many per "
        "token of the server's window")
