"""PrefixHash (paper §4.2, §5.3): hashes of a prompt's prefix at every Semantic-Variable boundary, and the
store mapping such a hash to the queued requests and engine contexts that share that prefix.

A prompt is a sequence of *pieces*: constant text segments, input values and generated outputs, in template
order. The hash after piece k chains the hash after piece k-1 with the piece (length-prefixed, so piece
boundaries are part of the identity)::

    h0 = H("parrot-prefix-v1")      h(k) = H(h(k-1) | len(piece_k) | piece_k)

A *boundary* is a position between two pieces (right before a placeholder, or right after an input value);
its hash is that of every piece before it. Because engines tokenize each piece separately, equal boundary
hashes mean equal token prefixes on engines with the same tokenizer, so a context holding that prefix can be
forked instead of re-filled (:mod:`parrot.manager.prefix_sharing` does that with *prefix contexts*, which the
store indexes by (engine, hash) next to the request contexts it already tracks).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

_SEED = hashlib.sha256(b"parrot-prefix-v1").digest()


class PrefixHasher:
    """Incremental chained hash over prompt pieces."""

    def __init__(self) -> None:
        self._digest = _SEED

    def update(self, piece: str) -> str:
        data = piece.encode("utf-8")
        self._digest = hashlib.sha256(self._digest + len(data).to_bytes(8, "little") + data).digest()
        return self.hexdigest

    @property
    def hexdigest(self) -> str:
        return self._digest.hex()


def prefix_hashes(pieces: Iterable[str]) -> list[str]:
    """Hash after each piece (``result[k]`` covers ``pieces[:k+1]``)."""
    hasher = PrefixHasher()
    return [hasher.update(p) for p in pieces]


@dataclass(frozen=True)
class ContextRef:
    """An engine context whose first ``num_tokens`` tokens are the hashed prefix."""

    engine: str
    context_id: str
    num_tokens: int


@dataclass(frozen=True)
class PrefixEntry:
    queued: frozenset[str]  # request keys ("<session>/<request>") waiting with this prefix
    contexts: frozenset[ContextRef]


class PrefixState(enum.Enum):
    FILLING = "filling"  # the fill is in flight; forks wait for it
    READY = "ready"  # the engine holds the prefix; forks may start
    FAILED = "failed"  # the fill failed: sharers run unshared; kept until collected (no retry storm)
    FREED = "freed"  # dropped from the store; late releases are harmless


@dataclass(eq=False)
class PrefixContext:
    """An engine context holding exactly one prompt prefix (BOS + the pieces up to a boundary), created only
    to be forked from. Written only by :class:`~parrot.manager.prefix_sharing.PrefixSharing`.

    ``children`` counts live forks: request contexts and nested prefix contexts that share its KV blocks.
    ``client`` is the engine client that created it: if the registry later holds another client under the
    same name, the engine restarted and the context is gone.
    """

    engine: str
    context_id: str
    prefix_hash: str
    num_tokens: int  # BOS included
    client: object
    last_used: float
    parent: "PrefixContext | None" = None  # a shorter prefix context it was forked from (holds a ref on it)
    state: PrefixState = PrefixState.FILLING
    children: int = 0
    sessions: set[str] = field(default_factory=set)  # sessions whose requests used it (freed when all are gone)

    @property
    def usable(self) -> bool:
        return self.state in (PrefixState.FILLING, PrefixState.READY)


class PrefixStore:
    """hash -> {queued request keys, engine contexts}. One per manager (sharing spans sessions/apps).

    The executor is the only writer: it adds a request's known boundary hashes when the request is queued,
    removes them when it is dispatched, adds a ContextRef per boundary once the engine holds that prefix, and
    removes every ref of a context when it frees the context. Prefix contexts are added and removed by
    :class:`~parrot.manager.prefix_sharing.PrefixSharing` only.
    """

    # how many prefix sizes the store remembers after their contexts are gone (oldest forgotten first)
    MAX_KNOWN = 65536

    def __init__(self) -> None:
        # hash -> tokens of that prefix (BOS included) as an engine tokenized it: a placement estimate that
        # outlives the contexts (prefixes are tokenized piece by piece, so the count is the same on every
        # engine with this tokenizer)
        self._known: dict[str, int] = {}
        self._chars = 0  # characters and tokens of the distinct prefixes observed (observe): chars per token
        self._tokens = 0
        self._observed: set[str] = set()
        self._queued: dict[str, set[str]] = {}
        self._contexts: dict[str, set[ContextRef]] = {}
        self._by_request: dict[str, list[str]] = {}
        self._by_context: dict[tuple[str, str], list[tuple[str, ContextRef]]] = {}
        self._prefix: dict[tuple[str, str], PrefixContext] = {}  # (engine, hash) -> prefix context

    def add_queued(self, request_key: str, hashes: Iterable[str]) -> None:
        hashes = list(dict.fromkeys(hashes))
        self.remove_queued(request_key)
        for h in hashes:
            self._queued.setdefault(h, set()).add(request_key)
        self._by_request[request_key] = hashes

    def remove_queued(self, request_key: str) -> None:
        for h in self._by_request.pop(request_key, ()):
            keys = self._queued.get(h)
            if keys is not None:
                keys.discard(request_key)
                if not keys:
                    del self._queued[h]

    # ---- sizes known before placement ---------------------------------------------------------------------------
    def _remember(self, prefix_hash: str, num_tokens: int) -> None:
        self._known.pop(prefix_hash, None)
        self._known[prefix_hash] = num_tokens
        if len(self._known) > self.MAX_KNOWN:
            old = next(iter(self._known))
            del self._known[old]
            self._observed.discard(old)

    def known_tokens(self, prefix_hash: str) -> int | None:
        """Tokens of the prefix ``prefix_hash`` (BOS included) if an engine ever held it, else None."""
        return self._known.get(prefix_hash)

    def longest_known(self, prefix_hashes: Sequence[str]) -> tuple[int, int] | None:
        """(index in ``prefix_hashes``, tokens) of the longest prefix whose size is known, or None."""
        for i in range(len(prefix_hashes) - 1, -1, -1):
            n = self._known.get(prefix_hashes[i])
            if n is not None:
                return i, n
        return None

    def observe(self, prefix_hash: str, chars: int) -> None:
        """Learn the tokenizer's characters per token from a prefix of known size and ``chars`` characters
        (each distinct prefix counts once)."""
        n = self._known.get(prefix_hash)
        if n is None or prefix_hash in self._observed or chars <= 0:
            return
        self._observed.add(prefix_hash)
        self._chars += chars
        self._tokens += max(1, n - 1)  # BOS is not text

    def chars_per_token(self, default: float = 4.0) -> float:
        """Characters per token of the text prefixes observed so far (``default`` until one was)."""
        return self._chars / self._tokens if self._tokens >= 64 else default

    def add_context(self, prefix_hash: str, ref: ContextRef) -> None:
        self._remember(prefix_hash, ref.num_tokens)
        refs = self._contexts.setdefault(prefix_hash, set())
        if ref not in refs:
            refs.add(ref)
            self._by_context.setdefault((ref.engine, ref.context_id), []).append((prefix_hash, ref))

    def remove_context(self, engine: str, context_id: str) -> None:
        for h, ref in self._by_context.pop((engine, context_id), ()):
            refs = self._contexts.get(h)
            if refs is not None:
                refs.discard(ref)
                if not refs:
                    del self._contexts[h]

    # ---- prefix contexts (one per engine and hash) ----------------------------------------------------------------
    def add_prefix_context(self, pc: PrefixContext) -> None:
        key = (pc.engine, pc.prefix_hash)
        if key in self._prefix:
            raise ValueError(f"engine {pc.engine} already has a prefix context for {pc.prefix_hash[:12]}")
        self._prefix[key] = pc
        self._remember(pc.prefix_hash, pc.num_tokens)

    def remove_prefix_context(self, pc: PrefixContext) -> None:
        if self._prefix.get((pc.engine, pc.prefix_hash)) is pc:
            del self._prefix[(pc.engine, pc.prefix_hash)]

    def prefix_context(self, engine: str, prefix_hash: str) -> PrefixContext | None:
        return self._prefix.get((engine, prefix_hash))

    def prefix_contexts(self, engine: str | None = None) -> list[PrefixContext]:
        return [pc for (e, _), pc in self._prefix.items() if engine is None or e == engine]

    def sharers(self, prefix_hash: str, engine: str, exclude: str | None = None) -> int:
        """Requests that want this prefix: queued ones (any engine; not placed yet) plus request contexts on
        ``engine`` holding it, not counting the request key ``exclude``."""
        queued = self._queued.get(prefix_hash, set())
        running = {r.context_id for r in self._contexts.get(prefix_hash, ()) if r.engine == engine}
        return len(queued) - (exclude in queued) + len(running)

    def engine_prefix_tokens(self, engine: str, prefix_hashes: Sequence[str]) -> int:
        """Tokens of the longest of ``prefix_hashes`` that ``engine`` holds (a usable prefix context or a live
        request context), 0 if none: what a policy needs to keep sharers together (Algorithm 1, CtxInEngine)."""
        best = 0
        for h in prefix_hashes:
            pc = self._prefix.get((engine, h))
            if pc is not None and pc.usable:
                best = max(best, pc.num_tokens)
            for ref in self._contexts.get(h, ()):
                if ref.engine == engine:
                    best = max(best, ref.num_tokens)
        return best

    def lookup(self, prefix_hash: str) -> PrefixEntry:
        return PrefixEntry(frozenset(self._queued.get(prefix_hash, ())),
                           frozenset(self._contexts.get(prefix_hash, ())))

    def __len__(self) -> int:
        return len(self._queued.keys() | self._contexts.keys() | {h for _, h in self._prefix})
