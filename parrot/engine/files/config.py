"""The model's architecture hyper-parameters (:class:`ModelConfig`), read from a GGUF file or an HF dir (no torch).

Both sources are normalized to one shape, so the model and the runner never look at file formats:

    GGUF  : general.architecture + ``{arch}.*`` keys, tokenizer.ggml.* special ids, tensor names
    HF dir: config.json (+ generation_config.json for extra EOS ids)

The model family (parrot.engine.models.registry: one small module per family) is chosen from
``general.architecture`` / ``model_type``; it adds its own fields (QKV bias, QK-norm, sliding windows, soft-caps,
...) on top of the common ones read here. An architecture no family claims fails here, naming it.

RoPE scaling is normalized to a small dict ``{"type": ..., <parameters>}`` whose types are
``linear`` (positions divided by ``factor``), ``llama3`` (Llama 3.1 frequency smoothing), ``yarn`` and
``freq_factors`` (llama.cpp bakes llama3-style scaling into a ``rope_freqs`` tensor of per-frequency divisors;
we carry the divisors) and ``longrope`` (Phi-3: per-frequency divisors ``short_factor`` for positions below
``original_max_position_embeddings``, ``long_factor`` from there on, cos/sin times ``attention_factor``).
Anything else is rejected here with a ValueError naming the type.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parrot.engine.files.gguf_file import GGUFFile

from parrot.engine.models.registry import FAMILIES, family_for_gguf, family_for_hf

SUPPORTED_ARCHS = tuple(FAMILIES)
LAYER_TYPES = ("full", "sliding")
ACTIVATIONS = ("silu", "gelu_tanh")
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "yarn", "freq_factors", "longrope")
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelConfig:
    name: str
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # ---- family features (defaults: plain LLaMA) ----
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q / k head before RoPE (Qwen3, Gemma-3)
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    sandwich_norms: bool = False  # extra norms on the attention and MLP outputs before the residual add (Gemma-2/3)
    embedding_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    attn_logit_softcap: float | None = None  # scores = cap * tanh(scores / cap) (Gemma-2)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma-2)
    sliding_window: int | None = None  # a "sliding" layer attends to its last ``sliding_window`` tokens (self incl.)
    layer_types: tuple[str, ...] | None = None  # per layer "full" | "sliding" (None: all full)
    local_rope_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma-3); None: rope_theta

    def __post_init__(self) -> None:
        for field_name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                           "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, field_name)) <= 0:
                raise ValueError(f"ModelConfig.{field_name} must be positive, got {getattr(self, field_name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model architecture {self.arch!r}; supported: {SUPPORTED_ARCHS}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"ModelConfig.layer_types must name {LAYER_TYPES} once per layer "
                                 f"({self.num_layers}), got {self.layer_types!r}")
            if "sliding" in self.layer_types and not (self.sliding_window or 0) > 0:
                raise ValueError("ModelConfig.layer_types has sliding layers but sliding_window is not positive")
        validate_rope_scaling(self.rope_scaling)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: the whole context)."""
        sliding = self.layer_types is not None and self.layer_types[layer] == "sliding"
        return self.sliding_window if sliding else None

    def is_plain_llama(self) -> bool:
        """True when every layer is LLaMA's (what the native all-layers decode op computes): no family feature."""
        return (not (self.attention_bias or self.qk_norm or self.sandwich_norms) and self.hidden_act == "silu"
                and self.attn_logit_softcap is None and self.query_pre_attn_scalar in (None, self.head_dim)
                and all(self.layer_window(i) is None for i in range(self.num_layers)))

    def to_hf_dict(self) -> dict[str, Any]:
        """This config as an HF ``config.json`` (LlamaForCausalLM), e.g. to write a safetensors dir (LLaMA only)."""
        if self.arch != "llama" or not self.is_plain_llama():
            raise ValueError(f"to_hf_dict writes plain LLaMA configs, not {self.arch!r}")
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": self.name,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids), "hidden_act": "silu",
        }
        if self.rope_scaling is not None:
            if self.rope_scaling["type"] == "freq_factors":
                raise ValueError("rope_scaling type 'freq_factors' (GGUF rope_freqs) has no HF config.json form")
            scaling = {k: v for k, v in self.rope_scaling.items() if k != "type"}
            out["rope_scaling"] = {"rope_type": self.rope_scaling["type"], **scaling}
        return out


def validate_rope_scaling(scaling: dict | None) -> None:
    """Raise ValueError unless ``scaling`` is None or a normalized dict of a supported type."""
    if scaling is None:
        return
    kind = scaling.get("type")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: {SUPPORTED_ROPE_TYPES}")
    required = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings"),
        "freq_factors": ("factors",),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"),
    }[kind]
    missing = [key for key in required if scaling.get(key) is None]
    if missing:
        raise ValueError(f"rope scaling {kind!r} is missing {missing}")


