"""Weights of a GGUF file under canonical (HF) names: float32 (dequantized with the ``gguf`` package), or, with
``keep_codes``, the matrices in a format the quantized kernels read as :class:`QTensor` (the file's bytes, a view of
its mapping: no float round trip).

GGUF stores a tensor with dims ``ne = [in_features, out_features]`` (fastest first), i.e. numpy shape
``[out, in]`` = the torch ``nn.Linear`` weight layout. llama.cpp's converter permutes the rows of ``attn_q`` /
``attn_k`` within each head from HF's half-split RoPE order to the interleaved order for LLaMA (and Mistral)
files only; that interleaved order is also our canonical layout (see parrot.engine.layers.rotary), so their Q/K rows
pass through unchanged, while the other families' files (Qwen, Gemma: llama.cpp's "NEOX" RoPE) keep HF's order
and are permuted here like a safetensors dir (rows, biases and q/k-norm weights alike). Gemma files already store
norm weights as the 1 + w multiplier, which is canonical; Phi-3's fused attn_qkv / ffn_up are split into parts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf.quants import dequantize

from parrot.engine.files.config import ModelConfig
from parrot.engine.files.gguf_file import GGUFFile, GGUFTensorInfo
from parrot.engine.layers.quant import NATIVE_FORMATS, QTensor
from parrot.engine.loader.safetensors_loader import rope_heads, split_fused, to_interleaved
from parrot.engine.models.registry import Family, family_for_gguf

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# tensors that carry no weights of ours (RoPE factors are read into ModelConfig.rope_scaling)
_IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def canonical_name(gguf_name: str, family: Family | None = None) -> str | None:
    """HF name of a GGUF tensor of ``family`` (default: LLaMA's names); None for tensors we deliberately skip.
    ValueError for unknown tensors."""
    if gguf_name in _IGNORED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = LAYER_NAMES if family is None else {**LAYER_NAMES, **family.gguf_layer_names}
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    arch = "llama" if family is None else family.arch
    raise ValueError(f"unsupported tensor {gguf_name!r} in GGUF file (not a plain {arch} model?)")


def gguf_family(gf: GGUFFile) -> Family:
    return family_for_gguf(gf.get("general.architecture"))


def _as_qtensor(gf: GGUFFile, info: GGUFTensorInfo) -> QTensor | None:
    """The tensor as the file stores it, when it is a matrix in a natively run format (else None)."""
    fmt = info.qtype.name.lower()
    if len(info.shape) != 2 or fmt not in NATIVE_FORMATS:
        return None
    return QTensor(fmt, torch.from_numpy(gf.raw(info)), (info.shape[0], info.shape[1]))


def _float(gf: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    try:
        array = dequantize(gf.raw(info), info.qtype)
    except NotImplementedError as exc:
        raise ValueError(f"cannot dequantize {info.name} of type {info.qtype.name}: {exc}") from exc
    # a copy: an F32 tensor's "dequantization" is a view of the mapping, which the model must not keep
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True).reshape(info.shape))


def _rows_interleaved(t: torch.Tensor | QTensor, heads: int) -> torch.Tensor | QTensor:
    """Q/K rows (and biases) from HF's half-split RoPE order to the interleaved one; a QTensor's whole rows move."""
    if isinstance(t, QTensor):
        return t.select(to_interleaved(torch.arange(t.shape[0]), heads))
    return to_interleaved(t, heads).contiguous()


def iter_gguf_weights(path: str, config: ModelConfig | None = None, *,
                      keep_codes: bool = False) -> Iterator[tuple[str, torch.Tensor | QTensor]]:
    """Yield ``(canonical name, tensor)`` for every weight of the GGUF file, in file order (which is layer by layer,
    so a consumer can finish one layer before the next arrives): float32 tensors, or with ``keep_codes`` a
    QTensor for each matrix in a format of NATIVE_FORMATS. A quantized matrix in another format is dequantized
    (logged once per format). ``config``: the file's ModelConfig (read from the file when None)."""
    gf = GGUFFile(path)
    family = gguf_family(gf)
    if config is None:
        from parrot.engine.files.config import config_from_gguf

        config = config_from_gguf(gf)
    no_kernel: dict[str, list[str]] = {}
    for tensor in gf.tensors:
        name = canonical_name(tensor.name, family)
        if name is None:
            continue
        coded = _as_qtensor(gf, tensor) if keep_codes else None
        if coded is None and keep_codes and len(tensor.shape) == 2 and tensor.qtype.name.lower() not in (
                "f32", "f16", "bf16", "f64"):
            no_kernel.setdefault(tensor.qtype.name, []).append(tensor.name)
        value = coded if coded is not None else _float(gf, tensor)
        for part, out in split_fused(name, value, config):
            heads = None if family.gguf_permuted_qk else rope_heads(part, config)
            yield part, (out if heads is None else _rows_interleaved(out, heads))
        gf.release(tensor)  # consumed (or copied by the consumer): its pages leave the resident set
    for qtype, names in no_kernel.items():
        logger.warning("%s: %d tensor(s) in %s, which has no native kernel (e.g. %s): dequantized to float32, "
                       "then run as the load's weight rule says (logged there)", path, len(names), qtype, names[0])
    logger.debug("read %d tensors from %s", len(gf.tensors), path)
