"""Per-tenant limits the routes check, so that no one key can take the server's capacity or memory.

Where each limit lives::

    limit                      checked by                         over it
    -------------------------  ---------------------------------  -------------------------------------------
    request rate               TenantMiddleware (token bucket)    429 rate_limited + Retry-After
    body size                  BodyLimitMiddleware                413 payload_too_large
    sessions                   SessionStore.create                400 naming max_sessions
    variables + requests       Graph (max_nodes_per_session)      400 naming the limit
    requests in flight         InFlight.admit (here)              429 pending_limit + Retry-After
    prompt / output tokens     RequestLimits (here; the executor  400 limit_exceeded naming the field
                               for a Parrot request's prompt)

A tenant's own value (keys file) wins over the server's default (``ServerSettings.max_pending_per_key``,
``max_prompt_tokens``, ``max_output_tokens``). "In flight" counts the tenant's Parrot requests that are not
finished or failed (across its sessions) plus its OpenAI calls still running, streams included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from parrot.api.tenants import ANONYMOUS, Tenant
from parrot.common.errors import LimitExceeded, PendingLimit
from parrot.manager.completion_types import ChatSpec, CompletionPlan, CompletionSpec
from parrot.manager.manager import Manager

T = TypeVar("T")
PENDING_RETRY_AFTER_S = 1.0  # what a 429 pending_limit suggests: some work finishes within about a second


@dataclass(frozen=True)
class RequestLimits:
    """The limits one call runs under: the tenant's own, else the server's defaults."""

    tenant: str
    max_pending: int
    max_prompt_tokens: int | None
    max_output_tokens: int | None

    @classmethod
    def of(cls, tenant: Tenant, *, max_pending: int, max_prompt_tokens: int | None,
           max_output_tokens: int | None) -> "RequestLimits":
        return cls(tenant.name,
                   tenant.max_pending if tenant.max_pending is not None else max_pending,
                   tenant.max_prompt_tokens if tenant.max_prompt_tokens is not None else max_prompt_tokens,
                   tenant.max_output_tokens if tenant.max_output_tokens is not None else max_output_tokens)

    def output_tokens(self, asked: int | None, param: str) -> int | None:
        """``max_tokens`` as the call may run it: None asked -> the limit (or None: up to the window); more than
        the limit -> LimitExceeded naming ``param``."""
        if self.max_output_tokens is None:
            return asked
        if asked is None:
            return self.max_output_tokens
        if asked > self.max_output_tokens:
            raise LimitExceeded(f"{param} {asked} exceeds the max_output_tokens limit of tenant {self.tenant!r} "
                                f"({self.max_output_tokens})", param=param)
        return asked

    def completion_spec(self, spec: CompletionSpec | ChatSpec, param: str, *, asked: bool):
        """``spec`` with its max_tokens within the output limit (see :meth:`output_tokens`); ``asked``: the
        caller gave it (else it is the API's default, e.g. the legacy completions' 16, and is only capped)."""
        max_tokens = spec.choices.max_tokens
        if not asked and max_tokens is not None and self.max_output_tokens is not None:
            max_tokens = min(max_tokens, self.max_output_tokens)
        max_tokens = self.output_tokens(max_tokens, param)
        if max_tokens == spec.choices.max_tokens:
            return spec
        return dataclasses.replace(spec, choices=dataclasses.replace(spec.choices, max_tokens=max_tokens))

    def check_prompt(self, num_tokens: int, param: str = "prompt") -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise LimitExceeded(f"the {param} has {num_tokens} tokens; the max_prompt_tokens limit of tenant "
                                f"{self.tenant!r} is {self.max_prompt_tokens}", param=param)

    def check_plan(self, plan: CompletionPlan) -> None:
        """Every prompt of a planned OpenAI call within the prompt limit."""
        for job in plan.jobs:
            self.check_prompt(len(job.token_ids), "messages" if plan.chat else "prompt")


def request_limits(request: Request) -> RequestLimits:
    """The limits of this HTTP call: its tenant's (set by TenantMiddleware), else the server's defaults."""
    settings = request.app.state.settings
    return RequestLimits.of(getattr(request.state, "tenant", ANONYMOUS), max_pending=settings.max_pending_per_key,
                            max_prompt_tokens=settings.max_prompt_tokens,
                            max_output_tokens=settings.max_output_tokens)


class InFlight:
    """OpenAI calls running per tenant; with the tenant's open Parrot requests, what ``max_pending`` bounds.
    Used from the event loop only."""

    def __init__(self, manager: Manager) -> None:
        self._manager = manager
        self._calls: dict[str, int] = {}

    def pending(self, tenant: str) -> int:
        return self._calls.get(tenant, 0) + sum(s.graph.open_requests for s in self._manager.sessions.owned(tenant))

    def admit(self, limits: RequestLimits, adding: int = 1) -> None:
        """PendingLimit (429, Retry-After) when ``adding`` more would pass the tenant's max_pending."""
        now = self.pending(limits.tenant)
        if now + adding > limits.max_pending:
            raise PendingLimit(f"tenant {limits.tenant!r} has {now} requests in flight; its max_pending limit is "
                               f"{limits.max_pending}: retry when some finish", param="max_pending",
                               retry_after_s=PENDING_RETRY_AFTER_S)

    def enter(self, tenant: str) -> None:
        self._calls[tenant] = self._calls.get(tenant, 0) + 1

    def leave(self, tenant: str) -> None:
        left = self._calls.get(tenant, 0) - 1
        if left > 0:
            self._calls[tenant] = left
        else:
            self._calls.pop(tenant, None)

    async def counted(self, tenant: str, work: Awaitable[T]) -> T:
        """``await work``, counted in flight for ``tenant`` meanwhile."""
        self.enter(tenant)
        try:
            return await work
        finally:
            self.leave(tenant)

    async def held(self, tenant: str, events: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """``events`` (a response stream), counted in flight from its first to its last event (or until the
        client goes: the stream is closed then)."""
        self.enter(tenant)
        try:
            async for event in events:
                yield event
        finally:
            self.leave(tenant)
