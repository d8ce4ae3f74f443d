"""The integer-dot GEMM (parrot/engine/kernels/qdot_gemm.cpp, layers/qdot.py): the AVX2 kernel bit-identical to its
scalar twin, both within the activation quantization's bound of the exact product, exact recovery of the default
GGUF's Q4_1 / Q8_0 codes (and of Q4_0's), the packed layout's round trip, input checks, and the QDotWeight path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parrot.engine.config import read_model_config
from parrot.engine.layers.int4 import INT4_GROUP
from parrot.engine.layers.linear import Linear, MatmulKernels, make_linear
from parrot.engine.layers.qdot import Planes, QDotKernel, QDotWeight, qdot_kernel, to_planes
from parrot.engine.layers.weight import DenseWeight
from parrot.engine.loader import iter_weights, weight_formats

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ops(native_kernel):
    return torch.ops.parrot_kernels


@pytest.fixture(scope="module")
def avx2(ops) -> QDotKernel:
    if "avx2" not in ops.qdot_variants():
        pytest.skip("no AVX2 + FMA + F16C on this CPU: only the scalar twin runs here")
    return qdot_kernel("avx2", 2)


def random_planes(n: int, k: int, planes: int, seed: int) -> Planes:
    """Every code 0..15 spread over all positions, fp16-representable scales, mins of both signs."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (planes, n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(planes, n, k // INT4_GROUP, generator=g) * 0.02 + 0.001).half().float()
    m = ((torch.rand(planes, n, k // INT4_GROUP, generator=g) - 0.5) * 0.2).half().float()
    return Planes(codes, d, m)


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 13, 70])
def test_avx2_equals_scalar_and_bounds_the_error(ops, avx2, rows: int, planes: int, terms: int) -> None:
    """Same integers, same fp32 operations in the same order: bit-identical outputs. Against the exact product
    (float64) the error is the activations' rounding: one term ~ 2^-8 of each group's max, two terms ~ 2^-16."""
    n, k = 40, 96  # 5 column blocks, 3 groups; row counts cover the 4-row tiles, their tails and several chunks
    p = random_planes(n, k, planes, seed=rows * 10 + planes)
    packed = ops.qdot_pack(p.codes, p.d, p.m)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    x[:, 5] *= 30  # an outlier channel: its group's step is 30x coarser
    got = ops.qdot_linear(x, packed, "avx2", terms)
    assert torch.equal(got, ops.qdot_linear(x, packed, "scalar", terms))
    ref = x.double() @ p.dequantize().double().T
    # |error| <= sum_j |w_j| * step_j / 2 per output, step = group max / 127 (/ 256 with two terms)
    step = x.view(rows, -1, INT4_GROUP).abs().amax(-1).double() / 127 / (256 if terms == 2 else 1)
    bound = (p.dequantize().double().abs().view(n, -1, INT4_GROUP).sum(-1) @ step.T).T / 2
    assert ((got.double() - ref).abs() <= bound * 1.01 + 1e-5).all()
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    assert rel < (2e-2 if terms == 1 else 2e-4), rel


def test_bf16_input_and_strided_rows(ops, avx2) -> None:
    """bf16 activations give a bf16 output equal to the fp32 call's rounded; a row-strided view equals its copy."""
    p = random_planes(16, 64, 1, seed=1)
    packed = ops.qdot_pack(p.codes, p.d, p.m)
    x = torch.randn(5, 64).bfloat16()
    y = ops.qdot_linear(x, packed, "avx2", 2)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, ops.qdot_linear(x.float(), packed, "avx2", 2).bfloat16())
    wide = torch.randn(5, 100)
    assert torch.equal(ops.qdot_linear(wide[:, 10:74], packed, "avx2", 1),
                       ops.qdot_linear(wide[:, 10:74].contiguous(), packed, "avx2", 1))


def test_zero_groups_and_rows(ops) -> None:
    """An all-zero activation group contributes exactly its nothing (no 0/0); zero rows give an empty output."""
    p = random_planes(8, 64, 1, seed=2)
    packed = ops.qdot_pack(p.codes, p.d, p.m)
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.randn(32)
    y = ops.qdot_linear(x, packed, "scalar", 2)
    assert torch.equal(y[0], torch.zeros(8)) and torch.isfinite(y).all()
    assert ops.qdot_linear(torch.zeros(0, 64), packed, "scalar", 1).shape == (0, 8)


def test_dequantize_round_trips_the_packed_layout(ops) -> None:
    """qdot_dequantize reads back exactly the weight the planes encode (the same fp32 operations)."""
    for planes in (1, 2):
        p = random_planes(24, 96, planes, seed=planes)
        assert torch.equal(ops.qdot_dequantize(ops.qdot_pack(p.codes, p.d, p.m)), p.dequantize())


def test_rejects_bad_input(ops) -> None:
    p = random_planes(8, 64, 1, seed=3)
    packed = ops.qdot_pack(p.codes, p.d, p.m)
    with pytest.raises(RuntimeError, match="features"):
        ops.qdot_linear(torch.zeros(1, 32), packed, "scalar", 1)
    with pytest.raises(RuntimeError, match="variant must be"):
        ops.qdot_linear(torch.zeros(1, 64), packed, "avx512", 1)
    with pytest.raises(RuntimeError, match="terms must be 1 or 2"):
        ops.qdot_linear(torch.zeros(1, 64), packed, "scalar", 3)
    with pytest.raises(RuntimeError, match="codes must lie in"):
        ops.qdot_pack(p.codes + 16, p.d, p.m)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.qdot_pack(p.codes[:, :6], p.d[:, :6], p.m[:, :6])
    with pytest.raises(RuntimeError, match="1 or 2 planes"):
        ops.qdot_pack(p.codes.repeat(3, 1, 1), p.d.repeat(3, 1, 1), p.m.repeat(3, 1, 1))


