"""EngineSettings: the one validated settings object of the builtin engine (env PARROT_ENGINE_*, CLI, config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class EngineSettings(BaseSettings):
    """Settings of one builtin engine. Unknown keys are rejected; invalid values raise with the field name."""

    model_config = SettingsConfigDict(env_prefix="PARROT_ENGINE_", extra="forbid", validate_assignment=True)

    name: str = Field("engine-0", description="engine name reported to the manager and in /status")
    model: str | None = Field(None, description="GGUF file or HF safetensors dir; None = SmolLM2-135M default")
    cpu_path: Literal["auto", "amx", "avx512_bf16", "avx512", "avx2", "portable"] = Field(
        "auto",
        description="CPU kernel family (parrot.engine.runtime.cpu): auto = the fastest this CPU and kernel build run; a "
        "forced path the CPU cannot run fails at start naming the missing features. amx / avx512_bf16: bf16 "
        "compute; avx512 / avx2: fp32 compute with int8 x 4-bit integer-dot matmuls and an fp16 KV cache; "
        "portable: fp32 on torch's kernels (aarch64 and anything else)",
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="compute dtype; auto = the CPU path's (bf16 on amx / avx512_bf16, else fp32; "
        "bf16 on CUDA)"
    )
    kv_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="KV cache storage; auto = fp16 on the integer-dot paths (fp32 compute), else the "
        "compute dtype"
    )
    weight_quant: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="weights: auto = each GGUF matrix in its file's own codes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
        "Q5_K, Q6_K) on the native quantized matmul at every batch size, float matrices dense on the bf16 paths and "
        "Q8_0 on the fp32 ones, other formats dequantized and run as Q8_0 (logged); int4 = every matrix as Q4_1 "
        "(the head as Q8_0); int8 = every matrix as Q8_0; none = dense. Without the native kernels: torch's int4 / "
        "int8 decode kernels over a dense copy, or dense",
    )
    act_quant: Literal["auto", "int8", "int8x2"] = Field(
        "auto",
        description="activations of the quantized matmuls, per group of 32: int8x2 = two int8 terms (~16 bits: "
        "greedy tokens as fp32's), int8 = one (llama.cpp's precision, ~1.5x the matmul speed of two where the dot "
        "products bound it); auto = int8x2 for batches of up to 8 rows (bound by the weight reads: the second term "
        "is free there) and int8 above",
    )
    pack_cache: bool = Field(
        True, description="keep a GGUF's packed quantized weights in a file under pack_cache_dir and map it on later "
        "loads: they then read and pack nothing, and engines on one machine share the pages (~the GGUF's size on "
        "disk per model and weight rule)",
    )
    pack_cache_dir: str | None = Field(None, description="where pack_cache keeps them; None = "
                                       "$XDG_CACHE_HOME/parrot/packed (~/.cache/parrot/packed)")
    device: str = Field("cpu", description="'cpu' or 'cuda' (CUDA when present)")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; None = all cores")
    bind_threads: Literal["auto", "on", "off"] = Field(
        "auto", description="pin the compute threads one per CPU (parrot.engine.runtime.threads): auto = when num_threads "
        "equals the CPUs the process may use; on = to the first num_threads of them; off = never",
    )
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
    engine_policy: str = Field(
        "lamps", description="the engine's scheduling policy (parrot.engine.scheduler.policies): admission order of "
        "waiting ops and the KV of a context paused for a tool call (EngineClient.pause_context). lamps = LAMPS' "
        "memory-over-time ranking + handling predicted at queueing from the manager's hints; lamps-fcfs = FCFS + "
        "LAMPS' handling (its ablation); infercept = FCFS + least-waste handling chosen at the pause (INFERCEPT); "
        "discard / preserve = FCFS + always that handling; fcfs = FCFS + preserve; preble = Preble's priority "
        "groups by cached-token ratio with proportional quotas (Preble 4.3) + preserve")
    swap_space_bytes: int = Field(
        256 << 20, ge=0, description="host memory for KV blocks swapped out of the pool while a tool runs (0: no "
        "swapping; swap choices become discard)")
    tool_pause_ttl_s: float | None = Field(
        None, gt=0, description="seconds a paused context waits to be resumed before it is freed; None = "
        "max(30 s, 4 x the tool's expected duration)")
    priority_groups: int = Field(10, ge=1, description="preble engine policy: number of priority groups P")
    shared_prefix_attention: Literal["auto", "on", "off"] = Field(
        "auto", description="decode rows sharing a prefix attend to it once (merged by LSE): on, off, or auto = "
        "on when one layer of it is measurably faster than the plain path on this machine (timed once at start, "
        "parrot.engine.runtime.shared_prefix_choice); true / false mean on / off"
    )
    attention_kernel: Literal["auto", "native", "torch"] = Field(
        "auto",
        description="native CPU kernels: native = the C++ library (paged-decode attention reading KV blocks in "
        "place, causal prefill attention, fused norm / SwiGLU ops, the AMX / AVX512-BF16 and integer-dot matmuls; "
        "built by `python -m parrot.engine.kernels`, error if unavailable), torch = pure torch (gather + SDPA, "
        "torch norms, oneDNN matmuls), auto = native on the CPU when built, else torch",
    )
    seed: int = Field(0, description="base seed for sampling without an explicit per-request seed")
    random_model: Literal["tiny"] | None = Field(
        None, description="TESTS ONLY: a tiny random-weight LLaMA with the default tokenizer instead of `model`",
        json_schema_extra={"hidden": True})

    @field_validator("shared_prefix_attention", mode="before")
    @classmethod
    def _on_off(cls, v: object) -> object:
        """true / false (bools, or their env spellings) mean on / off."""
        if isinstance(v, bool):
            return "on" if v else "off"
        if isinstance(v, str) and v.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
            return "on" if v.strip().lower() in ("true", "1", "yes") else "off"
        return v

    @field_validator("engine_policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from parrot.engine.scheduler.policies import engine_policy_names

        if v not in engine_policy_names():
            raise ValueError(f"unknown engine policy {v!r} (known: {', '.join(engine_policy_names())})")
        return v

    @model_validator(mode="after")
    def _check(self) -> "EngineSettings":
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")
        return self
