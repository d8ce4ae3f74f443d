"""Weight loaders: GGUF files and HF safetensors dirs, both yielding ``(canonical name, float32 tensor)``.

Canonical names are HF LLaMA names (``model.layers.{i}.self_attn.q_proj.weight``...); Q/K rows are in the
interleaved RoPE order (GGUF's). The model assembles, fuses and casts them (parrot.engine.models.llama).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from parrot.engine.config import ModelConfig, is_gguf_file
from parrot.engine.loader.gguf_loader import iter_gguf_weights
from parrot.engine.loader.safetensors_loader import iter_safetensors_weights, to_hf_layout, to_interleaved

__all__ = ["iter_weights", "iter_gguf_weights", "iter_safetensors_weights", "to_hf_layout", "to_interleaved"]


def iter_weights(path: str, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Weights of a GGUF file or an HF safetensors dir (``config`` must be ``read_model_config(path)``)."""
    if is_gguf_file(path):
        return iter_gguf_weights(path)
    return iter_safetensors_weights(path, config)
