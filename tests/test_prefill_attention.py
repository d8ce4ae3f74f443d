"""The native causal prefill attention (parrot/engine/kernels/prefill_attention.cpp) against float64 attention,
on strided views like the model's fused qkv tensor, its input checks, and the engine picking it for the model's
dtype: bf16 (AVX512-BF16 VNNI GEMMs) and fp32 (AVX2 FMA micro-kernels), each where the CPU runs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parrot.engine.loader.builder import build_engine
from parrot.engine.settings import EngineSettings


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def prefill(native_kernel, dtype):
    from parrot.engine.kernels import load_kernels

    ops = load_kernels()
    if dtype == torch.bfloat16 and not ops.prefill_attention_available():
        pytest.skip("no AVX512-BF16 on this CPU: bf16 prefill attention runs torch's SDPA")
    if dtype == torch.float32 and not ops.prefill_attention_fp32_available():
        pytest.skip("no AVX2 + FMA on this CPU: fp32 prefill attention runs torch's SDPA")
    return ops.causal_prefill


def reference(q, k, v, scale):
    """Causal softmax(q k^T * scale) v in float64, query heads grouped over KV heads -> [n, H * D]."""
    n, H, D = q.shape
    qd, kd, vd = (x.double().transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).reshape(n, H * D)


@pytest.mark.parametrize("n,heads,kv_heads,head_dim", [(1, 9, 3, 64), (5, 9, 3, 64), (31, 9, 3, 64),
                                                       (33, 9, 3, 64), (100, 4, 4, 32), (300, 8, 2, 128)])
def test_matches_float64_attention(prefill, dtype, n, heads, kv_heads, head_dim):
    """Tiles of 32 queries, key panels of 32 / 16 (partial last ones), GQA and plain heads, D = 32 / 64 / 128."""
    g = torch.Generator().manual_seed(n * 100 + heads)
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]  # strided, like the model
    scale = head_dim ** -0.5
    out = prefill(q, k, v, scale)
    assert out.dtype == dtype and out.shape == (n, heads * head_dim)
    # bf16: the output (8 mantissa bits) and the probabilities before the P V product are rounded; fp32: fp32 sums
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(out.double(), reference(q, k, v, scale), atol=atol), \
        (out.double() - reference(q, k, v, scale)).abs().max()
    assert torch.equal(out, prefill(q.contiguous(), k.contiguous(), v.contiguous(), scale))


def test_first_query_sees_only_itself(prefill, dtype):
    """Row 0 attends to key 0 alone: its output is v[0] exactly (softmax of one score is 1)."""
    q, k, v = (torch.randn(40, 3, 64).to(dtype) for _ in range(3))
    out = prefill(q, k[:, :1].contiguous(), v[:, :1].contiguous(), 0.125).view(40, 3, 64)
    assert torch.equal(out[0], v[0, 0].expand(3, 64))


def test_rejects_bad_inputs(prefill, dtype):
    q = torch.zeros(4, 6, 64, dtype=dtype)
    kv = torch.zeros(4, 2, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="of one dtype"):
        prefill(q.half(), kv.half(), kv.half(), 1.0)
    with pytest.raises(RuntimeError, match="of one dtype"):
        prefill(q, kv.double(), kv, 1.0)
    with pytest.raises(RuntimeError, match="D % 32"):
        prefill(torch.zeros(4, 6, 48, dtype=dtype), torch.zeros(4, 2, 48, dtype=dtype),
                torch.zeros(4, 2, 48, dtype=dtype), 1.0)
    with pytest.raises(RuntimeError, match="group evenly"):
        prefill(torch.zeros(4, 5, 64, dtype=dtype), kv, kv, 1.0)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        prefill(q, kv[:3], kv, 1.0)


def test_engine_prefills_with_it(prefill, dtype):
    """An engine of this dtype (bf16: the bf16 CPU paths, fp32: the integer-dot paths) runs its fresh prefill
    chunks on the kernel, and the first token on the real model equals SDPA's (the same engine, kernel removed)."""
    from parrot.common.sampling import SamplingParams

    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    eng = build_engine(EngineSettings(dtype=name, kv_cache_tokens=2048, enable_prefix_cache=False))
    try:
        assert eng.runner.prefill_kernel is not None
        real, seen, tokens = eng.runner.prefill_kernel, [], []
        prompt = eng.tokenizer.encode("The capital of France is")
        for kernel in (lambda *a: seen.append(a[0].shape[0]) or real(*a), None):
            eng.runner.prefill_kernel = kernel
            eng.fill(prompt, f"c{len(tokens)}").result()
            tokens.append(eng.generate(SamplingParams(max_tokens=1), f"g{len(tokens)}", f"c{len(tokens)}")
                          .result().token_ids)
        # every layer of the fill (and of the fork's recomputed partial block) ran it on the whole prompt
        layers = eng.runner.model.config.num_layers
        assert len(seen) % layers == 0 and seen and set(seen) == {len(prompt)}
        assert tokens[0] == tokens[1]
    finally:
        eng.shutdown()
