"""LLaMA family (LLaMA 2/3, SmolLM, TinyLlama, ...): the plain shared decoder. Mistral GGUFs are ``llama`` files too.

Also the historical home of the model classes: ``from parrot.engine.models.llama import build_random_model`` and
friends resolve lazily to parrot.engine.models.decoder / .assembly, so this module stays torch-free (config.py reads
the family table at import).
"""

from __future__ import annotations

from typing import Any

from parrot.engine.models.registry import Family, GGUFKey, silu_only, sliding_fields


def _hf_fields(hf: dict, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    silu_only(hf, "llama")
    if hf.get("attention_bias"):  # LLaMA's attention_bias also biases o_proj, which the decoder has not
        raise ValueError("LLaMA configs with attention_bias/mlp_bias are not supported")
    return {}


def _gguf_fields(key: GGUFKey, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    # a converted Mistral states its window (when it has one) for every layer
    return sliding_fields(key("attention.sliding_window", None), ("sliding",) * layers)


FAMILIES = (Family("llama", hf_model_types=("llama",), gguf_archs=("llama",), hf_fields=_hf_fields,
                   gguf_fields=_gguf_fields, gguf_permuted_qk=True),)

# names that lived here before the decoder was shared by every family
_MOVED = {
    "AttentionBackend": "decoder", "FusedOps": "decoder", "FUSED_OP_NAMES": "decoder", "DECODE_LAYERS_OP": "decoder",
    "DecoderLayer": "decoder", "LlamaDecoderLayer": "decoder", "CausalLM": "decoder", "LlamaForCausalLM": "decoder",
    "COMPUTE_DTYPES": "assembly", "assemble_model": "assembly", "load_model": "assembly",
    "random_weights": "assembly", "build_random_model": "assembly",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f"parrot.engine.models.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
