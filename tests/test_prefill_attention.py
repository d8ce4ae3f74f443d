"""The native causal prefill attention (parrot/engine/kernels/prefill_attention.cpp) against float64 attention,
on strided views like the model's fused qkv tensor, its input checks, and the engine picking it for bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parrot.engine.builder import build_engine
from parrot.engine.settings import EngineSettings


@pytest.fixture(scope="module")
def prefill(native_kernel):
    from parrot.engine.kernels import load_kernels

    ops = load_kernels()
    if not ops.prefill_attention_available():
        pytest.skip("no AVX512-BF16 on this CPU: bf16 prefill attention runs torch's SDPA")
    return ops.causal_prefill


def reference(q, k, v, scale):
    """Causal softmax(q k^T * scale) v in float64, query heads grouped over KV heads -> [n, H * D]."""
    n, H, D = q.shape
    qd, kd, vd = (x.double().transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).reshape(n, H * D)


@pytest.mark.parametrize("n,heads,kv_heads,head_dim", [(1, 9, 3, 64), (5, 9, 3, 64), (31, 9, 3, 64),
                                                       (33, 9, 3, 64), (100, 4, 4, 32), (300, 8, 2, 128)])
def test_matches_float64_attention(prefill, n, heads, kv_heads, head_dim):
    """Tiles of 32 queries, key panels of 32 (partial last ones), GQA and plain heads, D = 32 / 64 / 128."""
    g = torch.Generator().manual_seed(n * 100 + heads)
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=g).bfloat16()
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]  # strided, like the model
    scale = head_dim ** -0.5
    out = prefill(q, k, v, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (n, heads * head_dim)
    # bf16 output (8 mantissa bits) and bf16 probabilities before the P V product
    assert torch.allclose(out.double(), reference(q, k, v, scale), atol=2e-2), \
        (out.double() - reference(q, k, v, scale)).abs().max()
    assert torch.equal(out, prefill(q.contiguous(), k.contiguous(), v.contiguous(), scale))


def test_first_query_sees_only_itself(prefill):
    """Row 0 attends to key 0 alone: its output is v[0] exactly (softmax of one score is 1)."""
    q, k, v = (torch.randn(40, 3, 64).bfloat16() for _ in range(3))
    out = prefill(q, k[:, :1].contiguous(), v[:, :1].contiguous(), 0.125).view(40, 3, 64)
    assert torch.equal(out[0], v[0, 0].expand(3, 64))


def test_rejects_bad_inputs(prefill):
    q = torch.zeros(4, 6, 64, dtype=torch.bfloat16)
    kv = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        prefill(q.float(), kv.float(), kv.float(), 1.0)
    with pytest.raises(RuntimeError, match="D % 32"):
        prefill(torch.zeros(4, 6, 48, dtype=torch.bfloat16), torch.zeros(4, 2, 48, dtype=torch.bfloat16),
                torch.zeros(4, 2, 48, dtype=torch.bfloat16), 1.0)
    with pytest.raises(RuntimeError, match="group evenly"):
        prefill(torch.zeros(4, 5, 64, dtype=torch.bfloat16), kv, kv, 1.0)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        prefill(q, kv[:3], kv, 1.0)


def test_bf16_engine_prefills_with_it_and_fp32_does_not(prefill):
    """A bf16 engine's fresh prefill chunks run the kernel (and give the same first token as the torch path on
    the real model); a float32 engine keeps SDPA."""
    from parrot.common.sampling import SamplingParams

    seen = []
    tokens = {}
    for mode in ("auto", "torch"):
        eng = build_engine(EngineSettings(dtype="bfloat16", attention_kernel=mode, kv_cache_tokens=2048))
        try:
            if mode == "auto":
                assert eng.runner.prefill_kernel is not None
                real = eng.runner.prefill_kernel
                eng.runner.prefill_kernel = lambda *a: seen.append(a[0].shape[0]) or real(*a)
            else:
                assert eng.runner.prefill_kernel is None
            prompt = eng.tokenizer.encode("The capital of France is")
            eng.fill(prompt, "c").result()
            tokens[mode] = eng.generate(SamplingParams(max_tokens=1), "g", "c").result().token_ids
        finally:
            eng.shutdown()
    assert seen and all(n > 0 for n in seen)
    assert tokens["auto"] == tokens["torch"]
    eng = build_engine(EngineSettings(dtype="float32", weight_quant="none", kv_cache_tokens=256))
    try:
        assert eng.runner.prefill_kernel is not None  # kept, but PagedAttention runs it for bf16 only
        eng.runner.prefill_kernel = lambda *a: pytest.fail("the bf16 kernel ran in a float32 engine")
        eng.fill(eng.tokenizer.encode("hello"), "c").result()
    finally:
        eng.shutdown()
