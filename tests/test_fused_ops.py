"""The native fused elementwise ops (parrot/engine/kernels/fused.cpp) against the torch ops they replace, and a
bf16 model that uses them against the same model on the pure-torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parrot.engine.files.config import ModelConfig
from parrot.engine.models.assembly import build_random_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ops():
    import shutil

    from parrot.engine.kernels import load_kernels

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler: the model runs the pure-torch ops here")
    return load_kernels(build_if_missing=True)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign values; both bf16)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


# (rows, hidden): one decode row, a decode batch, a width with a scalar tail, a prefill-sized call (parallel rows)
SHAPES = [(1, 576), (64, 576), (5, 37), (700, 576)]


@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_rms_norm_cast_matches_torch(ops, rows, hidden):
    torch.manual_seed(rows)
    h = torch.randn(rows, hidden) * 3
    w = torch.rand(hidden) + 0.5
    ref = F.rms_norm(h, (hidden,), w, 1e-5)
    got = ops.rms_norm_cast(h, w, 1e-5, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == h.shape
    # the fp32 results differ only in summation order, so the bf16 ones agree up to a rare rounding-boundary flip
    assert bf16_ulps(got, ref.bfloat16()).max() <= 1
    assert (got != ref.bfloat16()).float().mean() < 1e-3
    got32 = ops.rms_norm_cast(h, w, 1e-5, torch.float32)
    assert torch.allclose(got32, ref, rtol=1e-5, atol=1e-6)
    # a row view of a wider buffer reads the same rows
    wide = torch.zeros(rows, hidden + 8)
    wide[:, :hidden] = h
    assert torch.equal(ops.rms_norm_cast(wide[:, :hidden], w, 1e-5, torch.bfloat16), got)


@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("delta_dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_cast_updates_h_and_norms(ops, rows, hidden, delta_dtype):
    torch.manual_seed(rows + 1)
    h = torch.randn(rows, hidden) * 3
    w = torch.rand(hidden) + 0.5
    delta = torch.randn(rows, hidden).to(delta_dtype)
    expect_h = h + delta.float()
    ref = F.rms_norm(expect_h, (hidden,), w, 1e-5).bfloat16()
    got = ops.add_rms_norm_cast(h, delta, w, 1e-5, torch.bfloat16)
    assert torch.equal(h, expect_h)  # the residual add is exact fp32, in place
    assert bf16_ulps(got, ref).max() <= 1
    assert (got != ref).float().mean() < 1e-3


@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (3, 21), (700, 256)])
def test_silu_mul_matches_fp32_math(ops, rows, inter):
    torch.manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated exp both ways, zeros
    exact = F.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
    got = ops.silu_mul(gate_up)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    # one rounding of the fp32 result: within half a bf16 ulp of the exact value, up to fp32 noise
    assert torch.allclose(got.double(), exact, rtol=2 ** -8, atol=1e-30)
    # torch's own bf16 path rounds twice (silu, then the product); it is at most one ulp away
    assert bf16_ulps(got, F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])).max() <= 1
    got32 = ops.silu_mul(gate_up.float())
    assert torch.allclose(got32.double(), exact, rtol=1e-6, atol=1e-30)


def test_rejects_bad_inputs(ops):
    h = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm_cast(h.bfloat16(), torch.ones(64), 1e-5, torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm_cast(h, torch.ones(63), 1e-5, torch.bfloat16)
    with pytest.raises(RuntimeError, match="delta"):
        ops.add_rms_norm_cast(h, torch.randn(4, 32).bfloat16(), torch.ones(64), 1e-5, torch.bfloat16)
    with pytest.raises(RuntimeError, match="2I"):
        ops.silu_mul(torch.randn(4, 7).bfloat16())


SMALL = ModelConfig(
    name="small-llama", arch="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3,
    num_heads=6, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
)


def dense_attention(scale: float):
    """A stand-in AttentionBackend: causal attention over one sequence (no KV cache)."""

    def attn(layer_idx, q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                             v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                             enable_gqa=True)
        return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)

    return attn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,heads,dim", [(1, 12, 64), (64, 12, 64), (3, 2, 24), (700, 4, 64)])
def test_rope_matches_torch_rotation(ops, rows, heads, dim, dtype):
    """The fused RoPE equals RotaryEmbedding.apply (complex multiply in fp32, one rounding to the input dtype) on
    a row-strided view like the model's q/k slice of qkv; D=24 runs the scalar tail after one 16-wide vector."""
    from parrot.engine.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(rows + dim)
    qkv = torch.randn(rows, (heads + 3) * dim, generator=g).to(dtype)
    x = qkv[:, : heads * dim].view(rows, heads, dim)  # strided rows
    angles = torch.rand(rows, 1, dim // 2, generator=g) * 50
    rot = torch.polar(torch.ones_like(angles), angles)
    got = ops.rope(x, rot)
    ref = RotaryEmbedding.apply(x, rot)
    assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    else:  # the fp32 results may differ in the last bits (FMA vs separate multiply-add), which moves a rare bf16
        # rounding by one step: 1 ulp relative, or a few ulps of a result near 0 (cancellation)
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-8, atol=2**-10)
        assert (got != ref).float().mean() < 0.01


