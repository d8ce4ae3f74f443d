"""LLaMA family (LLaMA 2/3, SmolLM, TinyLlama, ...): the plain shared decoder. Mistral GGUFs are ``llama`` files too.

Torch-free, like every family module: config.py reads the family table at import.
"""

from __future__ import annotations

from parrot.engine.models.registry import Family, GGUFKey, silu_only, sliding_fields


def _hf_fields(hf: dict, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    silu_only(hf, "llama")
    if hf.get("attention_bias"):  # LLaMA's attention_bias also biases o_proj, which the decoder has not
        raise ValueError("LLaMA configs with attention_bias/mlp_bias are not supported")
    return {}


def _gguf_fields(key: GGUFKey, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    # a converted Mistral states its window (when it has one) for every layer
    return sliding_fields(key("attention.sliding_window", None), ("sliding",) * layers)


FAMILIES = (Family("llama", hf_model_types=("llama",), gguf_archs=("llama",), hf_fields=_hf_fields,
                   gguf_fields=_gguf_fields, gguf_permuted_qk=True),)
