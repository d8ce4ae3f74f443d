"""Machine peak: matmul GFLOP/s (bf16, fp32) and memory read GB/s, measured with torch on this CPU.

These are the denominators of "share of peak": a benchmark's useful FLOP/s over the bf16 matmul peak, and the
bytes a decode step must stream over the memory read bandwidth. Each measure is the best of ``repeats`` timed
runs after one warm-up (best, not median: a peak is what the hardware can do, noise only lowers it).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import time
from dataclasses import asdict, dataclass

# torch is imported inside the measuring functions: the benchmark driver only describes the machine
_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class MachinePeak:
    threads: int
    bf16_matmul_gflops: float
    fp32_matmul_gflops: float
    mem_read_gbs: float
    matmul_n: int  # square matrix side used for the matmul peaks
    mem_read_mib: int  # size of the tensor summed for the bandwidth peak (well above the L3 cache)

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


def measure_peak(threads: int, *, matmul_n: int = 2048, mem_mib: int = 1024, repeats: int = 5) -> MachinePeak:
    """Set torch's intra-op threads to ``threads`` and measure all three peaks."""
    import torch

    torch.set_num_threads(threads)
    return MachinePeak(
        threads=threads,
        bf16_matmul_gflops=matmul_gflops("bfloat16", matmul_n, repeats),
        fp32_matmul_gflops=matmul_gflops("float32", matmul_n, repeats),
        mem_read_gbs=memory_read_gbs(mem_mib, repeats),
        matmul_n=matmul_n,
        mem_read_mib=mem_mib,
    )


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (falls back to platform.processor())."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


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