def test_rope_table_grows_to_the_positions_asked_for(tiny_config):
    """The rotation table starts short and doubles when a longer context asks for more; its rows are the rows a
    table built whole has (the float64 angles of the same positions)."""
    import dataclasses

    from parrot.engine.layers import rotary
    from parrot.engine.layers.rotary import RotaryEmbedding

    cfg = dataclasses.replace(tiny_config, max_position_embeddings=3 * rotary.INITIAL_POSITIONS + 5,
                              rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    emb = RotaryEmbedding(cfg)
    assert emb.freqs_cis.shape[0] == rotary.INITIAL_POSITIONS
    pos = torch.tensor([5, rotary.INITIAL_POSITIONS + 3, 3 * rotary.INITIAL_POSITIONS + 4])
    got = emb.table(pos)
    assert emb.freqs_cis.shape[0] == cfg.max_position_embeddings  # doubled, capped at the window
    whole = emb._rows(0, cfg.max_position_embeddings)
    assert torch.equal(got[:, 0], whole[pos])
    assert torch.equal(emb.table(torch.tensor([7]))[:, 0], whole[[7]])


def test_rope_rejects_mismatched_rotation(ops):
    x = torch.randn(4, 2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="rot must be complex64"):
        ops.rope(x, torch.randn(4, 1, 8))
    with pytest.raises(RuntimeError, match="rot must be complex64"):
        ops.rope(x, torch.polar(torch.ones(4, 1, 3), torch.zeros(4, 1, 3)))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_model_fused_path_matches_torch_path(ops, dtype, tol):
    """The same model with and without the fused ops: the final hidden states agree to rounding noise (bf16: the
    paths differ in where intermediate bf16 values are rounded; fp32: in the order of fp32 operations); a float16
    model keeps the torch path (the ops have no fp16 form)."""
    model = build_random_model(SMALL, dtype=dtype, seed=3)
    ids = torch.randint(3, SMALL.vocab_size, (40,))
    pos = torch.arange(40)
    attn = dense_attention(SMALL.head_dim ** -0.5)
    ref = model(ids, pos, attn).float()
    counting = CountingOps(ops)
    assert model.use_fused_ops(counting)
    try:
        got = model(ids, pos, attn).float()
    finally:
        model.use_fused_ops(None)
    assert model.fused_ops is None
    # one norm up front, then per layer two add+norms and one SwiGLU
    assert counting.calls == {"rms_norm_cast": 1, "add_rms_norm_cast": 2 * SMALL.num_layers,
                              "silu_mul": SMALL.num_layers, "rope": SMALL.num_layers}
    rel = (got - ref).norm() / ref.norm()
    assert 0 < rel < tol, rel  # > 0: the fused ops really ran (their rounding differs from torch's)
    assert torch.equal(model(ids, pos, attn).float(), ref)  # back on the torch path
    assert not build_random_model(SMALL, dtype=torch.float16, seed=3).use_fused_ops(ops)


class CountingOps:
    """Forwards to the real ops and counts the calls per op name."""

    def __init__(self, ops) -> None:
        self.ops = ops
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):
        fn = getattr(self.ops, name)

        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)

        return call
