"""Server settings: one validated object fed by init kwargs, environment (``PARROT_*``) and the CLI."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from parrot.manager.manager import ManagerConfig


class ServerSettings(BaseSettings):
    """Settings of the HTTP server and its manager. Invalid values raise a ValidationError (a ValueError)
    naming the field; unknown keyword arguments are rejected."""

    model_config = SettingsConfigDict(env_prefix="PARROT_", extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, min_length=1, description="require 'Authorization: Bearer <key>'")
    session_ttl_s: float = Field(600.0, gt=0, description="default idle time before a session expires")
    max_session_ttl_s: float = Field(86_400.0, gt=0)
    session_cleanup_interval_s: float = Field(5.0, gt=0)
    max_sessions: int = Field(10_000, ge=1)
    max_nodes_per_session: int = Field(10_000, ge=1, description="variables + requests per session")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_long_poll_s: float = Field(60.0, gt=0, le=60.0)
    engine_heartbeat_s: float = Field(2.0, ge=0, description="engine status refresh period (0 = off)")
    max_n: int = Field(16, ge=1, le=128, description="largest 'n' (choices) an OpenAI request may ask for")
    prefix_sharing: bool = Field(True, description="fill prompt prefixes shared by requests once, fork the rest")
    prefix_min_tokens: int = Field(16, ge=1, description="shortest prefix worth a shared prefix context")
    prefix_grace_s: float = Field(30.0, ge=0, description="idle time before an unused prefix context is freed")
    max_prefix_contexts_per_engine: int = Field(16, ge=1, description="LRU bound on prefix contexts per engine")
    policy: Literal["parrot", "fifo-latency", "fifo-throughput", "least-loaded"] = Field(
        "least-loaded", description="global scheduler: parrot (app-centric, paper Alg. 1), fifo-latency / "
        "fifo-throughput (request-centric baselines), least-loaded (no caps, no queueing: the default)")
    latency_cap_tokens: int = Field(2048, ge=1, description="running tokens per engine while latency work runs there")
    throughput_cap_tokens: int = Field(65536, ge=1, description="running tokens per engine for throughput work")
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="an engine silent this long is declared dead")
    max_attempts: int = Field(3, ge=1, description="runs of a request in all when its engine dies under it")
    engines: int = Field(0, ge=0, le=64, description="parrot serve: start this many `parrot engine` processes that "
                         "register here (0 = one engine inside the server process)")

    @model_validator(mode="after")
    def _check_caps(self) -> "ServerSettings":
        if self.latency_cap_tokens > self.throughput_cap_tokens:
            raise ValueError(f"latency_cap_tokens ({self.latency_cap_tokens}) must not exceed throughput_cap_tokens "
                             f"({self.throughput_cap_tokens})")
        return self

    def manager_config(self) -> ManagerConfig:
        return ManagerConfig(session_ttl_s=self.session_ttl_s, max_session_ttl_s=self.max_session_ttl_s,
                             max_sessions=self.max_sessions, max_nodes_per_session=self.max_nodes_per_session,
                             cleanup_interval_s=self.session_cleanup_interval_s,
                             heartbeat_interval_s=self.engine_heartbeat_s, max_long_poll_s=self.max_long_poll_s,
                             prefix_sharing=self.prefix_sharing, prefix_min_tokens=self.prefix_min_tokens,
                             prefix_grace_s=self.prefix_grace_s,
                             max_prefix_contexts_per_engine=self.max_prefix_contexts_per_engine,
                             policy=self.policy, latency_cap_tokens=self.latency_cap_tokens,
                             throughput_cap_tokens=self.throughput_cap_tokens,
                             heartbeat_timeout_s=self.heartbeat_timeout_s, max_attempts=self.max_attempts)
