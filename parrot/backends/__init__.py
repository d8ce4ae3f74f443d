"""External engines: OpenAI-compatible servers (generic, vLLM, SGLang, llama.cpp) behind the EngineClient
interface, so the manager schedules them like builtin engines (``parrot serve --backend [kind=]URL``)."""

from parrot.backends.base import BackendEngine
from parrot.backends.detect import BackendKind, BackendSpec, build_backend, detect_kind, resolve_backends
from parrot.backends.settings import BackendSettings

__all__ = ["BackendEngine", "BackendKind", "BackendSpec", "BackendSettings", "build_backend", "detect_kind",
           "resolve_backends"]
