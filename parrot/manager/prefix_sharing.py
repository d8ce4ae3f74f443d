"""Prefix sharing by context fork (paper §3 "Redundant Computations", §5.3, §8.3, §8.4): a prompt prefix that
several requests share is filled ONCE into a *prefix context* on an engine and every sharer forks from it.

A request's *head* is its prompt before the first output, tokenized piece by piece exactly as the request is
filled when it runs alone, with a PrefixHash after every piece (constant text and materialized values)::

    head:       | BOS | system prompt | {{input:doc}} value | " Question: " | {{input:q}} value | <generate>
    boundaries:                       ^h1 (n1 tokens)      ^h2 (n2)       ^h3                 ^h4
    prefix context P = BOS + pieces up to h2;   request context = fork(P) + fill(pieces after h2)

The fork point is always a piece boundary, so the request's token ids are identical with and without sharing
(this is what makes outputs identical). The engine gives the child P's full KV blocks (ref-counted, no copy)
and recomputes only the partial last block.

Choice (per request, on the engine the dispatcher picked): the longest boundary holding >= ``min_tokens``
tokens that (a) already has a usable prefix context on that engine, or (b) is likely shared: another request
queued/ready with that hash, or a live request context on the engine holding it. In case (b) the prefix context
is created, forked from a shorter existing one when there is one. Its fill runs as a task owned here (a request
being cancelled never cancels it) and resolves one future that every concurrent sharer awaits, so the prefix is
never filled twice. A failed fill leaves the record FAILED until collected: its sharers (and later ones) run
unshared, hence succeed or fail with exactly the typed error they would have had; nobody waits forever.

Lifetime: a prefix context counts its live children (forked request contexts and nested prefix contexts). It
is freed when idle for ``grace_s`` (:meth:`PrefixSharing.collect`, run by the manager's cleanup loop), when its
engine needs room for a new one (LRU among idle ones; at most ``max_per_engine`` per engine), when every session
that used it has gone and it has no children, when its engine was replaced (a restart lost it), and at shutdown.
Freeing while children live is safe on the engine side: children keep their block references.

Cross-session sharing: a prefix context is found only through the PrefixHash of the requester's *own* prompt
pieces, a SHA-256 chain over their full content. So a request forks from a context another session created only
if its own prompt already contains exactly that text, whether constant text or a materialized variable value.
The fork gives it KV for tokens it presented itself and its output is what it computes alone: no content of the
other tenant can be read through it. (Like any prefix cache, a faster first token can hint that someone used the
same prefix recently; deployments that cannot accept that timing signal set ``prefix_sharing`` off.)
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from parrot.common.errors import EngineUnavailable, ParrotError, UnknownContext
from parrot.protocol.interface import EngineClient, OpHint
from parrot.manager.engine_registry import EngineRegistry
from parrot.manager.prefix_store import PrefixContext, PrefixState, PrefixStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharingConfig:
    enabled: bool = True
    min_tokens: int = 16  # shorter prefixes are not worth a context (one KV block by default)
    grace_s: float = 30.0  # an idle prefix context lives this long after its last child finished
    max_per_engine: int = 16

    def __post_init__(self) -> None:
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens!r}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")
        if self.max_per_engine < 1:
            raise ValueError(f"max_per_engine must be >= 1, got {self.max_per_engine!r}")


@dataclass(frozen=True)
class Boundary:
    prefix_hash: str  # PrefixHash of the pieces before this position
    num_tokens: int  # context tokens up to this position (BOS included)


@dataclass(frozen=True)
class PromptHead:
    """A request's prompt before its first output: tokens (BOS + pieces) and one boundary after each piece."""

    tokens: tuple[int, ...]
    boundaries: tuple[Boundary, ...]  # ascending num_tokens


@dataclass(eq=False)
class Fork:
    """A request's hold on a prefix context: one child reference until :meth:`PrefixSharing.release`."""

    prefix: PrefixContext
    released: bool = False


@dataclass(frozen=True)
class PrefixStats:
    enabled: bool
    live_contexts: int  # prefix contexts filling or ready now
    contexts_created: int  # fills that succeeded
    contexts_freed: int
    fill_failures: int
    forks: int  # request contexts created as forks of a prefix context
    tokens_shared: int  # prefix tokens those forks did not fill themselves
    tokens_prefilled: int  # tokens filled into prefix contexts
    tokens_saved: int  # tokens_shared - tokens_prefilled: fills avoided overall (negative if nobody forked)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Counters:
    created: int = 0
    freed: int = 0
    failures: int = 0
    forks: int = 0
    shared: int = 0
    prefilled: int = 0


