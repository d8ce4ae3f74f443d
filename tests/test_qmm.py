"""The native quantized matmul (kernels/qpack.cpp, qmm.cpp): GGUF codes packed bit for bit, every variant this
machine runs bit-identical to the scalar twin, errors bounded against float64, bad input refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from parrot.engine.layers.quant import (GGML_TYPE_IDS, ActNumerics, QTensor, QuantEmbedding, QuantKernel,
                                        QuantWeight, packable, quantize_float)

FORMATS = sorted(GGML_TYPE_IDS)


@pytest.fixture(scope="module")
def ops(native_kernel):
    """The kernel library (built by the native_kernel fixture)."""
    return torch.ops.parrot_kernels


@pytest.fixture(scope="module")
def variants(ops) -> list[str]:
    return list(ops.qmm_variants())


def random_raw(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF blocks of ``fmt`` with random codes: random bytes everywhere, the fp16 scale fields set to sane
    values (a random fp16 may be inf or NaN)."""
    qt = GGMLQuantizationType[fmt.upper()]
    rng = np.random.default_rng(seed)
    values, size = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)

    def set_half(off: int, lo: float, hi: float) -> None:
        raw[:, :, off:off + 2] = rng.uniform(lo, hi, size=raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(
            *raw.shape[:2], 2)

    if fmt in ("q4_0", "q5_0", "q8_0"):
        set_half(0, -0.02, 0.02)
    elif fmt in ("q4_1", "q5_1"):
        set_half(0, 0.0, 0.01)
        set_half(2, -0.1, 0.0)
    elif fmt in ("q4_k", "q5_k"):
        set_half(0, 0.0, 0.001)
        set_half(2, 0.0, 0.001)
    elif fmt == "q6_k":
        set_half(208, -0.001, 0.001)
    return raw.reshape(n, -1)


def qtensor(fmt: str, n: int, k: int, seed: int = 0) -> QTensor:
    return QTensor(fmt, torch.from_numpy(random_raw(fmt, n, k, seed)), (n, k))


def reference(t: QTensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(t.raw.numpy(), GGMLQuantizationType[t.fmt.upper()]).reshape(t.shape).copy())


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_keeps_the_files_codes_and_scales_exactly(ops, fmt: str) -> None:
    """qpack then qdequantize gives gguf's own dequantization bit for bit: no float round trip, no rounding."""
    t = qtensor(fmt, 48, 512)
    packed = ops.qpack([t.raw], [GGML_TYPE_IDS[fmt]], 512)
    assert torch.equal(ops.qdequantize(packed), reference(t))
    assert list(ops.qinfo(packed)) == [512, 48, GGML_TYPE_IDS[fmt], 0, 48]


def test_mixed_format_segments_and_embedding_rows(ops) -> None:
    """A fused matmul whose parts come in different formats (Q4_K_M's q/k Q4_K, v Q6_K) packs into one weight;
    qembed reads any row of it as qdequantize does."""
    parts = [qtensor("q4_k", 32, 256, 1), qtensor("q6_k", 16, 256, 2), qtensor("q8_0", 16, 256, 3)]
    packed = ops.qpack([p.raw for p in parts], [GGML_TYPE_IDS[p.fmt] for p in parts], 256)
    want = torch.cat([reference(p) for p in parts])
    assert torch.equal(ops.qdequantize(packed), want)
    ids = torch.tensor([0, 47, 31, 32, 63, 5])
    assert torch.equal(ops.qembed(packed, ids, torch.float32), want[ids])
    assert torch.equal(ops.qembed(packed, ids, torch.bfloat16), want[ids].bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 6, 17])
