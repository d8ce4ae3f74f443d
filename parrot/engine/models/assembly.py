"""Assembling a model from canonical weights (any family): fuse each layer's parts, cast, pick matmul paths.

Weights arrive as ``(canonical name, float32 tensor)`` pairs in any order (parrot.engine.loader); a layer's fused
matmul is built as soon as its parts have all arrived, so only a few float32 tensors are alive at a time. The parts
a layer takes follow its ModelConfig (the family features of parrot.engine.models.registry):

    canonical per-layer name                 part            families
    self_attn.{q,k,v}_proj.weight            qkv_proj        all
    self_attn.{q,k,v}_proj.bias              qkv_bias        attention_bias (Qwen2)
    self_attn.{q,k}_norm.weight              qk_norm         qk_norm (Qwen3, Gemma-3)
    mlp.{gate,up}_proj.weight                gate_up_proj    all
    input_layernorm.weight                   input_norm      all
    post_attention_layernorm.weight          post_norm       all but Gemma (the norm before the MLP)
    pre_feedforward_layernorm.weight         post_norm       Gemma (sandwich_norms) ...
    post_attention_layernorm.weight          attn_out_norm   ... where this one norms the attention output
    post_feedforward_layernorm.weight        ffn_out_norm    Gemma
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from parrot.engine.files.config import ModelConfig, is_gguf_file, read_model_config
from parrot.engine.layers.int4 import int4_kernel_available
from parrot.engine.layers.int8 import int8_compute_dtype, int8_kernel_available
from parrot.engine.layers.linear import WEIGHT_QUANTS, Conversions, Linear, MatmulKernels, make_linear
from parrot.engine.layers.quant import DenseEmbedding, Embedding, QTensor, QuantEmbedding, QuantWeight, packable
from parrot.engine.loader import iter_weights, weight_formats
from parrot.engine.loader import pack_cache
from parrot.engine.loader.pack_cache import PackCache
from parrot.engine.files.model_files import resolve_model_path
from parrot.engine.models.decoder import CausalLM, DecoderLayer

logger = logging.getLogger(__name__)

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MATMULS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_TABLE = "model.embed_tokens.weight#table"  # an untied quantized token table's entry in a PackCache


def layer_parts(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """Canonical per-layer name -> (part, index within the part) for ``cfg``'s family features; fused parts are
    concatenated along rows in index order."""
    parts = {
        "self_attn.q_proj.weight": ("qkv_proj", 0), "self_attn.k_proj.weight": ("qkv_proj", 1),
        "self_attn.v_proj.weight": ("qkv_proj", 2), "self_attn.o_proj.weight": ("o_proj", 0),
        "mlp.gate_proj.weight": ("gate_up_proj", 0), "mlp.up_proj.weight": ("gate_up_proj", 1),
        "mlp.down_proj.weight": ("down_proj", 0), "input_layernorm.weight": ("input_norm", 0),
    }
    if cfg.sandwich_norms:
        parts |= {"post_attention_layernorm.weight": ("attn_out_norm", 0),
                  "pre_feedforward_layernorm.weight": ("post_norm", 0),
                  "post_feedforward_layernorm.weight": ("ffn_out_norm", 0)}
    else:
        parts["post_attention_layernorm.weight"] = ("post_norm", 0)
    if cfg.attention_bias:
        parts |= {f"self_attn.{p}_proj.bias": ("qkv_bias", i) for i, p in enumerate("qkv")}
    if cfg.qk_norm:
        parts |= {"self_attn.q_norm.weight": ("qk_norm", 0), "self_attn.k_norm.weight": ("qk_norm", 1)}
    return parts


def _part_sizes(parts: Mapping[str, tuple[str, int]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for part, idx in parts.values():
        sizes[part] = max(sizes.get(part, 0), idx + 1)
    return sizes


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "self_attn.q_proj.weight": (cfg.q_size, h), "self_attn.k_proj.weight": (cfg.kv_size, h),
        "self_attn.v_proj.weight": (cfg.kv_size, h), "self_attn.o_proj.weight": (h, cfg.q_size),
        "self_attn.q_proj.bias": (cfg.q_size,), "self_attn.k_proj.bias": (cfg.kv_size,),
        "self_attn.v_proj.bias": (cfg.kv_size,),
        "self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,),
        "model.embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }


def _embedding(table: Tensor | QTensor, lm_head: Linear, tied: bool, kernels: MatmulKernels, weight_quant: str,
               device, dtype: torch.dtype, cache: PackCache | None) -> Embedding:
    """The token table: the tied head's packed codes, or the file's quantized token_embd packed on its own, where
    the quantized kernels run (no dense copy); else dense in the compute dtype."""
    head = lm_head.path
    if tied and isinstance(head, QuantWeight):
        return QuantEmbedding(head.packed, head.kernel.ops, dtype)
    if (isinstance(table, QTensor) and kernels.quant is not None and weight_quant != "none"
            and packable(table.shape, table.fmt)):
        packed = cache.get(_TABLE) if cache is not None else None
        if packed is None:
            packed = kernels.quant.pack([table])
            if cache is not None:
                cache.put(_TABLE, packed)
        return QuantEmbedding(packed, kernels.quant.ops, dtype)
    dense = table.dequantize() if isinstance(table, QTensor) else table
    return DenseEmbedding(dense.to(device=device, dtype=dtype))


def _float_part(cfg: ModelConfig, part: str, ws: list[Tensor], device, dtype: torch.dtype) -> Tensor:
    if part == "qkv_bias":  # added to the matmul's output, so in the compute dtype
        return torch.cat(ws).to(device=device, dtype=dtype)
    if part == "qk_norm":  # one row per q head, then one per kv head: [num_heads + num_kv_heads, head_dim]
        q, k = ws
        return torch.cat([q.expand(cfg.num_heads, -1), k.expand(cfg.num_kv_heads, -1)]).to(device, torch.float32)
    return ws[0].to(device=device, dtype=torch.float32)


def assemble_model(config: ModelConfig, weights: Iterable[tuple[str, Tensor | QTensor]], *, dtype: torch.dtype,
                   device: str | torch.device = "cpu", weight_quant: str = "none",
                   kernels: MatmulKernels | None = None, formats: Mapping[str, str] | None = None,
                   cache: PackCache | None = None) -> CausalLM:
    """Build the model from ``(canonical name, tensor)`` pairs in any order: float tensors, and GGUF matrices in
    their file codes (QTensor) where the loader kept them.

    ``kernels``: the matmul kernels the layers may run (the engine's NumericsPlan: MatmulKernels from
    parrot.engine.runtime.numerics; None = everything this machine runs). ``weight_quant`` is the rule of
    parrot.engine.layers.linear ("auto": each matrix as its file stores it where a kernel reads that format);
    ``formats`` (canonical name -> GGUF format) names where dequantized floats came from, for the log of what
    was converted. The output head keeps the file's format ("int4" makes it Q8_0, not 4-bit: a 4-bit head flips
    borderline greedy tokens); a tied head's codes serve the embedding lookups too. ``cache``: packed weights
    from an earlier load of the same file (parrot.engine.loader.pack_cache), by canonical name."""
    if weight_quant not in (*WEIGHT_QUANTS, "auto"):
        raise ValueError(f"weight_quant must be one of {(*WEIGHT_QUANTS, 'auto')}, got {weight_quant!r}")
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
    kernels = kernels if kernels is not None else MatmulKernels.available(device, dtype)
    if torch.device(device).type != "cpu" and any(k is not None for k in (kernels.vnni, kernels.quant)):
        raise ValueError(f"the native matmul kernels run on the CPU, not on {device!r}")
    formats = formats or {}
    conversions = Conversions()
    shapes = _expected_shapes(config)
    table = layer_parts(config)
    sizes = _part_sizes(table)
    pending: dict[tuple[int, str], dict[int, tuple[str, Tensor | QTensor]]] = {}
    parts: list[dict[str, Tensor | Linear]] = [{} for _ in range(config.num_layers)]
    globals_: dict[str, Tensor | QTensor] = {}

    def linear(named: list[tuple[str, Tensor | QTensor]], quant: str) -> Linear:
        ws = [w if isinstance(w, QTensor) else w.to(device) for _, w in named]
        return make_linear(ws, dtype=dtype, quant=quant, kernels=kernels, name=named[0][0], conversions=conversions,
                           sources=[formats.get(n) for n, _ in named], cache=cache)

    for name, tensor in weights:
        if name.startswith("model.layers."):
            idx_str, _, local = name[len("model.layers."):].partition(".")
            layer = int(idx_str)
            if local not in table or not 0 <= layer < config.num_layers:
                raise ValueError(f"unexpected weight {name!r} for a {config.num_layers}-layer {config.arch} model")
        elif name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            layer, local = -1, name
        else:
            raise ValueError(f"unexpected weight {name!r}")
        if tuple(tensor.shape) != shapes[local]:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {shapes[local]}")
        if layer < 0:
            globals_[name] = tensor
            continue
        part, slot = table[local]
        group = pending.setdefault((layer, part), {})
        group[slot] = (name, tensor)
        if len(group) == sizes[part]:
            del pending[(layer, part)]
            named = [group[s] for s in range(len(group))]
            parts[layer][part] = (linear(named, weight_quant) if part in _MATMULS
                                  else _float_part(config, part, [w for _, w in named], device, dtype))

    missing = [f"layer {i}: {sorted(set(sizes) - set(p))}" for i, p in enumerate(parts) if len(p) < len(sizes)]
    for required in ("model.embed_tokens.weight", "model.norm.weight"):
        if required not in globals_:
            missing.append(required)
    if not config.tie_word_embeddings and "lm_head.weight" not in globals_:
        missing.append("lm_head.weight")
    if missing:
        raise ValueError(f"model weights incomplete, missing: {missing}")

    tied = config.tie_word_embeddings
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    lm_head = linear([(head_name, globals_[head_name])], "int8" if weight_quant == "int4" else weight_quant)
    embedding = _embedding(globals_["model.embed_tokens.weight"], lm_head, tied, kernels, weight_quant, device, dtype,
                           cache)
    conversions.log(config.name)
    layers = [DecoderLayer(config, i, **p) for i, p in enumerate(parts)]
    norm = globals_["model.norm.weight"]
    return CausalLM(config, embedding=embedding, layers=layers, norm=norm.to(device=device, dtype=torch.float32),
                    lm_head=lm_head)


def load_model(path: str, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
               weight_quant: str = "none", kernels: MatmulKernels | None = None,
               pack_cache_dir: str | None = None, save_cache: bool = True) -> CausalLM:
    """Load a GGUF file or an HF safetensors dir of any supported family. ``weight_quant``: "none", "int8", "int4"
    or "auto" (see :func:`assemble_model`, which also explains ``kernels``). With the quantized kernels, a GGUF's
    matrices are read as the file stores them (mapped, never dequantized), and with ``pack_cache_dir`` their
    packed form is read from a file there if an earlier load left one, else written there before returning (or,
    with ``save_cache=False``, left to the caller: ``model.pack_cache.save()``; parrot.engine.loader.pack_cache).
    Raises ValueError for a bad option or unsupported model (an unknown architecture is named), ModelNotFound for
    a missing path."""
    if weight_quant not in (*WEIGHT_QUANTS, "auto"):
        raise ValueError(f"weight_quant must be one of {(*WEIGHT_QUANTS, 'auto')}, got {weight_quant!r}")
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
    kernels = kernels if kernels is not None else MatmulKernels.available(device, dtype)
    torch_quant = kernels.quant is None  # with it, the quantized kernel runs every quantized layer, not torch's
    if torch_quant and weight_quant == "int8" and not int8_kernel_available(device, int8_compute_dtype(dtype)):
        raise ValueError(f"weight_quant='int8' needs torch.ops.aten._weight_int8pack_mm for {dtype} on {device!r}")
    if torch_quant and weight_quant == "int4" and not int4_kernel_available(device, dtype):
        raise ValueError(f"weight_quant='int4' needs torch._weight_int4pack_mm_for_cpu with bfloat16 on the CPU, "
                         f"not {dtype} on {device!r}")
    path = resolve_model_path(path)
    start = time.perf_counter()
    config = read_model_config(path)
    keep_codes = kernels.quant is not None and weight_quant != "none"
    cache = _pack_cache(path, pack_cache_dir, dtype, weight_quant) if keep_codes and is_gguf_file(path) else None
    model = assemble_model(config, iter_weights(path, config, keep_codes=keep_codes), dtype=dtype, device=device,
                           weight_quant=weight_quant, kernels=kernels, formats=weight_formats(path), cache=cache)
    model.pack_cache = cache
    if cache is not None and save_cache:
        cache.save()
    logger.info("loaded %s (%s, %d layers, %s, quant=%s) from %s in %.1f s", config.name, config.arch,
                config.num_layers, dtype, weight_quant, path, time.perf_counter() - start)
    return model


def _pack_cache(path: str, directory: str | None, dtype: torch.dtype, weight_quant: str) -> PackCache | None:
    if directory is None:
        return None
    from parrot.engine.kernels import library_path

    return pack_cache.for_model(directory, path, library_path().name, f"{dtype}|{weight_quant}")


def random_weights(config: ModelConfig, *, seed: int = 0) -> dict[str, Tensor]:
    """Random float32 weights under canonical names (std 0.02 like HF's init; norms near 1, biases near 0)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = _expected_shapes(config)
    out: dict[str, Tensor] = {}

    def draw(shape: tuple[int, ...], norm: bool) -> Tensor:
        noise = torch.randn(shape, generator=gen)
        return 1.0 + 0.1 * noise if norm else 0.02 * noise

    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        out[name] = draw(shapes[name], name.endswith("norm.weight"))
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = draw(shapes["lm_head.weight"], False)
    for i in range(config.num_layers):
        for local in layer_parts(config):
            out[f"model.layers.{i}.{local}"] = draw(shapes[local], local.endswith("norm.weight"))
    return out


def build_random_model(config: ModelConfig, *, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
                       weight_quant: str = "none", kernels: MatmulKernels | None = None) -> CausalLM:
    """A model with random weights (tests, benchmarks); deterministic for a given seed."""
    return assemble_model(config, random_weights(config, seed=seed).items(), dtype=dtype, device=device,
                          weight_quant=weight_quant, kernels=kernels)
