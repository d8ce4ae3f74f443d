"""The native AMX bf16 GEMM (parrot/engine/kernels/amx_gemm.cpp) and FastLinear's per-row-count kernel choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parrot.engine.layers.linear import FastLinear
from parrot.engine.layers.packed import AMX_MAX_ROWS, amx_ops


@pytest.fixture(scope="module")
def amx(native_kernel):
    ops = amx_ops()
    if ops is None:
        pytest.skip("AMX bf16 is not available on this CPU/OS (the engine then uses oneDNN)")
    return ops


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y (bf16) equals x @ w.T computed in float64, up to bf16 rounding of the output (fp32 accumulation)."""
    ref = x.double() @ w.double().T
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    tol = ref.abs() * 2.0**-8 + 1e-2  # half an ulp of bf16 plus fp32-accumulation slack
    assert ((y.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("m,k,n", [(1, 32, 32), (2, 64, 64), (5, 576, 960), (15, 96, 32), (16, 576, 576),
                                   (17, 1536, 576), (31, 64, 96), (32, 128, 64), (33, 64, 32), (64, 576, 320),
                                   (130, 64, 32)])
def test_amx_linear_matches_float64(amx, m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    _check(amx.amx_linear(x, amx.amx_pack(w)), x, w)


def test_amx_linear_reads_row_strided_views(amx) -> None:
    w = torch.randn(64, 96).bfloat16()
    base = torch.randn(20, 200).bfloat16()
    x = base[3:, 40:136]  # rows 200 elements apart, a column offset
    y = amx.amx_linear(x, amx.amx_pack(w))
    _check(y, x, w)
    assert torch.equal(y, amx.amx_linear(x.contiguous(), amx.amx_pack(w)))


def test_amx_pack_layout(amx) -> None:
    """P[n][kb][j][r][c][i] == W[32n + 16j + c][32kb + 2r + i] (the comment in amx_gemm.cpp)."""
    w = (torch.arange(64 * 96) % 251).float().view(64, 96).bfloat16()  # small integers are exact in bf16
    p = amx.amx_pack(w)
    assert p.shape == (2, 3, 2, 16, 16, 2)
    for n, kb, j, r, c, i in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 15, 15, 1), (0, 1, 1, 3, 7, 0), (1, 0, 0, 9, 2, 1)]:
        assert p[n, kb, j, r, c, i] == w[32 * n + 16 * j + c, 32 * kb + 2 * r + i]


def test_amx_rejects_bad_shapes_and_dtypes(amx) -> None:
    with pytest.raises(RuntimeError, match="multiples of 32"):
        amx.amx_pack(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx.amx_pack(torch.zeros(64, 64))
    p = amx.amx_pack(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        amx.amx_linear(torch.zeros(4, 96, dtype=torch.bfloat16), p)
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx.amx_linear(torch.zeros(4, 64), p)
    with pytest.raises(RuntimeError, match="amx_pack"):
        amx.amx_linear(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16))


def test_fast_linear_uses_amx_for_decode_rows_and_onednn_above(amx, monkeypatch) -> None:
    w = torch.randn(96, 64)
    layer = FastLinear(w, dtype=torch.bfloat16, pack=True)
    assert layer.amx_weight is not None and layer.packed_decode is None and layer.weight is None
    assert torch.equal(layer.dense_weight(), w.bfloat16())
    calls: list[int] = []
    real = layer.amx.amx_linear

    class Spy:
        def amx_linear(self, x, p):
            calls.append(x.shape[0])
            return real(x, p)

    monkeypatch.setattr(layer, "amx", Spy())
    for rows in (1, 2, AMX_MAX_ROWS, AMX_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 64).bfloat16()
        _check(layer(x), x, w.bfloat16())
    assert calls == [1, 2, AMX_MAX_ROWS]
    # a shape the kernel cannot take keeps the oneDNN decode pack
    odd = FastLinear(torch.randn(40, 64), dtype=torch.bfloat16, pack=True)
    assert odd.amx_weight is None and odd.packed_decode is not None
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(odd(x), F.linear(x, odd.dense_weight()))


def test_engine_setting_torch_turns_the_amx_matmul_off(amx) -> None:
    """attention_kernel="torch" means pure torch everywhere: no layer keeps calling the native matmul."""
    from parrot.engine.builder import build_engine
    from parrot.engine.settings import EngineSettings

    layers = {}
    for mode in ("auto", "torch"):
        eng = build_engine(EngineSettings(random_model="tiny", dtype="bfloat16", attention_kernel=mode))
        try:
            layers[mode] = [m.amx is not None for m in eng.runner.model.modules() if isinstance(m, FastLinear)]
        finally:
            eng.shutdown()
    assert any(layers["auto"]) and not any(layers["torch"])
