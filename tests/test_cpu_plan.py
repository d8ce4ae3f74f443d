"""The CPU probe and the numerics plan (parrot/engine/runtime/cpu.py, parrot/engine/runtime/numerics.py): families and paths from
/proc/cpuinfo texts of each CPU family, the path choice (auto, forced, forced but impossible), the plan per path
with explicit settings applied, and an engine on this machine reporting its plan in its status and /v1/models."""

from __future__ import annotations

import pytest

from parrot.engine.runtime.cpu import CpuInfo, CpuPath, parse_cpuinfo, probe_cpu
from parrot.engine.runtime.numerics import (BIG_ROWS, DENSE_ROWS, X2_ROWS, KernelSupport, PathUnavailable, choose_path,
                                    make_plan)

_X86_BASE = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov sse sse2 ssse3 sse4_1 sse4_2 popcnt"
_AVX2 = _X86_BASE + " avx f16c fma avx2 bmi1 bmi2"
_AVX512 = _AVX2 + " avx512f avx512dq avx512cd avx512bw avx512vl"
CPUINFO = {
    "epyc-avx2": ("x86_64", "AMD EPYC 7B12", _AVX2),
    "alder-lake": ("x86_64", "12th Gen Intel(R) Core(TM) i7-1260P", _AVX2 + " avx_vnni"),
    "cascade-lake": ("x86_64", "Intel(R) Xeon(R) Gold 6248", _AVX512 + " avx512_vnni"),
    "zen5": ("x86_64", "AMD EPYC 9B45", _AVX512 + " avx512_vnni avx512_bf16"),
    "sapphire-rapids": ("x86_64", "Intel(R) Xeon(R) Platinum 8481C",
                        _AVX512 + " avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"),
    "old-x86": ("x86_64", "Intel(R) Xeon(R) CPU E5-2670", _X86_BASE + " avx"),
}
ALL_KERNELS = KernelSupport(built=True, vnni_backends=("amx", "avx512_bf16"),
                            qmm_variants=("avx512vnni", "avx2", "scalar"))


def x86(name: str) -> CpuInfo:
    arch, model, flags = CPUINFO[name]
    text = f"processor\t: 0\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
    return parse_cpuinfo(text, arch)


def graviton() -> CpuInfo:
    text = ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
            "fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n")
    return parse_cpuinfo(text, "aarch64")


@pytest.mark.parametrize("name,family,best", [
    ("epyc-avx2", "x86-64-v3 (AVX2 + FMA)", CpuPath.AVX2),
    ("alder-lake", "x86-64-v3 (AVX2 + FMA + AVX-VNNI)", CpuPath.AVX2),
    ("cascade-lake", "x86-64-v4 AVX-512 + VNNI (no BF16)", CpuPath.AVX512),
    ("zen5", "x86-64-v4 AVX512-BF16 + VNNI", CpuPath.AVX512_BF16),
    ("sapphire-rapids", "x86-64 AMX (AVX512-BF16 + AMX-BF16)", CpuPath.AMX),
    ("old-x86", "x86-64 (no AVX2)", CpuPath.PORTABLE),
])
def test_families_and_paths_from_cpuinfo(name: str, family: str, best: CpuPath) -> None:
    cpu = x86(name)
    assert cpu.model == CPUINFO[name][1] and cpu.family == family
    assert cpu.paths()[0] is best and cpu.paths()[-1] is CpuPath.PORTABLE
    assert choose_path("auto", cpu, ALL_KERNELS) is best
    # every path below the best runs too (an AVX-512 machine can run the AVX2 path when forced)
    order = list(CpuPath)
    assert cpu.paths() == order[order.index(best):]


def test_aarch64_takes_the_portable_path() -> None:
    cpu = graviton()
    assert cpu.family == "aarch64 (NEON, dotprod)" and cpu.model == "implementer 0x41 part 0xd0c"
    assert cpu.paths() == [CpuPath.PORTABLE]
    assert cpu.missing(CpuPath.AVX2) == ["an x86-64 CPU (this one is aarch64)"]
    plan = make_plan(choose_path("auto", cpu, ALL_KERNELS), cpu)
    assert (plan.path, plan.dtype, plan.kv_dtype, plan.matmul, plan.native_ops) == \
        (CpuPath.PORTABLE, "float32", "float32", "torch", False)


