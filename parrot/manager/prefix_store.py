"""PrefixHash (paper §4.2, §5.3): hashes of a prompt's prefix at every Semantic-Variable boundary, and the
store mapping such a hash to the queued requests and engine contexts that share that prefix.

A prompt is a sequence of *pieces*: constant text segments, input values and generated outputs, in template
order. The hash after piece k chains the hash after piece k-1 with the piece (length-prefixed, so piece
boundaries are part of the identity)::

    h0 = H("parrot-prefix-v1")      h(k) = H(h(k-1) | len(piece_k) | piece_k)

A *boundary* is the position right before a placeholder; its hash is that of every piece before it. Because
engines tokenize each piece separately, equal boundary hashes mean equal token prefixes on engines with the
same tokenizer, so a context holding that prefix can be forked instead of re-filled (issue 4 uses this).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

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


class PrefixStore:
    """hash -> {queued request keys, engine contexts}. One per manager (sharing spans sessions/apps).

    The executor is the only writer: it adds a request's known boundary hashes when the request is queued,
    removes them when it is dispatched, adds a ContextRef per boundary once the engine holds that prefix, and
    removes every ref of a context when it frees the context.
    """

    def __init__(self) -> None:
        self._queued: dict[str, set[str]] = {}
        self._contexts: dict[str, set[ContextRef]] = {}
        self._by_request: dict[str, list[str]] = {}
        self._by_context: dict[tuple[str, str], list[tuple[str, ContextRef]]] = {}

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

    def add_context(self, prefix_hash: str, ref: ContextRef) -> None:
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

    def lookup(self, prefix_hash: str) -> PrefixEntry:
        return PrefixEntry(frozenset(self._queued.get(prefix_hash, ())),
                           frozenset(self._contexts.get(prefix_hash, ())))

    def __len__(self) -> int:
        return len(self._queued.keys() | self._contexts.keys())
