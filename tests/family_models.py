"""Tiny random-weight models of each supported family, built with HF transformers from the family's real config
shape (scaled down), saved as an HF safetensors dir and as a GGUF file written like llama.cpp's converter (the
``gguf`` package's tensor-name map, LLaMA's Q/K permutation, Gemma's 1 + w norms), plus reference helpers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class FamilySpec:
    """A family's test model: the HF ``model_type`` and config (a real checkpoint's shape, scaled down), the
    GGUF architecture llama.cpp writes it as, and the ModelConfig features our reader must find."""

    model_type: str
    gguf_arch: str
    hf: dict
    features: dict = field(default_factory=dict)
    attn_implementation: str = "sdpa"
    norm_base: float = 1.0  # random norm weights around this (Gemma's HF norms hold w of 1 + w: around 0)


_COMMON = dict(vocab_size=320, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES: dict[str, FamilySpec] = {
    # Qwen2.5-0.5B: 14 heads / 2 KV heads (7:1), head_dim 64, QKV bias, tied embeddings, theta 1e6
    "qwen2": FamilySpec("qwen2", "qwen2", dict(
        _COMMON, hidden_size=112, intermediate_size=160, num_hidden_layers=2, num_attention_heads=7,
        num_key_value_heads=1, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        features=dict(attention_bias=True, tie_word_embeddings=True, num_heads=7, num_kv_heads=1, head_dim=16)),
    # Qwen3-0.6B: 16 / 8 heads, head_dim 128 > hidden / heads, QK-norm, tied
    "qwen3": FamilySpec("qwen3", "qwen3", dict(
        _COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        features=dict(qk_norm=True, tie_word_embeddings=True, head_dim=32)),
    # Mistral-7B-v0.1: 32 / 8 heads (4:1), head_dim 128, sliding window 4096 on every layer (here 8 tokens)
    "mistral": FamilySpec("mistral", "llama", dict(
        _COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        features=dict(sliding_window=8, layer_types=("sliding", "sliding"))),
    # Gemma-2-2B: 8 / 4 heads, head_dim 256 = query_pre_attn_scalar, window 4096 on even layers, soft-caps 50 / 30
    "gemma2": FamilySpec("gemma2", "gemma2", dict(
        _COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, rms_norm_eps=1e-6, sliding_window=8,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        features=dict(sandwich_norms=True, hidden_act="gelu_tanh", embedding_scale=8.0, attn_logit_softcap=50.0,
                      final_logit_softcap=30.0, sliding_window=8, layer_types=("sliding", "full"),
                      tie_word_embeddings=True),
        attn_implementation="eager", norm_base=0.0),
    # Gemma-3-1B: 4 / 1 heads, head_dim 256, window 512, 5 local : 1 global, local RoPE 1e4, global 1e6, QK-norm
    "gemma3": FamilySpec("gemma3_text", "gemma3", dict(
        _COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, rms_norm_eps=1e-6, sliding_window=8,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        features=dict(sandwich_norms=True, qk_norm=True, hidden_act="gelu_tanh", local_rope_theta=10000.0,
                      rope_theta=1000000.0, sliding_window=8, layer_types=("sliding",) * 5 + ("full",)),
        norm_base=0.0),
    # Phi-3-mini-128k: 32 / 32 heads (MHA), head_dim 96, fused qkv / gate_up checkpoints, LongRoPE (original 4k)
    "phi3": FamilySpec("phi3", "phi3", dict(
        _COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=12,
        original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0],
                         "long_factor": [1.0, 1.3, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0]}),
        features=dict(sliding_window=12, layer_types=("sliding", "sliding"))),
}


def hf_model(name: str, seed: int = 0, **overrides):
    """The family's tiny HF model in fp32 with every weight random (biases and norms too, so each feature
    matters); ``overrides`` change its config (e.g. vocab_size)."""
    import transformers

    spec = FAMILIES[name]
    cfg = transformers.AutoConfig.for_model(spec.model_type, **{**spec.hf, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                           attn_implementation=spec.attn_implementation)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if pname.endswith("norm.weight"):
                p.copy_(spec.norm_base + 0.1 * noise)
            elif pname.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.05 * noise)
    return model.eval()


def save_hf_dir(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def write_gguf(name: str, model, path: Path) -> Path:
    """The model as an F32 GGUF file, as llama.cpp's converter writes it (metadata keys, tensor names, LLaMA's
    Q/K row permutation, Gemma's norms stored as 1 + w)."""
    import gguf

    from parrot.engine.loader import to_interleaved

    spec = FAMILIES[name]
    cfg = model.config
    arch = spec.gguf_arch
    tmap = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                    cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{name}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(float((rope.get("full_attention") or rope)["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None) and "sliding_window" in spec.features:
        writer.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if getattr(cfg, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if rope.get("rope_type") == "longrope":  # llama.cpp's Phi3MiniModel: the factors as tensors
        orig = cfg.original_max_position_embeddings
        factor = cfg.max_position_embeddings / orig
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(orig)))
        writer.add_rope_scaling_orig_ctx_len(orig)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.add_uint32("tokenizer.ggml.bos_token_id", cfg.bos_token_id)
    writer.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_id)
    n_kv = cfg.num_key_value_heads
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name
        t = tensor.float()
        if arch == "llama" and ("q_proj" in hf_name or "k_proj" in hf_name):  # llama.cpp's LlamaModel.permute
            t = to_interleaved(t, cfg.num_attention_heads if "q_proj" in hf_name else n_kv)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):  # llama.cpp's Gemma converters
            t = t + 1
        writer.add_tensor(gname, np.ascontiguousarray(t.numpy(), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers' generate (with its KV cache), never stopping at EOS."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


class ReferenceAttention:
    """Attention backend for one sequence at positions 0..T-1 (the model's own per-layer window, soft-cap and
    scale), written out plainly: scores, cap, causal + window mask, fp32 softmax."""

    def __init__(self, model) -> None:
        self.layers = model.attention_layers
        self.scale = model.config.attention_scale

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spec = self.layers[layer_idx]
        t, h, _ = q.shape
        group = h // k.shape[1]
        qh, kh, vh = q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1), \
            v.repeat_interleave(group, 1).transpose(0, 1)
        scores = qh @ kh.transpose(1, 2) * self.scale
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        pos = torch.arange(t)
        keep = pos[None, :] <= pos[:, None]
        if spec.window is not None:
            keep &= pos[None, :] > pos[:, None] - spec.window
        probs = F.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1, dtype=torch.float32)
        return (probs.to(q.dtype) @ vh).transpose(0, 1).reshape(t, -1)


def our_logits(model, ids: list[int]) -> torch.Tensor:
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), ReferenceAttention(model)))


def word_tokenizer(vocab_size: int, eos: int = 2):
    """A word-level tokenizer over ``vocab_size`` ids (t0, t1, ...) for engine tests that run token ids."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from parrot.engine.files.tokenizer import Tokenizer

    vocab = {f"t{i}": i for i in range(vocab_size)}
    return Tokenizer(Backend(models.WordLevel(vocab, unk_token="t0")), bos_token_id=None, eos_token_ids=(eos,),
                     chat_template=None, add_bos=False, byte_level=False)


def dump_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