def is_gguf_file(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == _GGUF_MAGIC


def read_model_config(path: str) -> ModelConfig:
    """Read the config of a GGUF file or of an HF dir holding config.json. Raises ValueError on a bad/unsupported
    config, FileNotFoundError if ``path`` is neither."""
    if is_gguf_file(path):
        from parrot.engine.files.gguf_file import GGUFFile  # numpy only, no torch

        return config_from_gguf(GGUFFile(path), fallback_name=os.path.basename(path))
    cfg_path = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
        gen_path = os.path.join(path, "generation_config.json")
        gen: dict = {}
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                gen = json.load(f)
        return config_from_hf(hf, gen, fallback_name=os.path.basename(os.path.normpath(path)))
    raise FileNotFoundError(f"{path!r} is neither a GGUF file nor a directory with config.json")


# ---- GGUF ----------------------------------------------------------------------------------------------------
def config_from_gguf(gf: GGUFFile, *, fallback_name: str = "model") -> ModelConfig:
    arch = gf.get("general.architecture")
    family = family_for_gguf(arch)  # ValueError naming an unknown architecture

    def key(name: str, default: Any = None) -> Any:
        return gf.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    tensor_names = gf.tensor_names()
    vocab = key("vocab_size")
    if vocab is None:
        tokens = gf.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        raise ValueError("GGUF file states neither llama.vocab_size nor tokenizer.ggml.tokens")
    eos_ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = gf.get(f"tokenizer.ggml.{name}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = gf.get("tokenizer.ggml.bos_token_id")
    layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    extra = family.gguf_fields(key, layers, hidden, heads, head_dim)
    return ModelConfig(
        name=str(gf.get("general.name") or fallback_name),
        arch=family.arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(gf, arch),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        **extra,
    )


def _gguf_rope_scaling(gf: GGUFFile, arch: str) -> dict | None:
    from gguf.quants import dequantize

    tensors = {t.name: t for t in gf.tensors}

    def factors(name: str) -> tuple[float, ...]:
        info = tensors[name]
        return tuple(float(x) for x in dequantize(gf.raw(info), info.qtype).reshape(-1))

    if "rope_freqs.weight" in tensors:
        return {"type": "freq_factors", "factors": factors("rope_freqs.weight")}
    if "rope_factors_long.weight" in tensors:  # Phi-3 longrope (llama.cpp writes the factors as tensors)
        attn = gf.get(f"{arch}.rope.scaling.attn_factor")
        return {"type": "longrope", "short_factor": factors("rope_factors_short.weight"),
                "long_factor": factors("rope_factors_long.weight"),
                "original_max_position_embeddings": int(gf.get(f"{arch}.rope.scaling.original_context_length")),
                "attention_factor": 1.0 if attn is None else float(attn)}
    kind = gf.get(f"{arch}.rope.scaling.type")
    factor = gf.get(f"{arch}.rope.scaling.factor")
    if kind is None:
        # old files state only a linear factor (rope.scale_linear)
        linear = gf.get(f"{arch}.rope.scale_linear")
        return None if linear in (None, 1.0) else {"type": "linear", "factor": float(linear)}
    if kind == "none" or (kind == "linear" and factor in (None, 0.0, 1.0)):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        # llama.cpp: mscale = attn_factor * (1 + 0.1 ln(factor)); HF's default attention_factor is the bracket
        attn = gf.get(f"{arch}.rope.scaling.attn_factor")
        mscale = 1.0 if factor is None or factor <= 1 else 0.1 * math.log(float(factor)) + 1.0
        return {
            "type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(gf.get(f"{arch}.rope.scaling.original_context_length")),
            "beta_fast": float(gf.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(gf.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            "attention_factor": mscale * float(attn if attn is not None else 1.0),
        }
    raise ValueError(f"unsupported rope scaling type {kind!r} in GGUF; supported: {SUPPORTED_ROPE_TYPES}")


# ---- HF config.json ------------------------------------------------------------------------------------------
def config_from_hf(hf: dict, gen: dict | None = None, *, fallback_name: str = "model") -> ModelConfig:
    family = family_for_hf(hf.get("model_type", "llama"))  # ValueError naming an unknown model_type
    if hf.get("mlp_bias"):
        raise ValueError(f"{family.arch} configs with mlp_bias are not supported")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    layers = int(hf["num_hidden_layers"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    extra = family.hf_fields(hf, layers, hidden, heads, head_dim)
    rope_params = hf.get("rope_parameters") or {}
    if "full_attention" in rope_params:  # per layer type (Gemma-3); the sliding layers' base is a family field
        rope_params = rope_params["full_attention"]
    theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    eos: list[int] = []
    for source in (hf, gen or {}):
        value = source.get("eos_token_id")
        for tok in (value if isinstance(value, list) else [value]):
            if tok is not None and int(tok) not in eos:
                eos.append(int(tok))
    bos = hf.get("bos_token_id")
    return ModelConfig(
        name=str(hf.get("_name_or_path") or fallback_name),
        arch=family.arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=extra.pop("rope_scaling") if "rope_scaling" in extra else _hf_rope_scaling(
            hf.get("rope_scaling") or rope_params),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.tied_by_default)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        **extra,
    )


def _hf_rope_scaling(raw: dict | None) -> dict | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    params = {k: v for k, v in raw.items() if k not in ("rope_type", "type", "rope_theta")}
    out = {"type": kind, **params}
    validate_rope_scaling(out)
    return out