def test_variants_are_bit_identical_and_close_to_float64(ops, variants, fmt: str, rows: int) -> None:
    """Every variant computes the same integers and fp32 operations as the scalar twin; two activation terms are
    within 1e-4 of the float64 product (relative to its largest value), one term within 2e-2."""
    t = qtensor(fmt, 32, 512, seed=rows)
    packed = ops.qpack([t.raw], [GGML_TYPE_IDS[fmt]], 512)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ reference(t).double().T
    for terms, bound in ((2, 1e-4), (1, 2e-2)):
        outs = {v: ops.qlinear(x, packed, v, terms, 0, 0) for v in variants}
        for v, out in outs.items():
            assert torch.equal(out, outs["scalar"]), (v, terms)
        err = ((outs["scalar"].double() - want).abs().max() / want.abs().max()).item()
        assert err < bound, (terms, err)


def test_x2_rows_and_big_rows_pick_the_numerics_by_row_count(ops, variants) -> None:
    """x2_rows: two terms up to that many rows whatever ``terms`` says; big_rows: from that many rows the weight
    dequantized a tile / chunk at a time through a dense GEMM -- float32 chunks on torch's GEMM for float32 x (the
    dequantized weight times x, to fp32 rounding), bf16 tiles on the VNNI GEMM for bf16 x where AVX512-BF16 runs
    (bf16 products of the weight rounded to bf16, fp32 sums)."""
    t = qtensor("q4_1", 64, 256)
    packed = ops.qpack([t.raw], [GGML_TYPE_IDS["q4_1"]], 256)
    x = torch.randn(8, 256)
    for v in variants:
        assert torch.equal(ops.qlinear(x, packed, v, 1, 8, 0), ops.qlinear(x, packed, v, 2, 0, 0))
        assert not torch.equal(ops.qlinear(x, packed, v, 1, 7, 0), ops.qlinear(x, packed, v, 2, 0, 0))
        torch.testing.assert_close(ops.qlinear(x, packed, v, 2, 0, 8), x @ reference(t).T, rtol=1e-5, atol=1e-5)
    for rows, n in ((50, 64), (13, 48)):  # a whole number of 32-row panels, and a lone 16-row block at the end
        t = qtensor("q4_k", n, 2304, seed=n)  # 2304 inputs: more than one K chunk of the bf16 path
        packed = ops.qpack([t.raw], [GGML_TYPE_IDS["q4_k"]], 2304)
        xb = torch.randn(rows, 2304).bfloat16()
        want = xb.double() @ reference(t).bfloat16().double().T
        got = ops.qlinear(xb, packed, variants[0], 2, 0, 1)
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-2


def test_bf16_input_strided_rows_and_empty_batches(ops, variants) -> None:
    t = qtensor("q4_k", 32, 512)
    packed = ops.qpack([t.raw], [GGML_TYPE_IDS["q4_k"]], 512)
    x = torch.randn(5, 512).bfloat16()
    for v in variants:
        y = ops.qlinear(x, packed, v, 2, 0, 0)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, ops.qlinear(x.float(), packed, v, 2, 0, 0).bfloat16())
        wide = torch.randn(3, 600)
        assert torch.equal(ops.qlinear(wide[:, 10:522], packed, v, 1, 0, 0),
                           ops.qlinear(wide[:, 10:522].contiguous(), packed, v, 1, 0, 0))
        assert ops.qlinear(torch.zeros(0, 512), packed, v, 2, 0, 0).shape == (0, 32)
    assert torch.equal(ops.qlinear(torch.zeros(2, 512), packed, "scalar", 2, 0, 0), torch.zeros(2, 32))


