"""The request-centric baseline client: what a LangChain app does on an OpenAI-style completion service.

Each step's prompt is rendered on the client (placeholders replaced by values the client holds), sent to
``POST /v1/completions`` as one independent request, and the client waits for the answer before it can
render any step that depends on it. Every call pays an emulated Internet round trip (paper §8.1: a random
200-300 ms per LLM request): half of the sampled RTT is slept before the request is sent, half after the
answer arrives, so the server sees the request as late as it would over a real network.
"""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

from parrot.common.errors import error_from_body


@dataclass
class EmulatedLatency:
    """Random round-trip times from a seeded RNG. ``latency_ms=(0, 0)`` disables the emulation."""

    latency_ms: tuple[float, float] = (200.0, 300.0)
    seed: int = 0
    charged_s: float = 0.0  # total RTT charged so far
    round_trips: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        low, high = self.latency_ms
        if not 0 <= low <= high:
            raise ValueError(f"latency_ms must be (low, high) with 0 <= low <= high, got {self.latency_ms}")
        self._rng = random.Random(self.seed)

    def sample_s(self) -> float:
        """Draw one round trip (seconds) and account it."""
        with self._lock:
            rtt = self._rng.uniform(*self.latency_ms) / 1000.0
            self.charged_s += rtt
            self.round_trips += 1
            return rtt


class BaselineClient:
    """Async OpenAI-completions client with per-call emulated latency. Use inside one event loop."""

    def __init__(self, url: str, *, api_key: str | None = None, latency_ms: tuple[float, float] = (200.0, 300.0),
                 seed: int = 0, latency: EmulatedLatency | None = None, model: str | None = None,
                 timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """``latency`` (shared with other drivers) wins over ``latency_ms`` / ``seed``; ``transport`` is for
        tests (an ``httpx.MockTransport``)."""
        self.url = url.rstrip("/")
        self.latency = latency or EmulatedLatency(tuple(latency_ms), seed)
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)
        self.calls = 0

    async def _post(self, path: str, body: dict) -> dict:
        resp = await self._http.post(path, json=body)
        if not resp.is_success:
            raise error_from_body(resp.status_code, resp.json())
        return resp.json()

    async def model_name(self) -> str:
        """The model to request: the given one, else the first of ``GET /v1/models``."""
        if self.model is None:
            resp = await self._http.get("/v1/models")
            if not resp.is_success:
                raise error_from_body(resp.status_code, resp.json())
            self.model = resp.json()["data"][0]["id"]
        return self.model

    async def acomplete(self, prompt: str, *, max_tokens: int, temperature: float = 0.0,
                        stop: list[str] | None = None, ignore_eos: bool = False, seed: int | None = None) -> str:
        """One completion call, paying one emulated round trip. Returns the generated text."""
        body: dict[str, Any] = {"model": await self.model_name(), "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": temperature, "ignore_eos": ignore_eos}
        if stop:
            body["stop"] = stop
        if seed is not None:
            body["seed"] = seed
        rtt = self.latency.sample_s()
        await asyncio.sleep(rtt / 2)  # request on the wire
        answer = await self._post("/v1/completions", body)
        await asyncio.sleep(rtt / 2)  # response on the wire
        self.calls += 1
        return answer["choices"][0]["text"]

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "BaselineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
