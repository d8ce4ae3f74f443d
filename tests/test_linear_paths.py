"""Which weight object runs each matmul (layers/linear.py): the pure choice per NumericsPlan of every CPU path --
with synthetic kernels, so the AMX / AVX512-BF16 choices are checked on any machine -- and, on this machine, the
layers an engine actually builds for its plan."""

from __future__ import annotations

import pytest
import torch

from parrot.engine.cpu import CpuInfo, CpuPath
from parrot.engine.layers import linear as linear_mod
from parrot.engine.layers.int4 import (INT4_MAX_ROWS, INT4_MAX_ROWS_PACKED, NATIVE_INT4_MAX_ROWS,
                                       NATIVE_Q8_0_MAX_ROWS, Int4Weight, NativeInt4, NativeInt4Weight)
from parrot.engine.layers.int8 import INT8_MAX_ROWS, Int8Weight
from parrot.engine.layers.linear import LinearPath, MatmulKernels, choose_path
from parrot.engine.layers.packed import VNNI_MAX_ROWS, PackedBf16Weight, VnniKernel, VnniWeight
from parrot.engine.layers.qdot import QDotKernel, QDotWeight
from parrot.engine.layers.weight import DenseWeight
from parrot.engine.numerics import make_plan

CPU = CpuInfo(arch="x86_64", model="synthetic", flags=frozenset())
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PACKABLE = [(64, 96)]  # both dims multiples of 32: every kernel takes it
ODD = [(40, 36)]  # no kernel takes it (n % 16, k % 32)
FUSED_ODD = [(64, 96), (4, 96)]  # qkv-like parts, one of which the qdot kernel cannot pack


@pytest.fixture
def fake_kernels(monkeypatch) -> None:
    """Every kernel 'runs' (never called: the choice only looks at which exist); oneDNN packing for bf16."""
    monkeypatch.setattr(linear_mod, "vnni_kernel",
                        lambda backend=None: VnniKernel(None, backend or "amx", VNNI_MAX_ROWS[backend or "amx"]))
    monkeypatch.setattr(linear_mod, "native_int4", lambda: NativeInt4(None))
    monkeypatch.setattr(linear_mod, "qdot_kernel", lambda variant, terms=2: QDotKernel(None, variant, terms))
    monkeypatch.setattr(linear_mod, "packed_gemm_available", lambda device, dtype: dtype == torch.bfloat16)


def plan_kernels(path: CpuPath, **settings) -> tuple[torch.dtype, str, MatmulKernels]:
    plan = make_plan(path, CPU, **settings)
    dtype = DTYPES[plan.dtype]
    return dtype, plan.weight_quant, MatmulKernels.for_plan(plan, "cpu", dtype)


@pytest.mark.parametrize("path,backend", [(CpuPath.AMX, "amx"), (CpuPath.AVX512_BF16, "avx512_bf16")])
def test_bf16_plans_take_native_int4_over_the_vnni_kernel(fake_kernels, path: CpuPath, backend: str) -> None:
    dtype, quant, kernels = plan_kernels(path)
    assert (dtype, quant) == (torch.bfloat16, "int4") and kernels.vnni.backend == backend
    assert kernels.int4 is not None and kernels.qdot is None
    assert choose_path(quant, dtype, PACKABLE, kernels) == LinearPath(VnniWeight, NativeInt4Weight,
                                                                      NATIVE_INT4_MAX_ROWS)
    assert choose_path("q8_0", dtype, PACKABLE, kernels) == LinearPath(VnniWeight, NativeInt4Weight,
                                                                       NATIVE_Q8_0_MAX_ROWS)
    assert choose_path("none", dtype, PACKABLE, kernels) == LinearPath(VnniWeight)
    assert choose_path("int8", dtype, PACKABLE, kernels) == LinearPath(VnniWeight, Int8Weight, INT8_MAX_ROWS)
    # shapes the native kernels cannot take: torch's int4 over oneDNN's packs, or int8 where the int4 groups of 32
    # cannot split in_features
    assert choose_path(quant, dtype, [(48, 64)], kernels) == LinearPath(PackedBf16Weight, NativeInt4Weight,
                                                                        NATIVE_INT4_MAX_ROWS)
    assert choose_path(quant, dtype, [(40, 64)], kernels) == LinearPath(PackedBf16Weight, Int4Weight,
                                                                        INT4_MAX_ROWS_PACKED)
    assert choose_path(quant, dtype, ODD, kernels) == LinearPath(PackedBf16Weight, Int8Weight, INT8_MAX_ROWS)
    assert choose_path("q8_0", dtype, ODD, kernels) == LinearPath(PackedBf16Weight)


