"""Phi-3 family (Phi-3 / Phi-3.5 mini and medium): LLaMA whose checkpoints fuse q/k/v into one ``qkv_proj`` and
gate/up into one ``gate_up_proj`` (split back into canonical parts by the loaders; the decoder fuses them anyway),
with LongRoPE scaling in the long-context variants and a sliding window where the config states one (every layer).

LongRoPE: ``rope_scaling`` {type "longrope" (older files: "su"), short_factor, long_factor} with the config's
top-level ``original_max_position_embeddings``; the cos/sin factor is sqrt(1 + ln(s) / ln(original)) for
s = max_position_embeddings / original unless the file states one (transformers' rule). GGUF files carry the
factors as ``rope_factors_long`` / ``rope_factors_short`` tensors (read in config.py).
"""

from __future__ import annotations

import math

from parrot.engine.models.registry import Family, hf_layer_types, silu_only, sliding_fields

# fused checkpoint tensors: HF (and the GGUF names they map to) -> the canonical parts, in row order
FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                       "self_attn.v_proj.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def _longrope(hf: dict) -> dict | None:
    raw = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("longrope", "su"):
        raise ValueError(f"unsupported rope scaling type {kind!r} for phi3; supported: 'longrope'")
    orig = int(raw.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
    factor = raw.get("factor") or hf["max_position_embeddings"] / orig
    attention = raw.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return {"type": "longrope", "short_factor": tuple(float(x) for x in raw["short_factor"]),
            "long_factor": tuple(float(x) for x in raw["long_factor"]), "original_max_position_embeddings": orig,
            "attention_factor": float(attention)}


def _hf_fields(hf: dict, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    silu_only(hf, "phi3")
    partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ValueError(f"phi3 configs with partial_rotary_factor {partial} are not supported (only 1.0)")
    return {"rope_scaling": _longrope(hf),
            **sliding_fields(hf.get("sliding_window"), hf_layer_types(hf, layers, lambda i: "sliding"))}


def _gguf_fields(key, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    return sliding_fields(key("attention.sliding_window", None), ("sliding",) * layers)


FAMILIES = (Family("phi3", hf_model_types=("phi3",), gguf_archs=("phi3",), hf_fields=_hf_fields,
                   gguf_fields=_gguf_fields, gguf_layer_names={"attn_qkv": "self_attn.qkv_proj",
                                                               "ffn_up": "mlp.gate_up_proj"}),)
