"""Model implementations (LLaMA family)."""

from parrot.engine.models.llama import (
    AttentionBackend,
    LlamaForCausalLM,
    build_random_model,
    load_model,
)

__all__ = ["AttentionBackend", "LlamaForCausalLM", "build_random_model", "load_model"]
