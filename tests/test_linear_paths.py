"""Which weight object runs each matmul (layers/linear.py): the pure choice per NumericsPlan of every CPU path --
with synthetic kernels, so the AMX / AVX512-BF16 / AVX2 choices are checked on any machine -- and, on this
machine, the layers an engine actually builds for its plan."""

from __future__ import annotations

import pytest
import torch

from parrot.engine.runtime.cpu import CpuInfo, CpuPath
from parrot.engine.layers import linear as linear_mod
from parrot.engine.layers.int4 import INT4_MAX_ROWS, INT4_MAX_ROWS_PACKED, Int4Weight
from parrot.engine.layers.int8 import INT8_MAX_ROWS, Int8Weight
from parrot.engine.layers.linear import LinearPath, MatmulKernels, choose_path
from parrot.engine.layers.packed import PackedBf16Weight, VnniKernel, VnniWeight
from parrot.engine.layers.quant import ActNumerics, QuantKernel, QuantWeight
from parrot.engine.layers.weight import DenseWeight
from parrot.engine.runtime.numerics import make_plan

CPU = CpuInfo(arch="x86_64", model="synthetic", flags=frozenset({"avx512_vnni"}))
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
F = None  # a float part
PACKABLE = [((64, 96), F)]  # both dims multiples of 32: every kernel takes it
ODD = [((40, 36), F)]  # no kernel takes it (rows % 16, cols % 32)
Q4K = [((64, 256), "q4_k")]
MIXED = [((32, 256), "q4_k"), ((16, 256), "q6_k"), ((16, 256), F)]  # a fused qkv: q, k coded, v float


@pytest.fixture
def fake_kernels(monkeypatch) -> None:
    """Every kernel 'runs' (never called: the choice only looks at which exist); oneDNN packing for bf16."""
    monkeypatch.setattr(linear_mod, "vnni_kernel", lambda backend=None: VnniKernel(None, backend or "amx"))
    monkeypatch.setattr(linear_mod, "quant_kernel",
                        lambda variant, fast=ActNumerics(), precise=None: QuantKernel(None, variant, fast,
                                                                                      precise or fast))
    monkeypatch.setattr(linear_mod, "packed_gemm_available", lambda device, dtype: dtype == torch.bfloat16)


def plan_kernels(path: CpuPath, **settings) -> tuple[torch.dtype, str, MatmulKernels]:
    plan = make_plan(path, CPU, **settings)
    dtype = DTYPES[plan.dtype]
    return dtype, plan.weight_quant, MatmulKernels.for_plan(plan, "cpu", dtype)


def choose(parts, dtype, quant, kernels) -> LinearPath:
    return choose_path(parts, dtype=dtype, quant=quant, kernels=kernels)


@pytest.mark.parametrize("path,backend", [(CpuPath.AMX, "amx"), (CpuPath.AVX512_BF16, "avx512_bf16")])
def test_bf16_plans_keep_gguf_codes_and_run_floats_dense(fake_kernels, path: CpuPath, backend: str) -> None:
    dtype, quant, kernels = plan_kernels(path)
    assert (dtype, quant) == (torch.bfloat16, "auto") and kernels.vnni.backend == backend
    assert kernels.quant.variant == "avx512vnni"
    assert choose(Q4K, dtype, quant, kernels) == LinearPath(QuantWeight, ("q4_k",))
    assert choose(MIXED, dtype, quant, kernels) == LinearPath(QuantWeight, ("q4_k", "q6_k", "q8_0"))
    assert choose(PACKABLE, dtype, quant, kernels) == LinearPath(VnniWeight)  # a float model: dense bf16
    assert choose(PACKABLE, dtype, "int4", kernels) == LinearPath(QuantWeight, ("q4_1",))
    assert choose(Q4K, dtype, "int8", kernels) == LinearPath(QuantWeight, ("q8_0",))
    assert choose(Q4K, dtype, "none", kernels) == LinearPath(VnniWeight)
    assert choose([((48, 64), F)], dtype, quant, kernels) == LinearPath(PackedBf16Weight)  # not VNNI-packable
    assert choose(ODD, dtype, "int4", kernels) == LinearPath(PackedBf16Weight)  # no kernel packs it: dense


