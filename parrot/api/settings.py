"""Server settings: one validated object fed by init kwargs, environment (``PARROT_*``) and the CLI."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from parrot.manager.manager import ManagerConfig

MAX_HTTP_LONG_POLL_S = 60.0  # the longest wait of one GET over HTTP (docs/api.md)


class ServerSettings(ManagerConfig, BaseSettings):
    """Settings of the HTTP server: every :class:`ManagerConfig` field (its defaults, constraints and names)
    plus the HTTP-only ones below. Invalid values raise a ValidationError (a ValueError) naming the field;
    unknown keyword arguments are rejected."""

    model_config = SettingsConfigDict(env_prefix="PARROT_", extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, min_length=1, description="require 'Authorization: Bearer <key>' (one tenant, "
                                "'default'); with --api-keys-file, one more key")
    api_keys_file: str | None = Field(None, description="JSON file of tenants' API keys and limits, re-read when it "
                                      "changes (parrot.api.tenants)")
    api_keys_reload_s: float = Field(1.0, ge=0, description="look at the keys file at most this often")
    engine_secret: SecretStr | None = Field(
        None, min_length=16, description="engines send it (X-Parrot-Engine-Secret) to register and heartbeat; unset: "
        "engine registration is closed (parrot serve --engines makes one for its own children)")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_n: int = Field(16, ge=1, le=128, description="largest 'n' (choices) an OpenAI request may ask for")
    responses_ttl_s: float = Field(3600.0, gt=0, description="how long a stored /v1/responses answer can be continued "
                                   "(previous_response_id) or fetched")
    max_stored_responses: int = Field(1024, ge=1, description="stored /v1/responses answers kept (least recently "
                                      "used evicted first)")
    shutdown_grace_s: float = Field(10.0, ge=0, le=600, description="on SIGTERM: stop accepting, let requests in "
                                    "flight finish for at most this long, then cancel the rest and exit")
    engines: int = Field(0, ge=0, le=64, description="parrot serve: start this many `parrot engine` processes that "
                         "register here (0 = one engine inside the server process)")

    @field_validator("max_long_poll_s")
    @classmethod
    def _http_long_poll(cls, value: float) -> float:
        if value > MAX_HTTP_LONG_POLL_S:
            raise ValueError(f"must be <= {MAX_HTTP_LONG_POLL_S:g} s over HTTP, got {value!r}")
        return value

    def manager_config(self) -> ManagerConfig:
        """The manager's part of these settings."""
        return ManagerConfig(**self.model_dump(include=set(ManagerConfig.model_fields)))
