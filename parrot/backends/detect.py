"""`--backend [kind=]URL`: parse the spec, detect the server's kind by probing its endpoints, build the engine.

Detection, first match wins (each probe bounded by ``probe_timeout_s``)::

    GET /v1/models  data[0].owned_by == "llamacpp" | "vllm" | "sglang"   -> that kind
    GET /props      has default_generation_settings                      -> llamacpp
    GET /get_server_info | /server_info   a JSON object with model_path  -> sglang
    GET /version    {version} and GET /metrics has "vllm:" samples       -> vllm
    GET /v1/models  answered with a model list                           -> openai (generic)

A server that answers none of them is not an OpenAI-compatible server: detection fails naming the URL.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from parrot.backends.base import BackendEngine, Dialect, Http
from parrot.backends.llamacpp import LlamaCppDialect
from parrot.backends.openai_generic import OpenAIDialect
from parrot.backends.settings import BackendSettings
from parrot.backends.sglang import SglangDialect
from parrot.backends.vllm import VllmDialect
from parrot.common.errors import EngineUnavailable, InvalidRequestError

logger = logging.getLogger(__name__)


class BackendKind(str, enum.Enum):
    OPENAI = "openai"
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"


DIALECTS: dict[BackendKind, type[Dialect]] = {
    BackendKind.OPENAI: OpenAIDialect,
    BackendKind.VLLM: VllmDialect,
    BackendKind.SGLANG: SglangDialect,
    BackendKind.LLAMACPP: LlamaCppDialect,
}
ALIASES = {"generic": BackendKind.OPENAI, "llama.cpp": BackendKind.LLAMACPP, "llama-cpp": BackendKind.LLAMACPP}


@dataclass(frozen=True)
class BackendSpec:
    url: str
    kind: BackendKind | None = None  # None: detect

    @classmethod
    def parse(cls, text: str) -> "BackendSpec":
        """``URL`` or ``kind=URL``; raises InvalidRequestError naming what is wrong."""
        kind: BackendKind | None = None
        url = text.strip()
        if "=" in url and not url.split("=", 1)[0].startswith("http"):
            name, url = url.split("=", 1)
            name = name.strip().lower()
            kind = ALIASES.get(name) or next((k for k in BackendKind if k.value == name), None)
            if kind is None:
                raise InvalidRequestError(f"unknown backend kind {name!r} in {text!r} (kinds: "
                                          f"{', '.join(k.value for k in BackendKind)})", param="backend")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequestError(f"backend {text!r}: expected [kind=]http(s)://host:port", param="backend")
        return cls(url=url.rstrip("/"), kind=kind)


async def _json(client: httpx.AsyncClient, path: str) -> object | None:
    try:
        r = await client.get(path)
    except httpx.TransportError:
        return None
    if r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return None


async def detect_kind(url: str, settings: BackendSettings | None = None) -> BackendKind:
    """Probe ``url`` (see the module docstring). EngineUnavailable if it cannot be reached,
    InvalidRequestError if it answers but is no OpenAI-compatible server."""
    settings = settings or BackendSettings()
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=settings.probe_timeout_s) as client:
        try:
            await client.get("/")
        except httpx.TransportError as e:
            raise EngineUnavailable(f"backend {url} unreachable: {type(e).__name__}: {e}") from None
        models = await _json(client, "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        card = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        owner = str(card.get("owned_by") or "").lower()
        for kind in (BackendKind.LLAMACPP, BackendKind.VLLM, BackendKind.SGLANG):
            if owner == kind.value:
                return kind
        props = await _json(client, "/props")
        if isinstance(props, dict) and "default_generation_settings" in props:
            return BackendKind.LLAMACPP
        for path in ("/get_server_info", "/server_info"):
            info = await _json(client, path)
            if isinstance(info, dict) and "model_path" in info:
                return BackendKind.SGLANG
        version = await _json(client, "/version")
        if isinstance(version, dict) and "version" in version:
            try:
                metrics = await client.get("/metrics")
                if metrics.status_code == 200 and "vllm:" in metrics.text:
                    return BackendKind.VLLM
            except httpx.TransportError:
                pass
        if card:
            return BackendKind.OPENAI
    raise InvalidRequestError(f"backend {url} answers, but not as an OpenAI-compatible server (no model list at "
                              "/v1/models)", param="backend")


def build_backend(spec: BackendSpec, kind: BackendKind, name: str,
                  settings: BackendSettings | None = None) -> BackendEngine:
    """The engine client of a server whose kind is known (given or detected)."""
    settings = settings or BackendSettings()
    http = Http(spec.url, name, settings)
    return BackendEngine(DIALECTS[kind](http), name)


def default_name(kind: BackendKind, index: int) -> str:
    return f"{kind.value}-{index}"


def resolve_backends(texts: list[str], settings: BackendSettings | None = None) -> list[BackendEngine]:
    """``--backend`` values -> engine clients, kinds detected where not given (blocking: for start-up code that
    runs before the server's event loop). A forced kind is not probed: that server may come up later."""
    specs = [BackendSpec.parse(t) for t in texts]
    settings = settings or BackendSettings()

    async def kinds() -> list[BackendKind]:
        return list(await asyncio.gather(*(
            asyncio.sleep(0, s.kind) if s.kind is not None else detect_kind(s.url, settings) for s in specs)))

    found = asyncio.run(kinds())
    engines = []
    for i, (spec, kind) in enumerate(zip(specs, found)):
        logger.info("backend %s: %s%s", spec.url, kind.value, " (given)" if spec.kind is not None else " (detected)")
        engines.append(build_backend(spec, kind, default_name(kind, i), settings))
    return engines
