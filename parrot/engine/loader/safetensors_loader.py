"""Weights of an HF model dir (config.json + *.safetensors, optionally sharded with an index) as float32.

HF stores Q/K rows in the half-split RoPE order; we permute them to the canonical interleaved order (the GGUF
order, see parrot.engine.layers.rotary) exactly as llama.cpp's converter does -- and with them the q/k biases
(Qwen2) and the per-head q/k norm weights (Qwen3, Gemma-3), which live in the same head-dim order. Fused
checkpoint tensors (Phi-3's qkv_proj / gate_up_proj) are split into their canonical parts first. Families whose
norms scale by ``offset + w`` (Gemma: 1 + w) get the offset added, so canonical norm weights are the multiplier.
``to_hf_layout`` is the inverse of the permutation, used to export a model back to an HF dir.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from parrot.engine.files.config import ModelConfig
from parrot.engine.models.registry import family

INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: str) -> list[str]:
    """The safetensors files of the dir: those named by the shard index when there is one, else all."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    return files


def rope_heads(name: str, config: ModelConfig) -> int | None:
    """How many RoPE heads the rows of canonical tensor ``name`` hold (None: not a RoPE'd tensor). A q/k norm
    weight is one head's worth of dims."""
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return config.num_heads
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return config.num_kv_heads
    if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        return 1
    return None


def to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF half-split rows -> interleaved rows, per head (llama.cpp ``permute``)."""
    out_dim = weight.shape[0]
    return (weight.reshape(n_heads, 2, out_dim // n_heads // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def to_hf_layout(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved rows -> HF half-split rows (inverse of :func:`to_interleaved`)."""
    out_dim = weight.shape[0]
    return (weight.reshape(n_heads, out_dim // n_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def split_fused(name: str, tensor, config: ModelConfig) -> list[tuple[str, object]]:
    """A fused checkpoint tensor (Phi-3's ``qkv_proj`` / ``gate_up_proj``; a float tensor or a GGUF QTensor,
    split by whole rows) as its canonical parts; any other tensor as itself."""
    from parrot.engine.models.phi3 import FUSED

    prefix, _, local = name.rpartition("layers.")
    layer, _, local = local.partition(".")
    if not prefix or local not in FUSED:
        return [(name, tensor)]
    sizes = ([config.q_size, config.kv_size, config.kv_size] if local.startswith("self_attn")
             else [config.intermediate_size] * 2)
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"fused weight {name!r} has {tensor.shape[0]} rows, expected {sum(sizes)}")
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    pieces = [tensor[a:b] if isinstance(tensor, torch.Tensor) else tensor.select(slice(a, b))
              for a, b in zip(bounds, bounds[1:])]
    return [(f"{prefix}layers.{layer}.{part}", t) for part, t in zip(FUSED[local], pieces)]


def iter_safetensors_weights(path: str, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, float32 tensor)`` for every weight in the dir, in the canonical layout."""
    offset = family(config.arch).norm_offset
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            for stored in f.keys():
                if stored.endswith("rotary_emb.inv_freq"):  # old checkpoints store the (recomputed) RoPE table
                    continue
                for name, tensor in split_fused(stored, f.get_tensor(stored).float(), config):
                    if offset and name.endswith("norm.weight"):
                        tensor = tensor + offset
                    heads = rope_heads(name, config)
                    if heads is not None:
                        tensor = to_interleaved(tensor, heads)
                    yield name, tensor.contiguous()
