"""The native bf16 GEMM (parrot/engine/kernels/vnni_gemm.cpp), every backend this machine runs, and the VnniWeight
path's per-row-count kernel choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parrot.engine.layers.linear import Linear, MatmulKernels, make_linear
from parrot.engine.layers.packed import PackedBf16Weight, VnniKernel, VnniWeight, vnni_kernel, vnni_kernels

BACKENDS = ("amx", "avx512_bf16")


@pytest.fixture(scope="module", params=BACKENDS)
def vnni(request, native_kernel) -> VnniKernel:
    """Each backend in turn (a machine with AMX also runs the AVX-512 one); skipped where it does not run."""
    kernel = next((k for k in vnni_kernels() if k.backend == request.param), None)
    if kernel is None:
        pytest.skip(f"{request.param} bf16 is not available on this CPU/OS (the engine then uses another backend "
                    "or oneDNN)")
    return kernel


@pytest.fixture(scope="module")
def best(native_kernel) -> VnniKernel:
    kernel = vnni_kernel()
    if kernel is None:
        pytest.skip("neither AMX nor AVX512-BF16 is available on this CPU (the engine then uses oneDNN)")
    return kernel


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y (bf16) equals x @ w.T computed in float64, up to bf16 rounding of the output (fp32 accumulation)."""
    ref = x.double() @ w.double().T
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    tol = ref.abs() * 2.0**-8 + 1e-2  # half an ulp of bf16 plus fp32-accumulation slack
    assert ((y.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("m,k,n", [(1, 32, 32), (2, 64, 64), (5, 576, 960), (15, 96, 32), (16, 576, 576),
                                   (17, 1536, 576), (31, 64, 96), (32, 128, 64), (33, 64, 32), (64, 576, 320),
                                   (130, 64, 32), (12, 64, 64), (13, 96, 64), (25, 64, 32)])
def test_vnni_linear_matches_float64(vnni, m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    _check(vnni.linear(x, vnni.pack(w)), x, w)


def test_vnni_linear_reads_row_strided_views(vnni) -> None:
    w = torch.randn(64, 96).bfloat16()
    base = torch.randn(20, 201).bfloat16()
    x = base[3:, 41:137]  # rows 201 elements apart (odd: x pairs start at odd addresses), a column offset
    y = vnni.linear(x, vnni.pack(w))
    _check(y, x, w)
    assert torch.equal(y, vnni.linear(x.contiguous(), vnni.pack(w)))


def test_vnni_pack_layout(vnni) -> None:
    """P[n][kb][j][r][c][i] == W[32n + 16j + c][32kb + 2r + i] (the comment in vnni_gemm.cpp)."""
    w = (torch.arange(64 * 96) % 251).float().view(64, 96).bfloat16()  # small integers are exact in bf16
    p = vnni.pack(w)
    assert p.shape == (2, 3, 2, 16, 16, 2)
    for n, kb, j, r, c, i in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 15, 15, 1), (0, 1, 1, 3, 7, 0), (1, 0, 0, 9, 2, 1)]:
        assert p[n, kb, j, r, c, i] == w[32 * n + 16 * j + c, 32 * kb + 2 * r + i]


def test_vnni_rejects_bad_shapes_dtypes_and_backends(vnni) -> None:
    with pytest.raises(RuntimeError, match="multiples of 32"):
        vnni.pack(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        vnni.pack(torch.zeros(64, 64))
    p = vnni.pack(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        vnni.linear(torch.zeros(4, 96, dtype=torch.bfloat16), p)
    with pytest.raises(RuntimeError, match="bfloat16"):
        vnni.linear(torch.zeros(4, 64), p)
    with pytest.raises(RuntimeError, match="vnni_pack"):
        vnni.linear(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="backend 'sse2' is not available"):
        vnni.ops.vnni_linear(torch.zeros(4, 64, dtype=torch.bfloat16), p, "sse2")


def test_backends_agree(native_kernel) -> None:
    """Where both run, AMX and AVX-512 compute the same products (fp32 sums in a different order: bf16-close)."""
    kernels = vnni_kernels()
    if len(kernels) < 2:
        pytest.skip("only one backend runs here")
    w = torch.randn(96, 576).bfloat16()
    x = torch.randn(20, 576).bfloat16()
    a, b = (k.linear(x, k.pack(w)) for k in kernels)
    assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-2)


def test_vnni_weight_is_the_one_form_at_every_row_count(best, monkeypatch) -> None:
    """A dense bf16 layer keeps the VNNI pack alone (no oneDNN copy beside it) and runs it at every row count;
    a shape the kernel cannot take keeps one oneDNN pack instead."""
    kernels = MatmulKernels(onednn=True, vnni=best)
    w = torch.randn(96, 64)
    layer = make_linear([w], dtype=torch.bfloat16, quant="none", kernels=kernels)
    assert isinstance(layer.path, VnniWeight) and layer.path.kernel is best and layer.path.forms() == (layer.path,)
    assert torch.equal(layer.dense_weight(), w.bfloat16())
    assert layer.decode_bytes() == 96 * 64 * 2
    calls: list[int] = []

    class Spy:
        backend = best.backend

        def linear(self, x, p):
            calls.append(x.shape[0])
            return best.linear(x, p)

    monkeypatch.setattr(layer.path, "kernel", Spy())
    for rows in (1, 2, 64, 65, 200):
        x = torch.randn(rows, 64).bfloat16()
        _check(layer(x), x, w.bfloat16())
        assert layer.native_call(rows).weight is layer.path.packed
    assert calls == [1, 2, 64, 65, 200]
    odd = make_linear([torch.randn(40, 64)], dtype=torch.bfloat16, quant="none", kernels=kernels)
    assert isinstance(odd.path, PackedBf16Weight) and odd.path.forms() == (odd.path,)
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(odd(x), F.linear(x, odd.dense_weight()))


def test_engine_setting_torch_turns_the_native_matmul_off(best) -> None:
    """attention_kernel="torch" means pure torch everywhere: no layer keeps calling the native matmul."""
    from parrot.engine.loader.builder import build_engine
    from parrot.engine.settings import EngineSettings

    layers = {}
    for mode in ("auto", "torch"):
        eng = build_engine(EngineSettings(random_model="tiny", dtype="bfloat16", attention_kernel=mode))
        try:
            layers[mode] = [isinstance(m.path, VnniWeight) for m in eng.runner.model.modules() if isinstance(m, Linear)]
        finally:
            eng.shutdown()
    assert any(layers["auto"]) and not any(layers["torch"])