class PrefixSharing:
    """Creates, hands out and frees prefix contexts; the only writer of :class:`PrefixContext` records.

    Used from the event loop only. :meth:`plan` is synchronous so that deciding and registering a new prefix
    context happen without an await in between (two sharers can never both create one).
    """

    def __init__(self, store: PrefixStore, registry: EngineRegistry, config: SharingConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.registry = registry
        self.config = config or SharingConfig()
        self._clock = clock
        self._ready: dict[PrefixContext, asyncio.Future[bool]] = {}  # records being filled -> "it is READY"
        self._fills: set[asyncio.Task] = set()  # fills in flight (cancelled at shutdown)
        self._frees: set[asyncio.Task] = set()  # engine frees in flight (awaited at shutdown)
        self._n = _Counters()

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    # ---- the request path ---------------------------------------------------------------------------------
    def plan(self, session_id: str, request_key: str, engine: str, client: EngineClient,
             head: PromptHead, tpot_s: float | None = None) -> Fork | None:
        """The prefix context ``request_key`` should fork from on ``engine`` (created now if likely shared),
        with a child reference taken; None = run unshared. ``tpot_s``: the request's per-token target, carried by
        the fill of a prefix context made for it (latency work's prompt is latency work: the engine's step budget
        does not hold it back)."""
        if not self.config.enabled:
            return None
        for b in reversed(head.boundaries):
            if b.num_tokens < self.config.min_tokens:
                return None
            pc = self._current(engine, b.prefix_hash, client)
            if pc is not None:
                if pc.state is PrefixState.FAILED:
                    return None  # its sharers run unshared until the record is collected
                break
            if self.store.sharers(b.prefix_hash, engine, exclude=request_key) >= 1:
                pc = self._create(engine, client, head, b, tpot_s)
                if pc is None:
                    return None
                break
        else:
            return None
        pc.children += 1
        pc.sessions.add(session_id)
        pc.last_used = self._clock()
        return Fork(pc)

    async def wait(self, fork: Fork) -> bool:
        """Wait for the prefix context's fill; True if the request can fork from it now."""
        return await self._wait_ready(fork.prefix)

    def forked(self, fork: Fork) -> None:
        """The request's context was created as a fork (its first fill succeeded)."""
        self._n.forks += 1
        self._n.shared += fork.prefix.num_tokens

    def release(self, fork: Fork) -> None:
        """Drop the request's child reference (idempotent). Idle contexts are freed later by :meth:`collect`."""
        if not fork.released:
            fork.released = True
            self._unref(fork.prefix)

    def invalidate(self, pc: PrefixContext) -> None:
        """The engine does not know ``pc`` any more (a fork from it raised UnknownContext): forget it."""
        logger.warning("engine %s lost prefix context %s", pc.engine, pc.context_id)
        if self._detach(pc):
            self._spawn(self._free_on_engine(pc), self._frees)

    # ---- freeing ------------------------------------------------------------------------------------------
    async def collect(self) -> int:
        """Free prefix contexts idle for ``grace_s`` and forget those whose engine went away; returns how many."""
        now, n = self._clock(), 0
        for pc in self._longest_first(self.store.prefix_contexts()):
            if pc.state is PrefixState.FREED:  # dropped by someone else during an await of this loop
                continue
            gone = self._engine_client(pc.engine) is not pc.client
            idle = pc.children == 0 and pc.state is not PrefixState.FILLING
            if gone or (idle and now - pc.last_used >= self.config.grace_s):
                await self._drop(pc)
                n += 1
        return n

    async def close_session(self, session_id: str) -> None:
        """A session went away: free the prefix contexts only it used that have no children left."""
        for pc in self._longest_first(self.store.prefix_contexts()):
            pc.sessions.discard(session_id)
            if not pc.sessions and pc.children == 0 and pc.state is not PrefixState.FILLING:
                await self._drop(pc)

    async def close(self) -> None:
        """Shutdown: free every prefix context and stop fills in flight."""
        for pc in self._longest_first(self.store.prefix_contexts()):
            await self._drop(pc)
        for t in self._fills:
            t.cancel()
        tasks = list(self._fills) + list(self._frees)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def stats(self) -> PrefixStats:
        n = self._n
        live = sum(1 for pc in self.store.prefix_contexts() if pc.usable)
        return PrefixStats(enabled=self.config.enabled, live_contexts=live, contexts_created=n.created,
                           contexts_freed=n.freed, fill_failures=n.failures, forks=n.forks, tokens_shared=n.shared,
                           tokens_prefilled=n.prefilled, tokens_saved=n.shared - n.prefilled)

    # ---- internals ------------------------------------------------------------------------------------------
    def _current(self, engine: str, prefix_hash: str, client: EngineClient) -> PrefixContext | None:
        """The record for (engine, hash), forgetting it first if it was made through another client (the
        engine re-registered after a restart, so the context is gone)."""
        pc = self.store.prefix_context(engine, prefix_hash)
        if pc is not None and pc.client is not client:
            self._detach(pc)
            return None
        return pc

    def _create(self, engine: str, client: EngineClient, head: PromptHead, b: Boundary,
                tpot_s: float | None) -> PrefixContext | None:
        if not self._make_room(engine):
            return None
        parent = None
        for shorter in reversed(head.boundaries):
            if shorter.num_tokens < b.num_tokens and shorter.num_tokens >= self.config.min_tokens:
                cand = self._current(engine, shorter.prefix_hash, client)
                if cand is not None and cand.usable:
                    parent = cand
                    break
        now = self._clock()
        pc = PrefixContext(engine=engine, context_id=f"prefix-{secrets.token_hex(8)}", prefix_hash=b.prefix_hash,
                           num_tokens=b.num_tokens, client=client, last_used=now, parent=parent)
        if parent is not None:
            parent.children += 1
            parent.last_used = now
        self.store.add_prefix_context(pc)
        self._ready[pc] = asyncio.get_running_loop().create_future()
        hint = OpHint(tpot_s=tpot_s) if tpot_s is not None else None
        self._spawn(self._fill(pc, client, list(head.tokens[:b.num_tokens]), hint), self._fills)
        logger.debug("prefix context %s on %s: %d tokens%s", pc.context_id, engine, pc.num_tokens,
                     f" (fork of {parent.context_id})" if parent else "")
        return pc

    def _make_room(self, engine: str) -> bool:
        """Keep at most ``max_per_engine`` records on ``engine`` by evicting the least recently used idle one;
        False if all are busy (the caller then runs unshared)."""
        live = self.store.prefix_contexts(engine)
        if len(live) < self.config.max_per_engine:
            return True
        idle = [pc for pc in live if pc.children == 0 and pc.state is not PrefixState.FILLING]
        if not idle:
            return False
        victim = min(idle, key=lambda pc: pc.last_used)
        if self._detach(victim):
            self._spawn(self._free_on_engine(victim), self._frees)
        return True

    async def _fill(self, pc: PrefixContext, client: EngineClient, tokens: list[int], hint: OpHint | None) -> None:
        ok, todo = False, tokens
        try:
            parent_id = None
            if pc.parent is not None:
                if await self._wait_ready(pc.parent):
                    parent_id, todo = pc.parent.context_id, tokens[pc.parent.num_tokens:]
                else:
                    self._unlink_parent(pc)
            await client.fill(todo, pc.context_id, parent_id, **({"hint": hint} if hint is not None else {}))
            ok = True
        except ParrotError as e:
            logger.warning("filling prefix context %s (%d tokens) on %s failed; its sharers run unshared: %s",
                           pc.context_id, pc.num_tokens, pc.engine, e)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: log it, but sharers must still run (unshared)
            logger.exception("filling prefix context %s crashed", pc.context_id)
        finally:
            await self._filled(pc, ok, len(todo))

    async def _filled(self, pc: PrefixContext, ok: bool, num_filled: int) -> None:
        fut = self._ready.pop(pc, None)
        if pc.state is PrefixState.FILLING:
            if ok:
                pc.state = PrefixState.READY
                self._n.created += 1
                self._n.prefilled += num_filled
            else:
                pc.state = PrefixState.FAILED
                self._n.failures += 1
                self._unlink_parent(pc)
        keep = pc.state is PrefixState.READY
        if fut is not None and not fut.done():
            fut.set_result(keep)
        if not keep:  # failed, or detached while filling: the engine may hold a (partial) context
            await self._free_on_engine(pc)
        elif pc.children == 0 and not pc.sessions:  # every sharer went away while it filled
            await self._drop(pc)

    async def _wait_ready(self, pc: PrefixContext) -> bool:
        fut = self._ready.get(pc)
        if fut is not None:
            await asyncio.shield(fut)  # a cancelled waiter must not cancel the shared future
        return pc.state is PrefixState.READY

    def _unref(self, pc: PrefixContext) -> None:
        pc.children = max(0, pc.children - 1)
        pc.last_used = self._clock()

    def _unlink_parent(self, pc: PrefixContext) -> None:
        if pc.parent is not None:
            self._unref(pc.parent)
            pc.parent = None

    def _detach(self, pc: PrefixContext) -> bool:
        """Remove ``pc`` from the store (FREED); True if its engine context must be freed now (it was READY;
        a FILLING one is freed by its fill task, a FAILED one already was)."""
        if pc.state is PrefixState.FREED:
            return False
        was_ready = pc.state is PrefixState.READY
        pc.state = PrefixState.FREED
        self.store.remove_prefix_context(pc)
        self._unlink_parent(pc)
        if was_ready:
            self._n.freed += 1
        return was_ready

    async def _drop(self, pc: PrefixContext) -> None:
        if self._detach(pc):
            await self._free_on_engine(pc)

    async def _free_on_engine(self, pc: PrefixContext) -> None:
        client = self._engine_client(pc.engine)
        if client is not pc.client:
            return  # the engine went away or restarted: the context went with it
        try:
            await client.free_context(pc.context_id)
        except UnknownContext:
            pass  # never created (the fill failed early) or already gone
        except ParrotError as e:
            logger.warning("freeing prefix context %s on %s failed: %s", pc.context_id, pc.engine, e)

    def _engine_client(self, engine: str) -> EngineClient | None:
        try:
            return self.registry.entry(engine).client
        except EngineUnavailable:
            return None

    @staticmethod
    def _spawn(coro: Coroutine, tasks: set[asyncio.Task]) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    @staticmethod
    def _longest_first(pcs: list[PrefixContext]) -> list[PrefixContext]:
        """Nested contexts before their parents, so freeing a child can make its parent idle in the same pass."""
        return sorted(pcs, key=lambda pc: -pc.num_tokens)
