"""Model implementations: one shared decoder (decoder.py, assembled by assembly.py) and one small module per
family (llama, mistral, qwen2, qwen3, gemma, phi3; the table in registry.py). Lazy: importing the package (as config.py
does, for the family table) imports no torch."""

from __future__ import annotations

from typing import Any

__all__ = ["AttentionBackend", "CausalLM", "build_random_model", "load_model"]
_LAZY = {"AttentionBackend": "decoder", "CausalLM": "decoder", "build_random_model": "assembly",
         "load_model": "assembly"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"parrot.engine.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
