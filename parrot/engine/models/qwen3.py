"""Qwen3 family (dense): LLaMA with a per-head RMSNorm of q and k before RoPE (QK-norm) and no QKV bias.

The q / k norm weights are [head_dim]; like the Q/K rows they are stored in the interleaved RoPE order (the loaders
permute them), so the norm and the rotation see one consistent head layout.
"""

from __future__ import annotations

from parrot.engine.models.qwen2 import qwen_sliding
from parrot.engine.models.registry import Family, silu_only


def _hf_fields(hf: dict, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    silu_only(hf, "qwen3")
    if hf.get("attention_bias"):  # would bias o_proj too
        raise ValueError("Qwen3 configs with attention_bias are not supported")
    return {"qk_norm": True, **qwen_sliding(hf, layers)}


def _gguf_fields(key, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    return {"qk_norm": True}


FAMILIES = (Family("qwen3", hf_model_types=("qwen3",), gguf_archs=("qwen3",), hf_fields=_hf_fields,
                   gguf_fields=_gguf_fields),)
