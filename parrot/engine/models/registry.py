"""Model families: what each architecture adds to the shared decoder, as data (no torch; config.py reads it).

A family module (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma``, ``phi3``) defines its :class:`Family`:
the names it answers to (HF ``model_type``, GGUF ``general.architecture``), its ModelConfig fields from config.json and
from GGUF keys, and how its checkpoints differ from canonical weights. The shared decoder
(parrot.engine.models.decoder) runs every family from the ModelConfig fields alone, so a family never copies it:

    feature                         ModelConfig field                   families
    QKV bias                        attention_bias                      Qwen2
    per-head RMSNorm of q, k        qk_norm                             Qwen3, Gemma-3
    sliding-window layers           sliding_window + layer_types        Mistral, Qwen2/3 (opt-in), Gemma-2/3
    GeGLU MLP                       hidden_act = "gelu_tanh"            Gemma-2/3
    norms on attn / MLP outputs     sandwich_norms                      Gemma-2/3
    sqrt(H) embedding scale         embedding_scale                     Gemma-2/3
    attention / logit soft-capping  attn_logit_softcap, final_...       Gemma-2
    local RoPE base                 local_rope_theta                    Gemma-3
    LongRoPE                        rope_scaling type "longrope"        Phi-3 (fused qkv / gate_up checkpoints)

Canonical weights (what loaders yield, parrot.engine.loader) are HF names with Q/K rows (and their biases and
q/k-norm weights) in the interleaved RoPE order, and norm weights as the multiplier itself (Gemma's HF norms hold
``w`` for a ``1 + w`` multiplier; its GGUF files already hold ``1 + w``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# key(name, default) -> the GGUF value of "{arch}.{name}"
GGUFKey = Callable[[str, Any], Any]
# (config.json | GGUF key, num_layers, hidden, heads, head_dim) -> family-specific ModelConfig fields
HFFields = Callable[[dict, int, int, int, int], dict]
GGUFFields = Callable[[GGUFKey, int, int, int, int], dict]


@dataclass(frozen=True)
class Family:
    arch: str  # ModelConfig.arch
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    hf_fields: HFFields
    gguf_fields: GGUFFields
    # llama.cpp permutes Q/K rows into the interleaved order only for LLaMA; other families keep HF's order
    gguf_permuted_qk: bool = False
    norm_offset: float = 0.0  # HF norm weights w scale by (norm_offset + w); GGUF files store the sum
    tied_by_default: bool = False  # config.json without tie_word_embeddings
    # GGUF layer tensor names beside the shared ones (gguf_loader.LAYER_NAMES) or overriding them
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)


def silu_only(hf: dict, arch: str) -> None:
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} for {arch}; only 'silu' (SwiGLU) is supported")


def hf_layer_types(hf: dict, num_layers: int, default: Callable[[int], str]) -> tuple[str, ...]:
    """config.json's ``layer_types`` ("full_attention" / "sliding_attention") normalized to "full" / "sliding",
    or ``default(layer)`` per layer when the file has none."""
    raw = hf.get("layer_types")
    if raw is None:
        return tuple(default(i) for i in range(num_layers))
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    unknown = [t for t in raw if t not in names]
    if unknown:
        raise ValueError(f"unsupported layer_types {sorted(set(unknown))} in config.json; supported: {list(names)}")
    return tuple(names[t] for t in raw)


def sliding_fields(window: Any, types: tuple[str, ...]) -> dict:
    """ModelConfig fields of a window and per-layer types; no window (or no sliding layer) means full attention."""
    if not window or "sliding" not in types:
        return {}
    return {"sliding_window": int(window), "layer_types": types}


def _families() -> dict[str, Family]:
    from parrot.engine.models import gemma, llama, mistral, phi3, qwen2, qwen3

    out: dict[str, Family] = {}
    for fams in (llama.FAMILIES, mistral.FAMILIES, qwen2.FAMILIES, qwen3.FAMILIES, gemma.FAMILIES, phi3.FAMILIES):
        for fam in fams:
            out[fam.arch] = fam
    return out


FAMILIES: dict[str, Family] = _families()


def family(arch: str) -> Family:
    """The family of ``ModelConfig.arch``; ValueError naming an unknown one."""
    if arch not in FAMILIES:
        raise ValueError(f"unsupported model architecture {arch!r}; supported: {tuple(FAMILIES)}")
    return FAMILIES[arch]


def family_for_hf(model_type: str) -> Family:
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    known = sorted(t for fam in FAMILIES.values() for t in fam.hf_model_types)
    raise ValueError(f"unsupported model_type {model_type!r} in config.json; supported: {known}")


def family_for_gguf(arch: Any) -> Family:
    for fam in FAMILIES.values():
        if arch in fam.gguf_archs:
            return fam
    known = sorted(a for fam in FAMILIES.values() for a in fam.gguf_archs)
    raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {known}")