def test_rejects_bad_input(ops) -> None:
    t = qtensor("q4_0", 16, 64)
    packed = ops.qpack([t.raw], [GGML_TYPE_IDS["q4_0"]], 64)
    with pytest.raises(RuntimeError, match="features"):
        ops.qlinear(torch.zeros(1, 32), packed, "scalar", 2, 0, 0)
    with pytest.raises(RuntimeError, match="variant 'sse2'"):
        ops.qlinear(torch.zeros(1, 64), packed, "sse2", 2, 0, 0)
    with pytest.raises(RuntimeError, match="terms"):
        ops.qlinear(torch.zeros(1, 64), packed, "scalar", 3, 0, 0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.qlinear(torch.zeros(1, 64, dtype=torch.int32), packed, "scalar", 2, 0, 0)
    with pytest.raises(RuntimeError, match="magic"):
        ops.qlinear(torch.zeros(1, 64), torch.zeros(512, dtype=torch.uint8), "scalar", 2, 0, 0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.qpack([t.raw[:8]], [GGML_TYPE_IDS["q4_0"]], 64)
    with pytest.raises(RuntimeError, match="unsupported format"):
        ops.qpack([t.raw], [19], 64)
    with pytest.raises(RuntimeError, match=r"uint8 \[rows, 36\]"):
        ops.qpack([t.raw[:, :18]], [GGML_TYPE_IDS["q4_0"]], 64)
    with pytest.raises(RuntimeError, match="outside"):
        ops.qembed(packed, torch.tensor([16]), torch.float32)
    assert not packable((8, 64), "q4_0") and not packable((16, 64), "q3_k") and packable((16, 64), "q4_0")


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_floats_quantize_through_ggufs_reference_quantizer(fmt: str) -> None:
    """quantize_float writes real GGUF blocks: gguf's dequantization of them is within the format's step."""
    w = torch.randn(32, 256) * 0.05
    t = quantize_float(w, fmt)
    assert t.shape == (32, 256) and t.raw.dtype == torch.uint8
    step = {"q4_0": 16, "q4_1": 16, "q5_0": 32, "q5_1": 32, "q8_0": 256}[fmt]
    bound = (w.abs().max() * 2 / step).item()
    assert (t.dequantize() - w).abs().max().item() <= bound


def test_quant_weight_and_embedding_objects(ops, variants) -> None:
    parts = [qtensor("q4_k", 32, 256, 1), qtensor("q6_k", 16, 256, 2)]
    kernel = QuantKernel(ops, variants[0], fast=ActNumerics(terms=1, x2_rows=4))
    w = QuantWeight(parts, kernel, dtype=torch.float32)
    assert (w.out_features, w.in_features, w.quant) == (48, 256, "q4_k+q6_k")
    assert torch.equal(w.dense(), torch.cat([reference(p) for p in parts]))
    x = torch.randn(3, 256)
    assert torch.equal(w.forward(x, precise=False), ops.qlinear(x, w.packed, variants[0], 2, 0, 0))  # 3 <= 4 rows
    big = torch.randn(6, 256)
    assert torch.equal(w.forward(big, precise=False), ops.qlinear(big, w.packed, variants[0], 1, 0, 0))
    assert torch.equal(w.forward(big), ops.qlinear(big, w.packed, variants[0], 2, 0, 0))  # precise: the default
    assert w.native_call(64).weight is w.packed and w.decode_bytes() == w.packed.nbytes
    emb = QuantEmbedding(w.packed, ops, torch.bfloat16)
    assert torch.equal(emb.lookup(torch.tensor([2, 40])), w.dense()[[2, 40]].bfloat16())
    assert emb.nbytes == w.packed.nbytes


@pytest.mark.model
def test_the_default_gguf_is_packed_from_its_own_bytes(ops, default_model_path) -> None:
    """SmolLM2's Q4_1 matrices and Q8_0 token table, straight from the mapped file: packed and read back, they are
    gguf's dequantization of the file bit for bit."""
    from parrot.engine.files.config import read_model_config
    from parrot.engine.loader import iter_weights

    seen = {}
    for name, t in iter_weights(default_model_path, read_model_config(default_model_path), keep_codes=True):
        if isinstance(t, QTensor) and t.fmt not in seen and packable(t.shape, t.fmt):
            seen[t.fmt] = (name, t)
    assert set(seen) == {"q4_1", "q8_0"}
    for fmt, (name, t) in seen.items():
        packed = ops.qpack([t.raw], [GGML_TYPE_IDS[fmt]], t.shape[1])
        assert torch.equal(ops.qdequantize(packed), reference(t)), name
