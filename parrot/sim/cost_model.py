"""Iteration cost models for the simulated engine: data files with provenance, linear in tokens (Preble §2.1).

One engine iteration runs a batch plan ``[decode rows | prefill chunks]`` (see the engine scheduler). Its
duration is linear in four counts of the plan::

    t = base_s                                  fixed per iteration (weights streamed once, launches)
      + prefill_token_s  * P                     P = prefill tokens computed (GEMM FLOPs, 2*params per token)
      + prefill_attn_s   * A                     A = sum over chunks of n * (start + n/2): query x key pairs
      + decode_row_s     * D                     D = decode rows (1 token each)
      + decode_ctx_s     * C                     C = context tokens whose K/V the decode rows read

GPU models come from a roofline of published peak numbers times efficiency factors (:func:`roofline_model`);
``this-machine.json`` is least-squares fitted by ``parrot profile`` (:func:`fit_model`). Every JSON file has a
``source`` map saying where each constant comes from. No torch here.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "cost_models"
COEFFS = ("base_s", "prefill_token_s", "prefill_attn_s", "decode_row_s", "decode_ctx_s")
# a file's old name of a field -> its name now (files written by ``parrot profile`` before the rename still load)
RENAMED_KEYS = {"decode_seq_s": "decode_row_s"}


@dataclass(frozen=True)
class CostModel:
    name: str
    base_s: float
    prefill_token_s: float
    prefill_attn_s: float
    decode_row_s: float
    decode_ctx_s: float
    swap_block_s: float  # host<->device copy of one KV block (the engine scheduler preempts by recompute)
    # the engine this model describes (sizes the simulated KV pool and batch budgets)
    kv_cache_tokens: int
    block_size: int = 16
    max_batch_tokens: int = 4096
    max_num_seqs: int = 256
    max_model_len: int = 4096
    # host<->engine copy rate of swapped KV (tool pauses): PCIe 4.0 x16 effective by default (GPU models); the
    # this-machine models state the runner's measured block-copy rate. With ``kv_bytes_per_token`` (K/V bytes of
    # one token, all layers) it times a swap when ``swap_block_s`` is not given (0)
    swap_bytes_per_s: float = 25e9
    kv_bytes_per_token: int = 0
    # a client's HTTP call to the service outside the engine (frontend, network stack, request handling), measured
    # by ``parrot profile`` against the in-process server: one Parrot API call (create a variable, submit, the answer
    # of a get), and the non-engine time of one /v1/completions call; 0 = not modelled (the GPU models)
    api_call_s: float = 0.0
    api_completion_s: float = 0.0
    source: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.swap_bytes_per_s, (int, float)) and self.swap_bytes_per_s > 0):
            raise ValueError(f"cost model {self.name!r}: swap_bytes_per_s must be > 0, got {self.swap_bytes_per_s!r}")
        if not isinstance(self.kv_bytes_per_token, int) or self.kv_bytes_per_token < 0:
            raise ValueError(f"cost model {self.name!r}: kv_bytes_per_token must be an integer >= 0")
        for c in COEFFS + ("swap_block_s", "api_call_s", "api_completion_s"):
            v = getattr(self, c)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"cost model {self.name!r}: {c} must be a finite number >= 0, got {v!r}")
        for c in ("kv_cache_tokens", "block_size", "max_batch_tokens", "max_num_seqs", "max_model_len"):
            if not isinstance(getattr(self, c), int) or getattr(self, c) < 1:
                raise ValueError(f"cost model {self.name!r}: {c} must be an integer >= 1")

    def iteration_s(self, prefill_tokens: int, prefill_attn: float, decode_rows: int, decode_ctx: int) -> float:
        return (self.base_s + self.prefill_token_s * prefill_tokens + self.prefill_attn_s * prefill_attn
                + self.decode_row_s * decode_rows + self.decode_ctx_s * decode_ctx)

    def prefill_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        """One iteration prefilling ``new_tokens`` after ``context_tokens`` already-computed ones."""
        return self.iteration_s(new_tokens, new_tokens * (context_tokens + new_tokens / 2), 0, 0)

    def decode_s(self, batch: int, total_context_tokens: int) -> float:
        """One decode iteration of ``batch`` sequences holding ``total_context_tokens`` in all."""
        return self.iteration_s(0, 0.0, batch, total_context_tokens)

    def tokens_at_tpot(self, tpot_s: float, mean_context: int) -> int:
        """Running tokens at which a decode iteration of sequences of ``mean_context`` tokens takes ``tpot_s``
        (the latency capacity of paper §8.1); 0 if even one sequence is slower."""
        per_token = self.decode_ctx_s + self.decode_row_s / max(1, mean_context)
        return max(0, int((tpot_s - self.base_s) / per_token)) if per_token > 0 else self.kv_cache_tokens

    @property
    def swap_token_s(self) -> float:
        """Copying one token's KV one way."""
        return self.swap_s(1) / self.block_size

    def swap_s(self, blocks: int) -> float:
        """Copying ``blocks`` KV blocks one way (out to host memory, or back in)."""
        if self.swap_block_s > 0:
            return self.swap_block_s * blocks
        return blocks * self.block_size * self.kv_bytes_per_token / self.swap_bytes_per_s

    # ---- files ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        data = {RENAMED_KEYS.get(k, k): v for k, v in data.items()}
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"cost model has unknown keys {sorted(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


