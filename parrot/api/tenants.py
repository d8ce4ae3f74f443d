"""Tenants: who an API key belongs to, and what that tenant may do.

Keys come from ``--api-key`` (one tenant named ``default``) and/or a keys file (``--api-keys-file``), JSON::

    {"keys": [
      {"name": "alice", "key": "sk-alice-...", "max_sessions": 50, "requests_per_minute": 600,
       "max_pending": 200, "max_prompt_tokens": 4096, "max_output_tokens": 1024},
      {"name": "bob", "key_sha256": "9f86d0...", "requests_per_minute": 60}
    ]}

``key_sha256`` keeps the key itself out of the file. The file is re-read when its modification time changes
(looked at no more often than ``reload_s``), so a key is added or revoked without a restart; a file that does
not parse keeps the keys already loaded and is logged (its path, never a key). Keys are matched by their SHA-256
digest (a dict lookup on digests: no key-dependent timing); keys never reach a log line.

No key configured at all: the server is open and every caller is the tenant ``anonymous``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tenant:
    """A key's owner and limits; None: no limit of the tenant's own (the server's defaults apply, see
    parrot.api.limits)."""

    name: str
    max_sessions: int | None = None  # live sessions at once (400 naming the limit beyond it)
    requests_per_minute: float | None = None  # a token bucket of this size, refilled at this rate (429 beyond)
    max_pending: int | None = None  # requests in flight at once: Parrot requests not done + OpenAI calls (429)
    max_prompt_tokens: int | None = None  # prompt tokens of one request (400 naming the limit)
    max_output_tokens: int | None = None  # tokens one output / choice may generate (400 naming the limit)


ANONYMOUS = Tenant("anonymous")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantKeys:
    def __init__(self, *, api_key: str | None = None, keys_file: str | None = None, reload_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._static = {key_digest(api_key): Tenant("default")} if api_key else {}
        self._file = keys_file
        self._reload_s = reload_s
        self._clock = clock
        self._from_file: dict[str, Tenant] = {}
        self._mtime: float | None = None
        self._checked = -math.inf
        if keys_file is not None:
            self._load(strict=True)

    @property
    def open(self) -> bool:
        """No key configured: everyone is :data:`ANONYMOUS`."""
        return not self._static and self._file is None

    def lookup(self, key: str) -> Tenant | None:
        self._maybe_reload()
        digest = key_digest(key)
        return self._static.get(digest) or self._from_file.get(digest)

    def _maybe_reload(self) -> None:
        if self._file is None or self._clock() - self._checked < self._reload_s:
            return
        self._checked = self._clock()
        try:
            mtime = os.stat(self._file).st_mtime_ns
        except OSError:
            mtime = None
        if mtime != self._mtime:
            self._load(strict=False)

    def _load(self, *, strict: bool) -> None:
        """Read the keys file; ``strict`` (at start): a bad file is a ValueError naming it."""
        assert self._file is not None
        try:
            self._mtime = os.stat(self._file).st_mtime_ns
            with open(self._file, encoding="utf-8") as f:
                self._from_file = parse_keys(json.load(f))
        except (OSError, ValueError, TypeError, KeyError) as e:
            if strict:
                raise ValueError(f"api keys file {self._file}: {e}") from None
            log.error("api keys file %s could not be re-read (%s); keeping the keys loaded before", self._file,
                      type(e).__name__)
            return
        log.info("api keys file %s: %d key(s) loaded", self._file, len(self._from_file))


def parse_keys(doc: object) -> dict[str, Tenant]:
    """Digest -> tenant from the keys file's JSON (ValueError naming the bad entry)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise ValueError('expected {"keys": [...]}')
    out: dict[str, Tenant] = {}
    for i, entry in enumerate(doc["keys"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise ValueError(f"keys[{i}]: needs a non-empty 'name'")
        unknown = set(entry) - {"name", "key", "key_sha256", "requests_per_minute", *_INT_LIMITS}
        if unknown:
            raise ValueError(f"keys[{i}]: unknown field(s) {sorted(unknown)}")
        if ("key" in entry) == ("key_sha256" in entry):
            raise ValueError(f"keys[{i}]: give exactly one of 'key' and 'key_sha256'")
        digest = key_digest(entry["key"]) if "key" in entry else str(entry["key_sha256"]).lower()
        if len(digest) != 64:
            raise ValueError(f"keys[{i}]: key_sha256 must be 64 hex digits")
        limits = {name: entry.get(name) for name in _INT_LIMITS}
        for name, value in limits.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"keys[{i}]: {name} must be an integer >= 1")
        rpm = entry.get("requests_per_minute")
        if rpm is not None and (isinstance(rpm, bool) or not isinstance(rpm, (int, float)) or rpm <= 0):
            raise ValueError(f"keys[{i}]: requests_per_minute must be > 0")
        out[digest] = Tenant(entry["name"], requests_per_minute=float(rpm) if rpm is not None else None, **limits)
    return out


_INT_LIMITS = ("max_sessions", "max_pending", "max_prompt_tokens", "max_output_tokens")


class RateLimiter:
    """A token bucket per tenant: ``requests_per_minute`` tokens at most, refilled continuously."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)

    def retry_after(self, tenant: Tenant) -> float | None:
        """Take a token: None if allowed, else the seconds until one is available."""
        rpm = tenant.requests_per_minute
        if rpm is None:
            return None
        now = self._clock()
        tokens, at = self._buckets.get(tenant.name, (rpm, now))
        tokens = min(rpm, tokens + (now - at) * rpm / 60.0)
        if tokens >= 1.0:
            self._buckets[tenant.name] = (tokens - 1.0, now)
            return None
        self._buckets[tenant.name] = (tokens, now)
        return (1.0 - tokens) * 60.0 / rpm