# ---- the file's own codes -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_weights(default_model_path):
    fmts = weight_formats(default_model_path)
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight",
              "model.embed_tokens.weight"}
    out = {}
    for name, w in iter_weights(default_model_path, read_model_config(default_model_path)):
        if name in wanted:
            out[name] = (w, fmts[name])
    return out


@pytest.mark.model
def test_default_gguf_codes_are_recovered_exactly(gguf_weights) -> None:
    """The default GGUF's Q4_1 layers and its Q8_0 token embedding (the tied head) become planes whose values are
    the file's, bit for bit."""
    for name, (w, fmt) in gguf_weights.items():
        quant = "int8" if fmt == "q8_0" else "int4"
        assert fmt in ("q4_1", "q8_0"), (name, fmt)
        planes = to_planes(w, quant, fmt)
        assert planes.codes.shape[0] == (2 if quant == "int8" else 1)
        assert torch.equal(planes.dequantize(), w), name


def test_q4_0_codes_are_recovered_exactly() -> None:
    """Values dequantized from GGUF Q4_0 (ggml's own quantizer, via the gguf package) come back exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32) * 0.05
    w[3, 40] = 0.9  # a lone large value in one group
    values = torch.from_numpy(dequantize(quantize(w, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0).copy())
    assert torch.equal(to_planes(values, "int4", "q4_0").dequantize(), values)
    # the Q4_1 rule on the same values is only an approximation (its scale is (max - min) / 15, not the file's)
    assert not torch.equal(to_planes(values, "int4", None).dequantize(), values)


def test_qdot_layer(ops) -> None:
    """A layer on the qdot kernel (MatmulKernels.qdot) is a QDotWeight that runs the kernel at every row count,
    within the activation rounding of F.linear on the weight it encodes (the Q8_0 of w for "int8")."""
    kernel = QDotKernel(ops, "scalar", 2)
    w = torch.randn(24, 64) * 0.05
    lin = make_linear([(w, None)], dtype=torch.float32, quant="int8", kernels=MatmulKernels(qdot=kernel))
    assert isinstance(lin.path, QDotWeight) and lin.path.planes == 2 and lin.quant == "int8"
    x = torch.randn(6, 64)
    y = lin(x)
    assert torch.equal(y, ops.qdot_linear(x, lin.path.packed, "scalar", 2))
    call = lin.native_call(100)
    assert call.weight is lin.path.packed and (call.backend, call.act_terms) == ("scalar", 2)
    dense = torch.nn.functional.linear(x, lin.dense_weight())
    assert torch.allclose(y, dense, rtol=1e-4, atol=1e-4) and not torch.equal(y, dense)
    assert torch.allclose(lin.dense_weight(), w, rtol=0, atol=w.abs().max().item() / 254 * 1.01)  # Q8_0 of w
    assert lin.decode_bytes() == lin.path.packed.nbytes


def test_prefill_sized_batches_run_dense(ops) -> None:
    """With dense_min_rows, a batch that large is the exact fp32 product with the dequantized weight (torch's GEMM),
    and the all-layers decode op is not offered it (native_call None); smaller batches stay on the kernel."""
    planes = to_planes(torch.randn(16, 64) * 0.05, "int4")
    lin = Linear(QDotWeight(planes, QDotKernel(ops, "scalar", 2, dense_min_rows=5), dtype=torch.float32,
                            quant="int4"))
    big, small = torch.randn(5, 64), torch.randn(4, 64)
    assert torch.equal(lin(big), torch.nn.functional.linear(big, planes.dequantize()))
    assert lin.native_call(5) is None and lin.native_call(4).weight is lin.path.packed
    assert torch.equal(lin(small), ops.qdot_linear(small, lin.path.packed, "scalar", 2))


def test_model_with_shapes_the_kernel_cannot_pack(ops, tiny_config) -> None:
    """On the integer-dot path, a matmul whose input width is not a multiple of 32 stays a dense fp32 layer (exact),
    the rest run the kernel; the model still matches its fp32 twin closely."""
    import dataclasses

    from parrot.engine.models.llama import build_random_model

    cfg = dataclasses.replace(tiny_config, hidden_size=48, num_heads=3, num_kv_heads=1, head_dim=16,
                              intermediate_size=64)
    model = build_random_model(cfg, dtype=torch.float32, seed=2, weight_quant="auto",
                               kernels=MatmulKernels(qdot=QDotKernel(ops, "scalar", 2)))
    ref = build_random_model(cfg, dtype=torch.float32, seed=2)
    layer = model.layers[0]
    assert (type(layer.qkv_proj.path), type(layer.down_proj.path)) == (DenseWeight, QDotWeight)  # 48 features vs 64
    assert model.layers[0].qkv_proj.quant == "none"

    def attn(layer_idx, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                               v.transpose(0, 1), is_causal=True, enable_gqa=True)
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    ids, pos = torch.randint(0, cfg.vocab_size, (12,)), torch.arange(12)
    got, want = model(ids, pos, attn), ref(ids, pos, attn)
    assert ((got - want).norm() / want.norm()).item() < 0.05  # the Q8_0 weights of the packed layers
