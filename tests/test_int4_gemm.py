"""The native int4 GEMM (parrot/engine/kernels/int4_gemm.cpp): exact against the dequantized weights, exact
recovery of the default GGUF's Q4_1 groups, input checks, and the int4 / Q8_0 layer paths on it
(NativeInt4Weight over the bf16 form) beside torch's int4 kernel (Int4Weight, the path without it)."""

from __future__ import annotations

import pytest
import torch

from parrot.engine.config import read_model_config
from parrot.engine.layers.int4 import (INT4_GROUP, INT4_MAX_ROWS_PACKED, NATIVE_INT4_MAX_ROWS,
                                       NATIVE_Q8_0_MAX_ROWS, Int4Weight, NativeInt4, NativeInt4Weight, native_int4,
                                       q4_1_codes, q8_0_planes)
from parrot.engine.layers.linear import MatmulKernels, make_linear
from parrot.engine.layers.packed import PackedBf16Weight, VnniWeight
from parrot.engine.loader import iter_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def int4(native_kernel) -> NativeInt4:
    kernel = native_int4()
    if kernel is None:
        pytest.skip("no AVX512-BF16 on this CPU: int4 layers run torch's int4 kernel")
    return kernel


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """W = d * q + m per group of 32, float32 (d and m already fp16-representable)."""
    return d.repeat_interleave(INT4_GROUP, 1) * q.float() + m.repeat_interleave(INT4_GROUP, 1)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y (bf16) equals x @ w.T in float64 up to bf16 rounding of the output (fp32 accumulation)."""
    ref = x.double() @ w.double().T
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    tol = ref.abs() * 2.0**-8 + 1e-3
    assert ((y.double() - ref).abs() <= tol).all(), (y.double() - ref).abs().max()


@pytest.mark.parametrize("rows", range(1, NATIVE_INT4_MAX_ROWS + 1))
@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (576, 576), (96, 1536)])
def test_matches_dequantized_weights(int4, rows: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows * 100 + n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    q, d, m = q4_1_codes(w)
    x = torch.randn(rows, k, generator=g).bfloat16()
    _check(int4.linear(x, int4.pack(w)), x, dequantize(q, d, m))


def test_codes_cover_every_nibble_and_row_strided_views(int4) -> None:
    """Every code 0..15 in every position of a group (so a wrong nibble / lane mapping cannot hide), and x given
    as a view with odd row stride and a column offset."""
    n, k = 32, 64
    q = (torch.arange(n * k).view(n, k) * 7 + torch.arange(n).view(n, 1)) % 16
    d = torch.linspace(0.01, 0.02, n * k // INT4_GROUP).view(n, -1).half().float()
    m = torch.linspace(-0.1, 0.1, n * k // INT4_GROUP).view(n, -1).half().float()
    w = dequantize(q, d, m)
    qq, dd, mm = q4_1_codes(w)
    assert torch.equal(dequantize(qq, dd, mm), w)
    base = torch.randn(10, 151).bfloat16()
    x = base[2:, 13:77]  # 8 rows, 151 elements apart
    y = int4.linear(x, int4.pack(w))
    _check(y, x, w)
    assert torch.equal(y, int4.linear(x.contiguous(), int4.pack(w)))


@pytest.mark.model
def test_recovers_the_gguf_q4_1_groups_exactly(default_model_path) -> None:
    """A Q4_1 layer of the default GGUF, dequantized by the loader, re-coded: d * q + m gives back the very same
    float32 weights (the file's own codes, fp16 scales and minima)."""
    cfg = read_model_config(default_model_path)
    for name, w in iter_weights(default_model_path, cfg):
        if name == "model.layers.0.mlp.down_proj.weight":
            q, d, m = q4_1_codes(w)
            assert torch.equal(dequantize(q, d, m), w.float())
            return
    pytest.fail("down_proj of layer 0 not found")


@pytest.mark.model
def test_q8_0_planes_hold_the_gguf_head_exactly(int4, default_model_path) -> None:
    """The default GGUF's token_embd (Q8_0; SmolLM2 ties the output head to it), dequantized by the loader, as
    two int4 planes: their sum is the very same float32 weight, and the kernel's product matches it."""
    cfg = read_model_config(default_model_path)
    w = next(t for name, t in iter_weights(default_model_path, cfg) if name == "model.embed_tokens.weight").float()
    codes, d, m = q8_0_planes(w)
    assert codes.shape == (2, *w.shape) and int(codes.max()) <= 15
    assert torch.equal(dequantize(codes[0], d[0], m[0]) + dequantize(codes[1], d[1], m[1]), w)
    rows = w[:2048]  # the kernel on a slice (fast)
    x = torch.randn(2, w.shape[1]).bfloat16()
    _check(int4.linear(x, int4.pack_q8_0(rows)), x, rows)


def test_q8_0_planes_round_like_gguf(int4) -> None:
    """On arbitrary weights the planes are Q8_0's rounding: max|w| / 127 per group, |error| <= d / 2."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=g)
    w[0, :32] = 0.0  # an all-zero group
    codes, d, m = q8_0_planes(w)
    back = dequantize(codes[0], d[0], m[0]) + dequantize(codes[1], d[1], m[1])
    step = d[1].repeat_interleave(INT4_GROUP, 1)
    assert ((back - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(back[0, :32], torch.zeros(32))
    x = torch.randn(1, 128, generator=g).bfloat16()
    _check(int4.linear(x, int4.pack_q8_0(w)), x, back)


def test_rejects_bad_input(int4) -> None:
    ops = int4.ops
    w = torch.randn(32, 64)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.int4_pack(torch.zeros(24, 64, dtype=torch.uint8), torch.zeros(24, 2), torch.zeros(24, 2))
    with pytest.raises(RuntimeError, match=r"\[0, 15\]"):
        ops.int4_pack(torch.full((16, 32), 16, dtype=torch.uint8), torch.zeros(16, 1), torch.zeros(16, 1))
    packed = int4.pack(w)
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        ops.int4_linear(torch.zeros(9, 64, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="features"):
        ops.int4_linear(torch.zeros(1, 32, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.int4_linear(torch.zeros(1, 64), packed)


def test_int4_layer_runs_native_int4_then_the_bf16_form(int4) -> None:
    """An int4 bf16 layer runs the native kernel for 1..8 rows and the bf16 path above; the same layer built
    without the native kernels (the torch plan) runs torch's int4 kernel for one row. All of them compute the same
    product up to rounding."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 96, generator=g) * 0.05
    kernels = MatmulKernels(onednn=True, int4=int4)
    layer = make_linear([(w, None)], dtype=torch.bfloat16, quant="int4", kernels=kernels)
    assert isinstance(layer.path, NativeInt4Weight) and layer.path.kernel is int4
    assert layer.path.max_rows == NATIVE_INT4_MAX_ROWS and isinstance(layer.path.above, PackedBf16Weight)
    wq = dequantize(*q4_1_codes(w))
    for rows in (1, NATIVE_INT4_MAX_ROWS):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        y = layer(x)
        assert torch.equal(y, int4.linear(x, layer.path.packed))
        assert layer.native_call(rows).weight is layer.path.packed
        _check(y, x, wq)
    x = torch.randn(NATIVE_INT4_MAX_ROWS + 1, 96, generator=g).bfloat16()
    _check(layer(x), x, w.bfloat16())  # the dense bf16 weight above the int4 rows
    assert layer.native_call(NATIVE_INT4_MAX_ROWS + 1) is None
    torch_path = make_linear([(w, None)], dtype=torch.bfloat16, quant="int4", kernels=MatmulKernels(onednn=True))
    assert isinstance(torch_path.path, Int4Weight) and torch_path.path.max_rows == INT4_MAX_ROWS_PACKED
    assert torch_path.native_call(1) is None
    # torch's int4 form rounds each group's scale and zero to bf16 (8 bits; the native form keeps fp16), so it
    # sits further from the exact product: ~0.03 on outputs of ~1 here
    x1 = x[:1]
    torch.testing.assert_close(torch_path(x1).float(), (x1.double() @ wq.double().T).float(), atol=8e-2, rtol=2e-2)
    assert torch.equal(torch_path(x), layer(x))  # the same bf16 form above


def test_q8_0_head(int4) -> None:
    """A q8_0 layer runs the two-plane kernel for up to NATIVE_Q8_0_MAX_ROWS rows and its bf16 weight above
    (here over the VNNI kernel where it runs); without the native kernels it is a plain bf16 layer."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(96, 64, generator=g)
    layer = make_linear([(w, None)], dtype=torch.bfloat16, quant="q8_0",
                        kernels=MatmulKernels.available("cpu", torch.bfloat16))
    assert isinstance(layer.path, NativeInt4Weight) and layer.path.max_rows == NATIVE_Q8_0_MAX_ROWS
    assert layer.quant == "q8_0" and isinstance(layer.path.above, (VnniWeight, PackedBf16Weight))
    codes, d, m = q8_0_planes(w)
    wq = dequantize(codes[0], d[0], m[0]) + dequantize(codes[1], d[1], m[1])
    x = torch.randn(NATIVE_Q8_0_MAX_ROWS, 64, generator=g).bfloat16()
    assert torch.equal(layer(x), int4.linear(x, layer.path.packed))
    _check(layer(x), x, wq)
    x3 = torch.randn(NATIVE_Q8_0_MAX_ROWS + 1, 64, generator=g).bfloat16()
    _check(layer(x3), x3, w.bfloat16())
    assert layer.native_call(NATIVE_Q8_0_MAX_ROWS).weight is layer.path.packed
    plain = make_linear([(w, None)], dtype=torch.bfloat16, quant="q8_0", kernels=MatmulKernels(onednn=True))
    assert isinstance(plain.path, PackedBf16Weight) and plain.native_call(1) is None
    _check(plain(x), x, w.bfloat16())
