"""Server settings: one validated object fed by init kwargs, environment (``PARROT_*``) and the CLI."""

from __future__ import annotations

import ipaddress

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from parrot.engine.clients.http_client import CallPolicy
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
    # per-key defaults (parrot.api.limits); a key's own value in the keys file wins
    max_pending_per_key: int = Field(4096, ge=1, description="requests in flight per API key (Parrot requests not "
                                     "done + OpenAI calls running); beyond: 429 pending_limit with Retry-After")
    max_prompt_tokens: int | None = Field(None, ge=1, description="prompt tokens of one request (unset: the model's "
                                          "window); beyond: 400 limit_exceeded")
    max_output_tokens: int | None = Field(None, ge=1, description="tokens one output or choice may generate (unset: "
                                          "up to the window); also the default max_tokens; beyond: 400")
    max_n: int = Field(16, ge=1, le=128, description="largest 'n' (choices) an OpenAI request may ask for")
    responses_ttl_s: float = Field(3600.0, gt=0, description="how long a stored /v1/responses answer can be continued "
                                   "(previous_response_id) or fetched")
    max_stored_responses: int = Field(1024, ge=1, description="stored /v1/responses answers kept (least recently "
                                      "used evicted first)")
    shutdown_grace_s: float = Field(10.0, ge=0, le=600, description="on SIGTERM: stop accepting, let requests in "
                                    "flight finish for at most this long, then cancel the rest and exit")
    engines: int = Field(0, ge=0, le=64, description="parrot serve: start this many `parrot engine` processes that "
                         "register here (0 = one engine inside the server process)")
    backends: list[str] = Field(default_factory=list, description="parrot serve --backend [kind=]URL (repeatable): "
                                "external OpenAI-compatible servers registered as engines (kinds openai, vllm, sglang, "
                                "llamacpp; detected when not given; parrot.backends)")
    local_engine: bool = Field(True, description="parrot serve without --engines / --backend: run the builtin engine "
                               "inside the server; --no-local-engine: a manager only, serving the engines that "
                               "register (parrot engine --manager-url; needs --engine-secret)")
    # the network path to engines in other processes / on other hosts (parrot.engine.clients.http_client.CallPolicy)
    engine_networks: str = Field("127.0.0.0/8,::1/128", description="comma-separated networks (CIDR) a registering "
                                 "engine's URL may point into (its host name resolved); e.g. 10.0.0.0/8 for engines "
                                 "on other hosts; 'any' = no restriction (the engine secret still applies)")
    engine_connect_timeout_s: float = Field(5.0, gt=0, le=300, description="connecting to an engine")
    engine_read_timeout_s: float = Field(10.0, gt=0, le=600, description="an engine's answer to a short call "
                                         "(status, model info, free, token cap)")
    engine_op_timeout_s: float | None = Field(None, gt=0, description="an engine's answer to fill / generate "
                                              "(unset: no limit; a hung engine is found by missed heartbeats)")
    engine_retries: int = Field(3, ge=0, le=20, description="retries of an engine call whose connection failed "
                                "(refused; reset too for idempotent calls and fills), with exponential backoff")
    engine_retry_backoff_s: float = Field(0.1, gt=0, le=60, description="first retry backoff (doubled per retry, "
                                          "full jitter, at most 2 s)")

    @field_validator("engine_networks")
    @classmethod
    def _networks(cls, value: str) -> str:
        cls.parse_networks(value)  # ValueError naming the bad entry
        return value

    @staticmethod
    def parse_networks(value: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None:
        """The networks of ``engine_networks``; None for 'any'."""
        items = [x.strip() for x in value.split(",") if x.strip()]
        if items == ["any"]:
            return None
        if not items:
            raise ValueError("give at least one network, or 'any'")
        try:
            return tuple(ipaddress.ip_network(x, strict=False) for x in items)
        except ValueError as e:
            raise ValueError(f"bad network: {e}") from None

    @field_validator("max_long_poll_s")
    @classmethod
    def _http_long_poll(cls, value: float) -> float:
        if value > MAX_HTTP_LONG_POLL_S:
            raise ValueError(f"must be <= {MAX_HTTP_LONG_POLL_S:g} s over HTTP, got {value!r}")
        return value

    def engine_call_policy(self) -> CallPolicy:
        """Timeouts and retries of the HTTP clients of registered engines."""
        return CallPolicy(connect_s=self.engine_connect_timeout_s, control_s=self.engine_read_timeout_s,
                          op_s=self.engine_op_timeout_s, attempts=1 + self.engine_retries,
                          backoff_s=self.engine_retry_backoff_s, max_backoff_s=max(2.0, self.engine_retry_backoff_s))

    def manager_config(self) -> ManagerConfig:
        """The manager's part of these settings."""
        return ManagerConfig(**self.model_dump(include=set(ManagerConfig.model_fields)))