def test_forced_path_the_cpu_cannot_run_names_what_is_missing() -> None:
    with pytest.raises(PathUnavailable, match=r"cpu_path='avx512_bf16' needs .*avx512_bf16, avx512bw, "
                                              r"avx512f, avx512vl"):
        choose_path("avx512_bf16", x86("epyc-avx2"), ALL_KERNELS)
    with pytest.raises(PathUnavailable, match="amx_bf16, amx_tile"):
        choose_path("amx", x86("zen5"), ALL_KERNELS)
    assert choose_path("avx2", x86("zen5"), ALL_KERNELS) is CpuPath.AVX2


def test_kernel_library_limits_the_choice() -> None:
    """Without the native library only the portable path runs; a library without a CPU's backend (e.g. the OS
    denies AMX tiles) drops that path and auto takes the next. With the kernels off (None: attention_kernel=
    "torch") the CPU alone decides, and the plan keeps that path's dtypes on torch's kernels."""
    cpu = x86("sapphire-rapids")
    assert choose_path("auto", cpu, None) is CpuPath.AMX
    assert choose_path("avx2", cpu, None) is CpuPath.AVX2
    off = make_plan(CpuPath.AMX, cpu, native=False)
    assert (off.dtype, off.matmul, off.native_ops) == ("bfloat16", "torch", False)
    assert choose_path("auto", cpu, KernelSupport()) is CpuPath.PORTABLE
    with pytest.raises(PathUnavailable, match="not built"):
        choose_path("avx2", cpu, KernelSupport())
    no_amx = KernelSupport(built=True, vnni_backends=("avx512_bf16",), qmm_variants=("avx512vnni", "avx2", "scalar"))
    assert choose_path("auto", cpu, no_amx) is CpuPath.AVX512_BF16
    with pytest.raises(PathUnavailable, match="no amx backend"):
        choose_path("amx", cpu, no_amx)
    scalar_only = KernelSupport(built=True, qmm_variants=("scalar",))
    assert choose_path("auto", x86("epyc-avx2"), scalar_only) is CpuPath.PORTABLE


def test_plans_per_path_and_overrides() -> None:
    """Every native path reads GGUF codes on the quantized matmul: VPDPBUSD where the CPU has AVX512-VNNI, the AVX2
    kernel elsewhere; bf16 paths run dense weights on their VNNI backend. act_quant sets the activation rules of
    decode batches ("fast") and prompt batches ("precise"): (terms, two-term rows, big-batch rows)."""
    zen5, cascade = x86("zen5"), x86("cascade-lake")
    bf16 = make_plan(CpuPath.AVX512_BF16, zen5)
    assert (bf16.dtype, bf16.kv_dtype, bf16.weight_quant, bf16.matmul, bf16.act_quant) == \
        ("bfloat16", "bfloat16", "auto", "qmm-avx512vnni + vnni-avx512_bf16", "auto")
    assert (bf16.fast_acts, bf16.precise_acts) == ((1, X2_ROWS, 0), (2, 0, BIG_ROWS))
    amx = make_plan(CpuPath.AMX, x86("sapphire-rapids"))
    assert (amx.qmm, amx.vnni) == ("avx512vnni", "amx")
    avx2 = make_plan(CpuPath.AVX2, zen5)  # forced on a CPU that has more: still the AVX2 kernel
    assert (avx2.dtype, avx2.kv_dtype, avx2.weight_quant, avx2.matmul, avx2.act_quant) == \
        ("float32", "float16", "auto", "qmm-avx2", "auto")
    assert (avx2.fast_acts, avx2.precise_acts) == ((1, X2_ROWS, 0), (2, 0, DENSE_ROWS))
    assert make_plan(CpuPath.AVX512, cascade).matmul == "qmm-avx512vnni"
    skylake = CpuInfo("x86_64", "skylake-x", frozenset(_AVX512.split()))  # AVX-512 without VNNI
    assert make_plan(CpuPath.AVX512, skylake).matmul == "qmm-avx2"
    x2 = make_plan(CpuPath.AVX512_BF16, zen5, act_quant="int8x2")
    assert x2.fast_acts == x2.precise_acts == (2, 0, BIG_ROWS)
    x1 = make_plan(CpuPath.AVX2, zen5, act_quant="int8")
    assert x1.fast_acts == x1.precise_acts == (1, 0, 0)
    # explicit settings win: dense weights run no quantized matmul, an explicit KV dtype is kept
    dense = make_plan(CpuPath.AVX2, zen5, weight_quant="none", kv_dtype="float32")
    assert (dense.matmul, dense.weight_quant, dense.kv_dtype, dense.native_ops, dense.act_quant) == \
        ("torch", "none", "float32", True, "none")
    assert make_plan(CpuPath.AVX512_BF16, zen5, weight_quant="none").matmul == "vnni-avx512_bf16"
    # attention_kernel="torch": the path's dtypes on torch's kernels (bf16 keeps torch's int4 for decode)
    torch_bf16 = make_plan(CpuPath.AVX512_BF16, zen5, native=False)
    assert (torch_bf16.matmul, torch_bf16.weight_quant, torch_bf16.native_ops) == ("torch", "int4", False)
    torch_fp32 = make_plan(CpuPath.AVX2, zen5, native=False)
    assert (torch_fp32.kv_dtype, torch_fp32.weight_quant) == ("float32", "none")
    assert "avx2 path on AMD EPYC 9B45" in avx2.describe() and avx2.to_dict()["path"] == "avx2"
    # a library without the quantized matmul for the CPU: torch's kernels for the weights
    none = make_plan(CpuPath.AVX2, zen5, qmm_variants=("scalar",))
    assert (none.qmm, none.matmul, none.weight_quant) == ("", "torch", "none")


