"""Machine peak: matmul GFLOP/s (bf16, fp32) and memory read GB/s measured with torch on this CPU, and the int8
dot-product GOPS of a synthetic VPMADDUBSW loop (kernels/peak.cpp, when the native kernel library is built).

These are the denominators of "share of peak": a benchmark's useful FLOP/s over the bf16 / fp32 matmul peaks and
the int8 dot-product peak (a FLOP counts as an op), and the bytes a decode step must stream over the memory read
bandwidth. Each measure is the best of ``repeats`` timed runs after one warm-up (best, not median: a peak is what
the hardware can do, noise only lowers it).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import time
from dataclasses import asdict, dataclass

# torch is imported inside the measuring functions: the benchmark driver only describes the machine
_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class MachinePeak:
    threads: int
    bf16_matmul_gflops: float | None  # None on a CPU without bf16 dot products (torch emulates them: ~1 GFLOP/s)
    fp32_matmul_gflops: float
    mem_read_gbs: float
    matmul_n: int  # square matrix side used for the matmul peaks
    mem_read_mib: int  # size of the tensor summed for the bandwidth peak (well above the L3 cache)
    int8_dot_gops: float | None = None  # synthetic VPMADDUBSW loop (None: kernel library not built, or no AVX2)
    int8_dot_seconds: float | None = None  # length of each timed run of that loop

    def to_dict(self) -> dict:
        return asdict(self)


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, kernel selection, thread pool start
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(dtype: str, n: int, repeats: int = 5) -> float:
    """GFLOP/s of ``torch.matmul`` on two n x n matrices of ``dtype`` ('bfloat16' | 'float32'); 2 n^3 FLOPs."""
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(tdtype)
    b = torch.randn(n, n, generator=gen).to(tdtype)
    out = torch.empty(n, n, dtype=tdtype)
    with torch.inference_mode():
        secs = _best_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    return 2.0 * n**3 / secs / 1e9


def memory_read_gbs(mib: int, repeats: int = 5) -> float:
    """GB/s of reading a ``mib`` MiB fp32 tensor once (``tensor.sum()``); bytes read / best time."""
    import torch

    if mib < 1:
        raise ValueError(f"mib must be >= 1, got {mib}")
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    with torch.inference_mode():
        secs = _best_seconds(lambda: x.sum(), repeats)
    return x.numel() * 4 / secs / 1e9


def int8_dot_gops(seconds: float = 1.0, repeats: int = 3) -> float | None:
    """GOPS of the native int8 dot-product peak loop (``torch.ops.parrot_kernels.int8_dot_peak_gops``: VPMADDUBSW
    chains on all of torch's intra-op threads for ``seconds`` each run, 2 ops per u8 x s8 multiply-add); the best
    of ``repeats`` runs after a short warm-up. None when the kernel library is not built (``python -m
    parrot.engine.kernels``), has no such op, or the op raises (built without AVX2)."""
    from parrot.engine.kernels import KernelBuildError, load_kernels

    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    try:
        ops = load_kernels(build_if_missing=False)
        if ops is None or not hasattr(ops, "int8_dot_peak_gops"):
            return None
        ops.int8_dot_peak_gops(min(0.1, seconds))  # warm-up: thread pool start, clock ramp
        return max(ops.int8_dot_peak_gops(seconds) for _ in range(max(1, repeats)))
    except (KernelBuildError, OSError, RuntimeError):
        return None


def measure_peak(threads: int, *, matmul_n: int = 2048, mem_mib: int = 1024, repeats: int = 5,
                 int8_seconds: float = 0.5) -> MachinePeak:
    """Set torch's intra-op threads to ``threads`` and measure all the peaks (the int8 loop runs ``int8_seconds``
    per timed run, ``min(repeats, 3)`` runs)."""
    import torch

    from parrot.engine.runtime.cpu import CpuPath, probe_cpu

    torch.set_num_threads(threads)
    has_bf16 = CpuPath.AVX512_BF16 in probe_cpu().paths()
    return MachinePeak(
        threads=threads,
        bf16_matmul_gflops=matmul_gflops("bfloat16", matmul_n, repeats) if has_bf16 else None,
        fp32_matmul_gflops=matmul_gflops("float32", matmul_n, repeats),
        mem_read_gbs=memory_read_gbs(mem_mib, repeats),
        matmul_n=matmul_n,
        mem_read_mib=mem_mib,
        int8_dot_gops=int8_dot_gops(int8_seconds, min(repeats, 3)),
        int8_dot_seconds=int8_seconds,
    )


def cpu_model() -> str:
    """The CPU's model name (parrot.engine.runtime.cpu's probe: /proc/cpuinfo, else platform.processor())."""
    from parrot.engine.runtime.cpu import probe_cpu

    return probe_cpu().model


def cpu_family_model() -> str:
    """``family F model M`` from /proc/cpuinfo (names the generation when the model name is only "AMD EPYC")."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "unknown"
    fam, mod = re.search(r"cpu family\s*:\s*(\d+)", text), re.search(r"^model\s*:\s*(\d+)", text, re.MULTILINE)
    return f"family {fam.group(1)} model {mod.group(1)}" if fam and mod else "unknown"


def cpu_key(path: str | None) -> str:
    """``<cpu path>-<two words of the CPU's name>`` (``avx512_bf16-epyc``): how benchmark results are keyed."""
    words = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-").split("-")
    words = [w for w in words if w not in ("amd", "intel", "r", "tm", "cpu", "processor")]
    return f"{path or 'cpu'}-{'-'.join(words[:2]) or 'unknown'}"


def describe_cpu() -> dict[str, str]:
    """The CPU (model, family) and the numerics plan a default engine takes on it (parrot.engine.runtime.numerics): the
    conditions of a benchmark that runs the builtin engine with its defaults."""
    from parrot.engine.loader.builder import plan_for
    from parrot.engine.settings import EngineSettings

    plan = plan_for(EngineSettings())
    return {"cpu": plan.cpu_model, "cpu_family": plan.cpu_family,
            "engine_numerics": plan.summary(), "cpu_path": plan.path.value}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe_machine() -> dict[str, str | int]:
    """Conditions every benchmark prints: CPU, core count, torch version, Python, date (UTC)."""
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "torch": _version("torch"),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
