"""EngineSettings: the one validated settings object of the builtin engine (env PARROT_ENGINE_*, CLI, config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class EngineSettings(BaseSettings):
    """Settings of one builtin engine. Unknown keys are rejected; invalid values raise with the field name."""

    model_config = SettingsConfigDict(env_prefix="PARROT_ENGINE_", extra="forbid", validate_assignment=True)

    name: str = Field("engine-0", description="engine name reported to the manager and in /status")
    model: str | None = Field(None, description="GGUF file or HF safetensors dir; None = SmolLM2-135M default")
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="compute dtype; bf16 uses the CPU's AMX/AVX512-BF16 matmul and is the default"
    )
    weight_quant: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="weight-only kernels for small token counts (decode), dense GEMM for prefill: int4 = group-32 "
        "(exact for Q4_1 GGUFs, bf16 on CPU only; the output head then runs as Q8_0, exact for a Q8_0 head, at 1-2 "
        "rows), int8 = per-row; none = dense always; auto = int4 for bf16 on CPU, else none",
    )
    device: str = Field("cpu", description="'cpu' or 'cuda' (CUDA when present)")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; None = all cores")
    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block")
    kv_cache_tokens: int | None = Field(
        None, ge=16, description="KV pool size in tokens (rounded up to blocks); None = from kv_cache_bytes"
    )
    kv_cache_bytes: int = Field(1 << 30, ge=1 << 20, description="KV pool size in bytes when kv_cache_tokens is None")
    max_num_seqs: int = Field(64, ge=1, description="max sequences per iteration (decode batch)")
    max_batch_tokens: int = Field(512, ge=16, description="per-iteration token budget (chunked prefill)")
    max_model_len: int | None = Field(None, ge=16, description="context window; None = the model's")
    enable_prefix_cache: bool = Field(
        True, description="keep KV blocks of finished contexts and reuse them for equal token prefixes (LRU)"
    )
    shared_prefix_attention: bool = Field(
        True, description="decode rows sharing a prefix attend to it once (one batched matmul, merged by LSE)"
    )
    attention_kernel: Literal["auto", "native", "torch"] = Field(
        "auto",
        description="native CPU kernels: native = the C++ library (paged-decode attention reading KV blocks in "
        "place, causal prefill attention, fused norm / SwiGLU ops, the AMX / AVX512-BF16 matmul for decode-sized "
        "batches; built by `python -m parrot.engine.kernels`, "
        "error if unavailable), torch = pure torch (gather + SDPA, torch norms, oneDNN matmuls), auto = native on "
        "the CPU when built, else torch",
    )
    seed: int = Field(0, description="base seed for sampling without an explicit per-request seed")
    random_model: Literal["tiny"] | None = Field(
        None, description="TESTS ONLY: a tiny random-weight LLaMA with the default tokenizer instead of `model`",
        json_schema_extra={"hidden": True})

    @property
    def resolved_weight_quant(self) -> str:
        if self.weight_quant != "auto":
            return self.weight_quant
        return "int4" if self.dtype == "bfloat16" and self.device == "cpu" else "none"

    @model_validator(mode="after")
    def _check(self) -> "EngineSettings":
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")
        return self
