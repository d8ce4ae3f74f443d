"""Qwen2 / Qwen2.5 family: LLaMA with a bias on the q / k / v projections (none on o_proj), often a tied head.

A sliding window is opt-in (``use_sliding_window``) and covers the layers from ``max_window_layers`` on, as in
transformers' Qwen2Config; llama.cpp ignores it, so GGUF files have none.
"""

from __future__ import annotations

from parrot.engine.models.registry import Family, hf_layer_types, silu_only, sliding_fields


def qwen_sliding(hf: dict, layers: int) -> dict:
    """The opt-in window of Qwen2 / Qwen3 configs."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    first = int(hf.get("max_window_layers") or 0)
    return sliding_fields(window, hf_layer_types(hf, layers, lambda i: "sliding" if i >= first else "full"))


def _hf_fields(hf: dict, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    silu_only(hf, "qwen2")
    return {"attention_bias": True, **qwen_sliding(hf, layers)}


def _gguf_fields(key, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    return {"attention_bias": True}


FAMILIES = (Family("qwen2", hf_model_types=("qwen2",), gguf_archs=("qwen2",), hf_fields=_hf_fields,
                   gguf_fields=_gguf_fields),)
