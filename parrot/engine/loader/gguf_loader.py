"""Weights of a GGUF file, dequantized to float32 with the ``gguf`` package, under canonical (HF) names.

GGUF stores a tensor with dims ``ne = [in_features, out_features]`` (fastest first), i.e. numpy shape
``[out, in]`` = the torch ``nn.Linear`` weight layout. llama.cpp's converter permutes the rows of ``attn_q`` /
``attn_k`` within each head from HF's half-split RoPE order to the interleaved order; that interleaved order is
also our canonical layout (see parrot.engine.layers.rotary), so Q/K rows are passed through unchanged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf.quants import dequantize

from parrot.engine.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# tensors that carry no weights of ours (rope_freqs is read into ModelConfig.rope_scaling)
_IGNORED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def canonical_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor; None for tensors we deliberately skip. ValueError for unknown tensors."""
    if gguf_name in _IGNORED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    raise ValueError(f"unsupported tensor {gguf_name!r} in GGUF file (not a plain LLaMA model?)")


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(canonical name, float32 tensor)`` for every weight of the GGUF file, in file order (which is
    layer by layer, so a consumer can finish one layer before the next arrives)."""
    gf = GGUFFile(path)
    for tensor in gf.tensors:
        name = canonical_name(tensor.name)
        if name is None:
            continue
        try:
            array = dequantize(gf.raw(tensor), tensor.qtype)
        except NotImplementedError as exc:
            raise ValueError(f"cannot dequantize {tensor.name} of type {tensor.qtype.name}: {exc}") from exc
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(tensor.shape)
        if not array.flags.writeable:  # F32 tensors are views of the read-only file mapping
            array = array.copy()
        yield name, torch.from_numpy(array)
    logger.debug("read %d tensors from %s", len(gf.tensors), path)
