"""Sessions: one application instance of a tenant, with its DAG, secret token, running tasks and contexts.

Ids and tokens come from :mod:`secrets` (unguessable). A session expires ``ttl_s`` seconds after its last
access (any authenticated call or a request of it finishing), never while a GET long-polls one of its values;
the manager's cleanup task closes expired sessions, which cancels their requests and frees their engine contexts.
That is how abandoned DAG work ends: a GET whose client disconnects cancels nothing (the value belongs to the
session, and another GET or a consumer request may still need it); a deleted or expired session cancels all of
its pending work (``parrot_cancelled_requests_total{api="parrot", reason="session_deleted|session_expired"}``).

The store keeps only a token's SHA-256 for checking it (the clear token is handed to the client once, at
creation), so a session restored from the journal (:mod:`parrot.manager.restore`) authenticates the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from parrot.common.errors import InvalidRequestError, InvalidSessionToken, UnknownSession
from parrot.manager.graph import Graph
from parrot.manager.state_budget import StateBudget
from parrot.manager.journal import Journal, NullJournal


def token_digest(token: str) -> bytes:
    """SHA-256 of a session token: what the store and the journal keep (tokens are 256-bit random)."""
    return hashlib.sha256(token.encode()).digest()


@dataclass(eq=False)
class SessionState:
    """The server side of one application session (the client's handle is :class:`parrot.frontend.client.Session`):
    its DAG, secret token, running request tasks and live engine contexts."""

    session_id: str
    token: str | None  # the clear token: known at creation only (None for a session restored from the journal)
    token_digest: bytes  # token_digest(token): what authenticate() checks
    ttl_s: float
    graph: Graph
    last_access: float  # the store's clock
    created_at: float  # the store's clock
    # asyncio tasks executing requests of this session (removed when done)
    tasks: set[asyncio.Task] = field(default_factory=set)
    request_tasks: dict[str, asyncio.Task] = field(default_factory=dict)  # request id -> its task (same tasks)
    # the session's flows (parrot.manager.flows.runner.FlowRun), by flow id, and their client tool calls
    flows: dict[str, Any] = field(default_factory=dict)
    # live engine contexts owned by the session: context id -> engine name (freed by whoever removes them)
    contexts: dict[str, str] = field(default_factory=dict)
    closed: bool = False
    owner: str = "anonymous"  # the tenant that created it: only that tenant finds it (others get 404)
    # the owner's prompt limit (parrot.api.limits): a request whose context before an output is longer fails
    max_prompt_tokens: int | None = None
    # GETs long-polling a value of this session right now: a client waiting is using it, so it does not expire
    # under them (it expires ttl_s after the last of them returns)
    waiting_gets: int = 0

    def expired(self, now: float) -> bool:
        return self.waiting_gets == 0 and now - self.last_access > self.ttl_s


class SessionStore:
    """Owns the session table. ``clock`` times TTLs and is handed to every session's graph (DAG timestamps);
    the manager passes its own, tests inject a fake one."""

    def __init__(self, *, default_ttl_s: float = 600.0, max_ttl_s: float = 86_400.0, max_sessions: int = 10_000,
                 max_nodes_per_session: int = 10_000, clock: Callable[[], float] = time.time,
                 journal: Journal | None = None, budget: StateBudget | None = None) -> None:
        if not 0 < default_ttl_s <= max_ttl_s:
            raise ValueError(f"default_ttl_s must be in (0, max_ttl_s={max_ttl_s}], got {default_ttl_s}")
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.max_sessions = max_sessions
        self.max_nodes_per_session = max_nodes_per_session
        self.clock = clock
        self.journal = journal or NullJournal()  # sessions' graphs write their DAG events to it too
        self.budget = budget or StateBudget()  # bytes of values and prompts the sessions hold (all graphs share it)
        self._sessions: dict[str, SessionState] = {}
        self._by_owner: dict[str, dict[str, SessionState]] = {}  # tenant -> its sessions (an index of _sessions)

    def create(self, ttl_s: float | None = None, *, owner: str = "anonymous",
               owner_limit: int | None = None) -> SessionState:
        """A new session of tenant ``owner``; ``owner_limit``: that tenant's most live sessions."""
        ttl = self.default_ttl_s if ttl_s is None else float(ttl_s)
        if not 0 < ttl <= self.max_ttl_s:
            raise InvalidRequestError(f"ttl_s must be in (0, {self.max_ttl_s}], got {ttl_s}", param="ttl_s")
        if len(self._sessions) >= self.max_sessions:
            raise InvalidRequestError(f"too many open sessions (limit {self.max_sessions}); delete unused ones")
        if owner_limit is not None and len(self._by_owner.get(owner, ())) >= owner_limit:
            raise InvalidRequestError(f"tenant {owner!r} has {owner_limit} open sessions, its max_sessions limit; "
                                      "delete unused ones", param="max_sessions")
        sid = "s_" + secrets.token_urlsafe(18)
        now = self.clock()
        token = secrets.token_urlsafe(32)
        session = SessionState(session_id=sid, token=token, token_digest=token_digest(token), ttl_s=ttl,
                               graph=self.new_graph(sid), last_access=now, created_at=now, owner=owner)
        self._insert(session)
        self.journal.session_created(session)
        return session

    def new_graph(self, session_id: str) -> Graph:
        """An empty graph for session ``session_id``, writing to this store's journal."""
        return Graph(session_id, max_nodes=self.max_nodes_per_session, clock=self.clock, journal=self.journal,
                     budget=self.budget)

    def adopt(self, session: SessionState) -> None:
        """Insert a session rebuilt from the journal (parrot.manager.restore); its TTL starts again now."""
        session.last_access = self.clock()
        self._insert(session)

    def authenticate(self, session_id: str, token: str | None, owner: str = "anonymous") -> SessionState:
        """The session if it belongs to ``owner`` and ``token`` matches (constant-time compare); touches it.

        Raises UnknownSession (404) for an unknown or expired id or another tenant's session (its existence is
        not revealed), InvalidSessionToken (401) for a bad token.
        """
        session = self._sessions.get(session_id)
        if session is None or session.expired(self.clock()) or session.owner != owner:
            raise UnknownSession(f"unknown session {session_id!r} (deleted or expired?)", param="session_id")
        if not token or not secrets.compare_digest(token_digest(token), session.token_digest):
            raise InvalidSessionToken(f"missing or wrong session token for session {session_id!r} "
                                      "(header X-Parrot-Session-Token)", param="X-Parrot-Session-Token")
        self.touch(session)
        return session

    def touch(self, session: SessionState) -> None:
        session.last_access = self.clock()

    def pop(self, session_id: str) -> SessionState | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._forget(session)
        return session

    def pop_expired(self) -> list[SessionState]:
        now = self.clock()
        expired = [s for s in self._sessions.values() if s.expired(now)]
        for s in expired:
            del self._sessions[s.session_id]
            self._forget(s)
        return expired

    def owned(self, owner: str) -> list[SessionState]:
        """The live sessions of tenant ``owner`` (an index: no scan of every session)."""
        return list(self._by_owner.get(owner, {}).values())

    def _insert(self, session: SessionState) -> None:
        self._sessions[session.session_id] = session
        self._by_owner.setdefault(session.owner, {})[session.session_id] = session

    def _forget(self, session: SessionState) -> None:
        """``session`` left the table: drop it from the owner index and give its state bytes back."""
        mine = self._by_owner.get(session.owner, {})
        mine.pop(session.session_id, None)
        if not mine:
            self._by_owner.pop(session.owner, None)
        session.graph.release_budget()

    def all(self) -> list[SessionState]:
        return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)
