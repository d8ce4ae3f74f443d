"""Gemma-2 and Gemma-3 (text) families: GeGLU MLP, sqrt(H)-scaled embeddings, norms before *and* after attention
and MLP, (1 + w) RMSNorm weights, local (sliding) and global layers alternating, tied head.

    Gemma-2: every other layer local (layer 0 first); attention scores and final logits soft-capped
             (cap * tanh(x / cap)); attention scale query_pre_attn_scalar ** -0.5.
    Gemma-3: 5 local layers then 1 global (``sliding_window_pattern``); QK-norm instead of soft-capping; local
             layers rotate with their own RoPE base (10k, unscaled), global ones with rope_theta and its scaling.

llama.cpp's GGUF files hold the norm weights as 1 + w and name the pre-MLP norm ``ffn_norm``; the files do not state
the attention scale, which llama.cpp derives from the model size (27B: hidden / heads, else head_dim) -- so do we.
"""

from __future__ import annotations

from parrot.engine.models.registry import Family, hf_layer_types, sliding_fields

_GELU = ("gelu_pytorch_tanh", "gelu_tanh")
_LAYER_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}


def _common(hidden: int, query_scalar: float, window, types: tuple[str, ...]) -> dict:
    return {"hidden_act": "gelu_tanh", "sandwich_norms": True, "embedding_scale": float(hidden) ** 0.5,
            "query_pre_attn_scalar": float(query_scalar), **sliding_fields(window, types)}


def _check_act(hf: dict, arch: str) -> None:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU:
        raise ValueError(f"unsupported hidden activation {act!r} for {arch}; supported: {_GELU}")


def _gemma2_hf(hf: dict, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    _check_act(hf, "gemma2")
    types = hf_layer_types(hf, layers, lambda i: _pattern_types(layers, 2)[i])
    return {**_common(hidden, hf.get("query_pre_attn_scalar") or head_dim, hf.get("sliding_window"), types),
            "attn_logit_softcap": hf.get("attn_logit_softcapping"),
            "final_logit_softcap": hf.get("final_logit_softcapping")}


def _gguf_types(key, layers: int, pattern: int) -> tuple[str, ...]:
    """``attention.sliding_window_pattern`` (an int period, or one bool per layer: true = sliding) when the file
    states it, else llama.cpp's built-in period for the family."""
    raw = key("attention.sliding_window_pattern", None)
    if isinstance(raw, list):
        return tuple("sliding" if flag else "full" for flag in raw)
    return _pattern_types(layers, int(raw) if raw else pattern)


def _pattern_types(layers: int, pattern: int) -> tuple[str, ...]:
    """Every ``pattern``-th layer global, the others local (Gemma-2: 2, Gemma-3: 6)."""
    return tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers))


def _gemma2_gguf(key, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    types = _gguf_types(key, layers, 2)
    scalar = hidden // heads if layers == 46 else head_dim  # llama.cpp: the 27B model scales by hidden / heads
    return {**_common(hidden, scalar, key("attention.sliding_window", None), types),
            "attn_logit_softcap": key("attn_logit_softcapping", None),
            "final_logit_softcap": key("final_logit_softcapping", None)}


def _gemma3_hf(hf: dict, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    _check_act(hf, "gemma3")
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    types = hf_layer_types(hf, layers, lambda i: _pattern_types(layers, pattern)[i])
    local = ((hf.get("rope_parameters") or {}).get("sliding_attention") or {}).get("rope_theta")
    out = _common(hidden, hf.get("query_pre_attn_scalar") or head_dim, hf.get("sliding_window"), types)
    return {**out, "qk_norm": True, "attn_logit_softcap": hf.get("attn_logit_softcapping"),
            "final_logit_softcap": hf.get("final_logit_softcapping"),
            "local_rope_theta": float(hf.get("rope_local_base_freq") or local or 10000.0)}


def _gemma3_gguf(key, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    scalar = hidden // heads if layers == 62 else head_dim  # llama.cpp: the 27B model scales by hidden / heads
    out = _common(hidden, scalar, key("attention.sliding_window", None), _gguf_types(key, layers, 6))
    return {**out, "qk_norm": True, "local_rope_theta": float(key("rope.freq_base_swa", 10000.0))}


FAMILIES = (
    Family("gemma2", hf_model_types=("gemma2",), gguf_archs=("gemma2",), hf_fields=_gemma2_hf,
           gguf_fields=_gemma2_gguf, norm_offset=1.0, tied_by_default=True, gguf_layer_names=_LAYER_NAMES),
    Family("gemma3", hf_model_types=("gemma3_text",), gguf_archs=("gemma3",), hf_fields=_gemma3_hf,
           gguf_fields=_gemma3_gguf, norm_offset=1.0, tied_by_default=True, gguf_layer_names=_LAYER_NAMES),
)