def test_probe_reads_this_machine() -> None:
    cpu = probe_cpu()
    assert cpu.arch and cpu.model and cpu.family
    assert CpuPath.PORTABLE in cpu.paths()


# ---- an engine on this machine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_settings():
    return dict(random_model="tiny", kv_cache_tokens=512)


def test_engine_reports_its_plan(tiny_settings) -> None:
    """The default engine runs the best path this CPU and the kernel build allow, and says so in its status."""
    from parrot.engine.loader.builder import build_engine
    from parrot.engine.kernels import load_kernels
    from parrot.engine.settings import EngineSettings

    ops = load_kernels(build_if_missing=True)
    support = KernelSupport(built=True, vnni_backends=tuple(ops.vnni_backends()),
                            qmm_variants=tuple(ops.qmm_variants()))
    expected = choose_path("auto", probe_cpu(), support)
    eng = build_engine(EngineSettings(**tiny_settings))
    try:
        numerics = eng.status().extra["numerics"]
        assert numerics["path"] == expected.value and numerics["cpu_model"] == probe_cpu().model
        assert numerics["cpu_family"] == probe_cpu().family
        assert (eng.runner.decode_kernel is not None) == numerics["native_ops"]
        assert eng.runner.kv_caches[0][0].dtype is getattr(__import__("torch"), numerics["kv_dtype"])
    finally:
        eng.shutdown()


def test_forced_portable_path_and_impossible_path(tiny_settings) -> None:
    from parrot.engine.loader.builder import build_engine
    from parrot.engine.settings import EngineSettings

    eng = build_engine(EngineSettings(cpu_path="portable", **tiny_settings))
    try:
        numerics = eng.status().extra["numerics"]
        assert (numerics["path"], numerics["matmul"], numerics["kv_dtype"]) == ("portable", "torch", "float32")
        assert eng.runner.decode_kernel is None and eng.runner.model.fused_ops is None
    finally:
        eng.shutdown()
    missing = [p for p in CpuPath if p not in probe_cpu().paths()]
    if not missing:
        pytest.skip("this CPU runs every path")
    with pytest.raises(ValueError, match=f"cpu_path='{missing[0].value}'"):
        build_engine(EngineSettings(cpu_path=missing[0].value, **tiny_settings))


def test_v1_models_lists_each_engines_numerics(tiny_settings) -> None:
    from fastapi.testclient import TestClient

    from parrot.api import ServerSettings, create_app
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.settings import EngineSettings

    client = build_local_engine_client(EngineSettings(name="e0", cpu_path="portable", **tiny_settings))
    app = create_app(ServerSettings(engine_heartbeat_s=0), [client])
    with TestClient(app) as http:
        cards = http.get("/v1/models").json()["data"]
    assert len(cards) == 1
    assert cards[0]["numerics"]["e0"]["path"] == "portable"
    assert cards[0]["numerics"]["e0"]["cpu_model"] == probe_cpu().model


def test_cli_refuses_a_path_this_cpu_cannot_run() -> None:
    """`parrot serve --cpu-path X` on a CPU without X's features exits with the reason, before serving."""
    from parrot.cli import main

    missing = [p for p in CpuPath if p not in probe_cpu().paths()]
    if not missing:
        pytest.skip("this CPU runs every path")
    with pytest.raises(SystemExit, match=f"parrot: cpu_path='{missing[0].value}' needs CPU features"):
        main(["serve", "--cpu-path", missing[0].value, "--port", "1"])
