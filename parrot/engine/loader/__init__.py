"""Weight loaders: GGUF files and HF safetensors dirs, both yielding ``(canonical name, float32 tensor)``.

Canonical names are HF names (``model.layers.{i}.self_attn.q_proj.weight``...); Q/K rows are in the
interleaved RoPE order (LLaMA GGUF's), norm weights are the multiplier (parrot.engine.models.registry). The model
assembles, fuses and casts them (parrot.engine.models.assembly).
"""

from __future__ import annotations

from collections.abc import Iterator

from parrot.engine.files.config import ModelConfig, is_gguf_file
from parrot.engine.loader.gguf_loader import iter_gguf_weights
from parrot.engine.loader.safetensors_loader import iter_safetensors_weights, to_hf_layout, to_interleaved

__all__ = ["iter_weights", "weight_formats", "iter_gguf_weights", "iter_safetensors_weights", "to_hf_layout",
           "to_interleaved"]


def iter_weights(path: str, config: ModelConfig, *, keep_codes: bool = False) -> Iterator[tuple[str, object]]:
    """Weights of a GGUF file or an HF safetensors dir (``config`` must be ``read_model_config(path)``): float32
    tensors, and with ``keep_codes`` a GGUF's natively run matrices as QTensor (parrot.engine.layers.quant)."""
    if is_gguf_file(path):
        return iter_gguf_weights(path, config, keep_codes=keep_codes)
    return iter_safetensors_weights(path, config)


def weight_formats(path: str) -> dict[str, str]:
    """Canonical name -> storage format of each weight of a GGUF file (the ggml type in lower case: "q4_1",
    "q8_0", "f16", ...); empty for a safetensors dir (float weights, no codes to keep)."""
    if not is_gguf_file(path):
        return {}
    from parrot.engine.files.gguf_file import GGUFFile
    from parrot.engine.loader.gguf_loader import canonical_name, gguf_family

    gf = GGUFFile(path)
    family = gguf_family(gf)
    from parrot.engine.models.phi3 import FUSED

    out = {}
    for t in gf.tensors:
        name = canonical_name(t.name, family)
        if name is None:
            continue
        prefix, _, local = name.rpartition(".layers.")
        layer, _, local = local.partition(".")
        for part in FUSED.get(local, (local,)) if prefix else (name,):  # a fused tensor's parts share its format
            out[f"{prefix}.layers.{layer}.{part}" if prefix else name] = t.qtype.name.lower()
    return out