def available_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def load_model(name_or_path: str | Path) -> CostModel:
    """A cost model by name (a file in parrot/sim/cost_models) or by path. ValueError names the known ones."""
    p = Path(name_or_path)
    if not p.suffix:
        p = MODELS_DIR / f"{name_or_path}.json"
    if not p.is_file():
        raise ValueError(f"no cost model {str(name_or_path)!r} (known: {', '.join(available_models())})")
    return CostModel.from_dict(json.loads(p.read_text(encoding="utf-8")))


# ---- roofline (GPU models) -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense bf16/fp16 tensor FLOP/s
    mem_bw: float  # HBM/GDDR bytes/s
    mem_bytes: float
    pcie_bw: float
    source: str
    link_bw: float = 0.0  # GPU-GPU bytes/s per direction for tensor-parallel all-reduces (0: no fast link)


@dataclass(frozen=True)
class LlmSpec:
    name: str
    params: float
    layers: int
    hidden: int
    source: str
    kv_dim: int | None = None  # K (= V) width per token and layer: kv_heads * head_dim under GQA; None = hidden (MHA)
    max_model_len: int = 4096

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, fp16, every layer (LLaMA-1 7B/13B are MHA; Mistral-7B and Llama-3-70B use 8 KV heads)."""
        return 2 * self.layers * (self.kv_dim or self.hidden) * 2


GPUS = {
    "a100": GpuSpec("A100-80G", 312e12, 2.0e12, 80e9, 25e9,
                    "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16 tensor, 2,039 GB/s HBM2e (80GB SXM; rounded to "
                    "2.0 TB/s), 80 GB; PCIe 4.0 x16 ~25 GB/s effective"),
    "a6000": GpuSpec("RTX-A6000", 154.8e12, 768e9, 48e9, 25e9,
                     "NVIDIA RTX A6000 datasheet: 309.7 TFLOP/s tensor *with sparsity* -> 154.8 dense FP16/BF16, "
                     "768 GB/s GDDR6, 48 GB; PCIe 4.0 x16 ~25 GB/s effective"),
    "h100": GpuSpec("H100-80G-SXM", 989e12, 3.35e12, 80e9, 50e9,
                    "NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16 tensor, 3.35 TB/s HBM3, 80 GB; PCIe 5.0 x16 "
                    "~50 GB/s effective; NVLink 4 900 GB/s bidirectional = 450 GB/s per direction",
                    link_bw=450e9),
}
LLMS = {
    "llama7b": LlmSpec("LLaMA-7B", 6.74e9, 32, 4096, "LLaMA paper (Touvron et al. 2023) Table 2: 6.7B params, "
                       "32 layers, d_model 4096, 32 heads (MHA)"),
    "llama13b": LlmSpec("LLaMA-13B", 13.0e9, 40, 5120, "LLaMA paper Table 2: 13.0B params, 40 layers, d_model 5120, "
                        "40 heads (MHA)"),
    "mistral7b": LlmSpec("Mistral-7B", 7.24e9, 32, 4096, "Mistral 7B paper (Jiang et al. 2023) Table 1: 7.24B "
                         "params, 32 layers, dim 4096, 32 heads, 8 KV heads x head_dim 128 (GQA); v0.2 window "
                         "32k", kv_dim=1024, max_model_len=32768),
    "llama3-70b": LlmSpec("Llama-3-70B", 70.6e9, 80, 8192, "Meta Llama 3 model card: 70.6B params, 80 layers, "
                          "dim 8192, 64 heads, 8 KV heads x head_dim 128 (GQA), 8k context", kv_dim=1024,
                          max_model_len=8192),
}
# (llm, gpu, tensor-parallel degree) of the generated files: the Parrot paper's LLaMA on A100 / A6000, and Preble
# 5.1's Mistral-7B on A6000 and Llama-3-70B on H100 with 4-GPU tensor parallelism (one engine = 4 GPUs)
GENERATED = (("llama7b", "a100", 1), ("llama7b", "a6000", 1), ("llama13b", "a100", 1), ("llama13b", "a6000", 1),
             ("mistral7b", "a6000", 1), ("mistral7b", "h100", 1), ("llama3-70b", "h100", 4))
# Efficiency factors (fractions of peak) -- assumptions, not measurements; stated in every generated file.
EFFICIENCY = {
    "gemm": 0.6,  # large-batch prefill GEMMs in fp16 reach ~50-70% of tensor peak
    "attn": 0.4,  # FlashAttention-2 forward reaches ~35-50% of peak on A100
    "weights_bw": 0.8,  # streaming weights in decode reaches ~80% of HBM bandwidth
    "kv_bw": 0.5,  # paged-attention decode kernels read scattered KV blocks at ~50% of bandwidth
}
ITER_OVERHEAD_S = 0.003  # per-iteration CPU/scheduling + kernel-launch overhead of a Python serving engine (vLLM)
GPU_MEM_UTILIZATION = 0.9  # vLLM default gpu_memory_utilization
ACTIVATION_RESERVE = 3e9  # bytes kept for activations / CUDA context
ALLREDUCE_LATENCY_S = 8e-6  # one small NCCL all-reduce over NVLink (latency floor; 2 per layer per iteration)


def roofline_model(llm: str, gpu: str, tp: int = 1) -> CostModel:
    """The cost model of ``llm`` on ``tp`` GPUs of kind ``gpu`` (tensor parallelism: weights, KV and FLOPs split
    ``tp`` ways; each layer adds two all-reduces of the hidden state: a latency floor per iteration plus
    ``2 (tp-1)/tp`` of the activation bytes per token over the GPU link, Megatron-style)."""
    m, g = LLMS[llm], GPUS[gpu]
    if tp < 1 or (tp > 1 and g.link_bw <= 0):
        raise ValueError(f"tensor parallelism {tp} needs tp >= 1 and a GPU link ({g.name} has none)")
    weight_bytes = 2 * m.params
    kv_tok = m.kv_bytes_per_token
    kv_tokens = int((tp * (GPU_MEM_UTILIZATION * g.mem_bytes - ACTIVATION_RESERVE) - weight_bytes) // kv_tok)
    if kv_tokens < 2048:
        raise ValueError(f"{m.name} does not fit on {tp}x {g.name} with room for KV")
    e = EFFICIENCY
    block = 16
    ar_s = 2 * m.layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0
    ar_token_s = 2 * m.layers * 2 * (tp - 1) / tp * m.hidden * 2 / g.link_bw if tp > 1 else 0.0
    gemm_token_s = 2 * m.params / (tp * g.peak_flops * e["gemm"]) + ar_token_s
    tp_note = (f"; {tp}-way tensor parallel: 2 all-reduces per layer, {ALLREDUCE_LATENCY_S * 1e6:.0f} us each in "
               f"base_s and 2(tp-1)/tp * hidden * 2 bytes per token over {g.link_bw / 1e9:.0f} GB/s in the per-token "
               "terms" if tp > 1 else "")
    model = CostModel(
        name=f"{llm}-{gpu}" + (f"-tp{tp}" if tp > 1 else ""),
        base_s=weight_bytes / tp / (g.mem_bw * e["weights_bw"]) + ITER_OVERHEAD_S + ar_s,
        prefill_token_s=gemm_token_s,
        prefill_attn_s=4 * m.layers * m.hidden / (tp * g.peak_flops * e["attn"]),
        decode_row_s=gemm_token_s,
        decode_ctx_s=kv_tok / tp / (g.mem_bw * e["kv_bw"]),
        swap_block_s=block * kv_tok / (tp * g.pcie_bw),
        kv_cache_tokens=kv_tokens, block_size=block, max_batch_tokens=4096, max_num_seqs=256,
        max_model_len=m.max_model_len,
        source={
            "gpu": g.source, "model": m.source,
            "base_s": f"weight bytes 2*params / tp / (mem_bw * {e['weights_bw']}) + {ITER_OVERHEAD_S * 1e3:.0f} ms "
                      "per-iteration engine overhead (assumed)" + tp_note,
            "prefill_token_s": f"2*params FLOPs per token / (tp * peak * {e['gemm']})",
            "prefill_attn_s": f"4*layers*hidden FLOPs per query-key pair (QK^T and PV) / (tp * peak * {e['attn']})",
            "decode_row_s": "same GEMM cost per decoded token as prefill (linear approximation of the roofline: "
                            "sum of memory and compute terms, an upper bound of max())",
            "decode_ctx_s": f"KV bytes per token 2*layers*kv_dim*2 = {kv_tok} / tp / (mem_bw * {e['kv_bw']})",
            "swap_block_s": "block KV bytes / (tp * PCIe bandwidth)",
            "kv_cache_tokens": f"(tp * ({GPU_MEM_UTILIZATION} * GPU memory - {ACTIVATION_RESERVE / 1e9:.0f} GB "
                               "activations) - weights) / KV bytes per token (vLLM-style sizing)",
            "efficiency": "assumed fractions of peak: " + json.dumps(e),
            "generated_by": f"parrot.sim.cost_model.roofline_model({llm!r}, {gpu!r}, tp={tp})",
        })
    return replace(model, source={**model.source, "paper_checks": paper_checks(model)})


def paper_checks(m: CostModel) -> str:
    """What the model predicts at the operating points the papers state in text."""
    return (f"batch-1 decode at 1k context {m.decode_s(1, 1024) * 1e3:.1f} ms/token; decode at 6,144 running tokens "
            f"(Parrot 8.1: latency rises past ~6k) {m.decode_s(6, 6144) * 1e3:.1f} ms (6 x 1k seqs) / "
            f"{m.decode_s(48, 6144) * 1e3:.1f} ms (48 x 128); the 40 ms/token target (Parrot 8.1) is reached at "
            f"{m.tokens_at_tpot(0.040, 1024):,} running tokens of 1k-token sequences; prefill 1k tokens "
            f"{m.prefill_s(1024) * 1e3:.0f} ms, 2k {m.prefill_s(2048) * 1e3:.0f} ms (linear + small quadratic "
            "attention term, Preble 2.1)")


def write_gpu_models(directory: Path = MODELS_DIR) -> list[Path]:
    out = []
    for llm, gpu, tp in GENERATED:
        model = roofline_model(llm, gpu, tp)
        p = directory / f"{model.name}.json"
        model.save(p)
        out.append(p)
    return out


# ---- fitting (this machine) ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One measured iteration (or the mean of several identical ones)."""

    prefill_tokens: int
    prefill_attn: float
    decode_seqs: int
    decode_ctx: int
    seconds: float


def fit_coefficients(samples: list[Sample]) -> dict[str, float]:
    """Non-negative least squares over the five coefficients (active-set by dropping negatives and refitting),
    minimizing *relative* error (rows weighted by 1/seconds) so short decode steps count as much as long
    prefills."""
    import numpy as np

    if len(samples) < len(COEFFS):
        raise ValueError(f"need at least {len(COEFFS)} samples to fit, got {len(samples)}")
    X = np.array([[1.0, s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.decode_ctx] for s in samples])
    y = np.array([s.seconds for s in samples])
    w = 1.0 / np.maximum(y, 1e-6)
    active = list(range(len(COEFFS)))
    coef = np.zeros(len(COEFFS))
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active = [a for a, v in zip(active, sol) if v >= 0 and not v == sol.min()]
    return {c: float(v) for c, v in zip(COEFFS, coef)}


def fit_report(model: CostModel, samples: list[Sample]) -> list[tuple[Sample, float]]:
    """(sample, predicted seconds) for every sample."""
    return [(s, model.iteration_s(s.prefill_tokens, s.prefill_attn, s.decode_seqs, s.decode_ctx)) for s in samples]
