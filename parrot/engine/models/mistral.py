"""Mistral family (Mistral 7B v0.1-v0.3, Mistral-Nemo, Ministral): LLaMA with a sliding attention window.

config.json's ``sliding_window`` (null in v0.2+) applies to every layer unless ``layer_types`` says otherwise.
llama.cpp writes Mistral checkpoints as ``llama`` GGUF files, which the LLaMA family reads (window included).
"""

from __future__ import annotations

from parrot.engine.models.registry import Family, hf_layer_types, silu_only, sliding_fields


def _hf_fields(hf: dict, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    silu_only(hf, "mistral")
    return sliding_fields(hf.get("sliding_window"), hf_layer_types(hf, layers, lambda i: "sliding"))


def _gguf_fields(key, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    return sliding_fields(key("attention.sliding_window", None), ("sliding",) * layers)


FAMILIES = (Family("mistral", hf_model_types=("mistral",), gguf_archs=(), hf_fields=_hf_fields,
                   gguf_fields=_gguf_fields, gguf_permuted_qk=True),)