@pytest.mark.parametrize("path", [CpuPath.AVX512, CpuPath.AVX2])
def test_fp32_plans_run_every_matrix_on_the_quantized_kernel(fake_kernels, path: CpuPath) -> None:
    dtype, quant, kernels = plan_kernels(path)
    assert (dtype, quant) == (torch.float32, "auto") and kernels.vnni is None and not kernels.onednn
    assert kernels.quant.variant == ("avx2" if path is CpuPath.AVX2 else "avx512vnni")
    assert choose(Q4K, dtype, quant, kernels) == LinearPath(QuantWeight, ("q4_k",))
    assert choose(PACKABLE, dtype, quant, kernels) == LinearPath(QuantWeight, ("q8_0",))  # floats as Q8_0
    assert choose(ODD, dtype, quant, kernels) == LinearPath(DenseWeight)  # exact
    assert kernels.quant.fast.terms == 1 and kernels.quant.precise.terms == 2
    assert plan_kernels(path, act_quant="int8")[2].quant.precise.terms == 1
    # weight_quant="none" on these paths: torch's fp32 matmuls
    dtype, quant, kernels = plan_kernels(path, weight_quant="none")
    assert kernels == MatmulKernels() and choose(Q4K, dtype, quant, kernels) == LinearPath(DenseWeight)


def test_torch_plans_take_torch_kernels(fake_kernels) -> None:
    """attention_kernel="torch" (native=False) on a bf16 CPU: torch's int4 for one row over oneDNN's pack; the
    portable path: dense fp32."""
    dtype, quant, kernels = plan_kernels(CpuPath.AMX, native=False)
    assert kernels == MatmulKernels(onednn=True)
    assert choose(Q4K, dtype, quant, kernels) == LinearPath(PackedBf16Weight, few=Int4Weight,
                                                            few_rows=INT4_MAX_ROWS_PACKED)
    dtype, quant, kernels = plan_kernels(CpuPath.PORTABLE)
    assert (dtype, quant, kernels) == (torch.float32, "none", MatmulKernels())
    assert choose(Q4K, dtype, quant, kernels) == LinearPath(DenseWeight)
    assert choose(PACKABLE, dtype, "int8", kernels) == LinearPath(DenseWeight, few=Int8Weight,
                                                                 few_rows=INT8_MAX_ROWS)
    # bf16 without oneDNN packing: torch's int4 up to its own limit over the dense weight
    assert choose(PACKABLE, torch.bfloat16, "int4", MatmulKernels()) == LinearPath(
        DenseWeight, few=Int4Weight, few_rows=INT4_MAX_ROWS)
    # in_features the int4 groups (32) cannot split (a small model's width, e.g. 112): the int8 rule
    odd = [((64, 112), F)]
    assert choose(odd, torch.bfloat16, "int4", MatmulKernels()) == LinearPath(DenseWeight, few=Int8Weight,
                                                                              few_rows=INT8_MAX_ROWS)


def test_bad_quant_is_rejected() -> None:
    with pytest.raises(ValueError, match="quant must be one of"):
        choose(PACKABLE, torch.float32, "int3", MatmulKernels())
    with pytest.raises(ValueError, match="one in_features"):
        choose([((16, 64), F), ((16, 32), F)], torch.float32, "auto", MatmulKernels())


def test_this_machines_engine_builds_its_plans_paths(native_kernel) -> None:
    """An engine on this machine (the tiny random model: float weights) holds, per matmul, the path choose_path
    gives for its plan, and one weight form each: the quantized kernel on the fp32 plans, VNNI on the bf16 ones,
    no native kernel on the torch plan (attention_kernel="torch")."""
    from parrot.engine.loader.builder import build_engine, plan_for
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
                # the head of an int4 model is Q8_0 (models/assembly.py)
                quant = "int8" if lin is model.lm_head and plan.weight_quant == "int4" else plan.weight_quant
                want = choose([((lin.out_features, lin.in_features), F)], dtype, quant, kernels)
                if want.few is None:
                    assert type(lin.path) is want.weight and lin.path.forms() == (lin.path,)
                else:
                    assert (type(lin.path), type(lin.path.above), lin.path.max_rows) == (want.few, want.weight,
                                                                                          want.few_rows)
                if isinstance(lin.path, QuantWeight):
                    assert lin.path.kernel.variant == plan.qmm
                elif isinstance(lin.path, VnniWeight):
                    assert lin.path.kernel.backend == plan.vnni
            if mode == "torch":
                assert plan.matmul == "torch"
                assert not any(isinstance(lin.path, (QuantWeight, VnniWeight)) for lin in linears)
        finally:
            eng.shutdown()