@pytest.mark.parametrize("path", [CpuPath.AVX512, CpuPath.AVX2])
def test_integer_dot_plans_take_qdot_where_it_packs(fake_kernels, path: CpuPath) -> None:
    dtype, quant, kernels = plan_kernels(path)
    assert (dtype, quant) == (torch.float32, "auto") and kernels.qdot.variant == "avx2" and kernels.qdot.terms == 2
    assert kernels.vnni is None and kernels.int4 is None and not kernels.onednn
    for q in ("int4", "int8"):  # what "auto" resolves to per matmul (models/llama.py: the file's formats)
        assert choose_path(q, dtype, PACKABLE, kernels) == LinearPath(QDotWeight)
        assert choose_path(q, dtype, ODD, kernels) == LinearPath(DenseWeight)  # exact
        assert choose_path(q, dtype, FUSED_ODD, kernels) == LinearPath(DenseWeight)
    assert plan_kernels(path, act_quant="int8")[2].qdot.terms == 1
    # weight_quant="none" on these paths: torch's fp32 matmuls
    dtype, quant, kernels = plan_kernels(path, weight_quant="none")
    assert kernels == MatmulKernels() and choose_path(quant, dtype, PACKABLE, kernels) == LinearPath(DenseWeight)


def test_torch_plans_take_torch_kernels(fake_kernels) -> None:
    """attention_kernel="torch" (native=False) on a bf16 CPU: torch's int4 for one row over oneDNN's packs; the
    portable path: dense fp32."""
    dtype, quant, kernels = plan_kernels(CpuPath.AMX, native=False)
    assert kernels == MatmulKernels(onednn=True)
    assert choose_path(quant, dtype, PACKABLE, kernels) == LinearPath(PackedBf16Weight, Int4Weight,
                                                                      INT4_MAX_ROWS_PACKED)
    assert choose_path("q8_0", dtype, PACKABLE, kernels) == LinearPath(PackedBf16Weight)
    dtype, quant, kernels = plan_kernels(CpuPath.PORTABLE)
    assert (dtype, quant, kernels) == (torch.float32, "none", MatmulKernels())
    assert choose_path(quant, dtype, PACKABLE, kernels) == LinearPath(DenseWeight)
    assert choose_path("int8", dtype, PACKABLE, kernels) == LinearPath(DenseWeight, Int8Weight, INT8_MAX_ROWS)
    # bf16 without oneDNN packing: torch's int4 up to its own limit over the dense weight
    assert choose_path("int4", torch.bfloat16, PACKABLE, MatmulKernels()) == LinearPath(DenseWeight, Int4Weight,
                                                                                        INT4_MAX_ROWS)
    # in_features the int4 groups (32) cannot split (a small model's width, e.g. 112): the int8 rule, on every plan
    # whose int4 is not qdot or the native kernel (both of which refuse the shape too)
    odd = [(64, 112)]
    assert choose_path("int4", torch.bfloat16, odd, MatmulKernels()) == LinearPath(DenseWeight, Int8Weight,
                                                                                   INT8_MAX_ROWS)
    assert choose_path("int4", torch.float32, odd, MatmulKernels()) == LinearPath(DenseWeight, Int8Weight,
                                                                                  INT8_MAX_ROWS)


def test_bad_quant_is_rejected() -> None:
    with pytest.raises(ValueError, match="quant must be one of"):
        choose_path("int3", torch.float32, PACKABLE, MatmulKernels())


def test_this_machines_engine_builds_its_plans_paths(native_kernel) -> None:
    """An engine on this machine (the tiny random model) holds, per matmul, the path choose_path gives for its
    plan, and the matmul kernel the plan names runs in every layer: qdot on the integer-dot plans, VNNI on the bf16
    ones, no native kernel on the torch plan (attention_kernel="torch")."""
    from parrot.engine.builder import build_engine, plan_for
    from parrot.engine.settings import EngineSettings

    for mode in ("auto", "torch"):
        settings = EngineSettings(random_model="tiny", kv_cache_tokens=512, attention_kernel=mode)
        plan = plan_for(settings)
        dtype = DTYPES[plan.dtype]
        kernels = MatmulKernels.for_plan(plan, "cpu", dtype)
        eng = build_engine(settings)
        try:
            assert eng.status().extra["numerics"]["matmul"] == plan.matmul
            model = eng.runner.model
            linears = model.linears()
            assert len(linears) == 4 * len(model.layers) + 1
            for lin in linears:
                want = choose_path(lin.quant, dtype, [(lin.out_features, lin.in_features)], kernels)
                if want.few is None:
                    assert type(lin.path) is want.base
                else:
                    assert (type(lin.path), type(lin.path.above), lin.path.max_rows) == (want.few, want.base,
                                                                                          want.few_rows)
                kinds = {type(f) for f in lin.path.forms()}
                if plan.qdot_variant:
                    assert kinds == {QDotWeight} and lin.path.kernel.variant == plan.qdot_variant
                elif plan.vnni_backend:
                    vnni = next(f for f in lin.path.forms() if isinstance(f, VnniWeight))
                    assert vnni.kernel.backend == plan.vnni_backend
                else:
                    assert plan.matmul == "torch" and not kinds & {QDotWeight, VnniWeight, NativeInt4Weight}
            if mode == "torch":
                assert plan.matmul == "torch"
        finally:
            eng.shutdown()
