"""Weights of an HF model dir (config.json + *.safetensors, optionally sharded with an index) as float32.

HF stores Q/K rows in the half-split RoPE order; we permute them to the canonical interleaved order (the GGUF
order, see parrot.engine.layers.rotary) exactly as llama.cpp's converter does. ``to_hf_layout`` is the inverse,
used to export a model back to an HF dir.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from parrot.engine.config import ModelConfig

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


def _heads_for(name: str, config: ModelConfig) -> int | None:
    if name.endswith("self_attn.q_proj.weight"):
        return config.num_heads
    if name.endswith("self_attn.k_proj.weight"):
        return config.num_kv_heads
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


def iter_safetensors_weights(path: str, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, float32 tensor)`` for every weight in the dir, Q/K rows in the interleaved order."""
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # old checkpoints store the (recomputed) RoPE table
                    continue
                tensor = f.get_tensor(name).float()
                heads = _heads_for(name, config)
                if heads is not None:
                    tensor = to_interleaved(tensor, heads).contiguous()
                yield name, tensor
