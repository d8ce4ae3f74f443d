"""Helpers for tests that run real `parrot engine` processes: the tiny random engine's flags and a bounded wait."""

from __future__ import annotations

import time

# a tiny random-weight engine (starts in about a second, computes fast); fp32 so outputs are deterministic
TINY_ENGINE = ["--random-model", "tiny", "--dtype", "float32", "--weight-quant", "none", "--num-threads", "1",
               "--kv-cache-tokens", "16384"]
# the engine secret test managers are started with and their `parrot engine` children register with
SECRET = "test-engine-secret-0123456789"


def wait_until(cond, timeout_s: float, what: str):
    """Poll ``cond`` every 20 ms until it returns something truthy (returned); AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
