"""The CPU the engine runs on: its model, its instruction-set features, and which kernel family (a CPU path) can
run on it (no torch).

CPU paths, fastest first. Each names the features its kernels need; the engine picks the first one the CPU has
(and the kernel library was built for) unless a setting forces one:

    path          needs (Linux /proc/cpuinfo flag names)           numerics (parrot.engine.runtime.numerics)
    amx           amx_tile amx_bf16 + avx512_bf16                  bf16 compute, AMX tiles for mid-size matmuls
    avx512_bf16   avx512f avx512bw avx512vl avx512_bf16            bf16 compute, VDPBF16PS + VPDPBUSD matmuls
    avx512        avx512f avx512bw avx512vl + avx2 fma f16c        fp32 compute, int8 x GGUF-code dot products
    avx2          avx2 fma f16c (x86-64-v3)                        fp32 compute, int8 x GGUF-code dot products
    portable      nothing (aarch64, older x86, any CPU)             fp32 compute, torch's kernels

The avx512 path runs the quantized matmul's VPDPBUSD variant where the CPU has AVX512-VNNI, else its AVX2 variant
(kernels/qmm.cpp). aarch64 takes the portable path (NEON dot-product kernels are not written yet); its family is
still reported (``asimddp`` = dot product) so the engine's status says what the machine could do.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from enum import Enum


class CpuPath(str, Enum):
    AMX = "amx"
    AVX512_BF16 = "avx512_bf16"
    AVX512 = "avx512"
    AVX2 = "avx2"
    PORTABLE = "portable"


# the CPU features each path's kernels use (flag names as Linux's /proc/cpuinfo spells them)
REQUIRED_FLAGS: dict[CpuPath, frozenset[str]] = {
    CpuPath.AMX: frozenset({"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
    CpuPath.AVX512_BF16: frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
    CpuPath.AVX512: frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}),
    CpuPath.AVX2: frozenset({"avx2", "fma", "f16c"}),
    CpuPath.PORTABLE: frozenset(),
}
X86_PATHS = (CpuPath.AMX, CpuPath.AVX512_BF16, CpuPath.AVX512, CpuPath.AVX2)


@dataclass(frozen=True)
class CpuInfo:
    """What the probe found: ``arch`` (``platform.machine()``), the model name, and the feature flags."""

    arch: str
    model: str
    flags: frozenset[str]

    @property
    def is_x86(self) -> bool:
        return self.arch.lower() in ("x86_64", "amd64", "i686", "i386")

    @property
    def family(self) -> str:
        """A short human name of the CPU family, e.g. "x86-64-v3 (AVX2 + FMA)" or "aarch64 (NEON, dotprod)"."""
        f = self.flags
        if self.is_x86:
            if REQUIRED_FLAGS[CpuPath.AMX] <= f:
                return "x86-64 AMX (AVX512-BF16 + AMX-BF16)"
            if REQUIRED_FLAGS[CpuPath.AVX512_BF16] <= f:
                return "x86-64-v4 AVX512-BF16" + (" + VNNI" if "avx512_vnni" in f else "")
            if {"avx512f", "avx512bw", "avx512vl"} <= f:
                return "x86-64-v4 AVX-512" + (" + VNNI" if "avx512_vnni" in f else "") + " (no BF16)"
            if REQUIRED_FLAGS[CpuPath.AVX2] <= f:
                return "x86-64-v3 (AVX2 + FMA" + (" + AVX-VNNI)" if "avx_vnni" in f else ")")
            return "x86-64 (no AVX2)"
        if self.arch.lower() in ("aarch64", "arm64"):
            extras = [name for flag, name in (("asimddp", "dotprod"), ("i8mm", "i8mm"), ("sve", "SVE"),
                                              ("bf16", "bf16")) if flag in f]
            return "aarch64 (NEON" + "".join(f", {e}" for e in extras) + ")"
        return self.arch or "unknown"

    def missing(self, path: CpuPath) -> list[str]:
        """The features ``path`` needs that this CPU lacks (empty: it can run there). Non-x86 CPUs lack every x86
        path."""
        if path in X86_PATHS and not self.is_x86:
            return [f"an x86-64 CPU (this one is {self.arch})"]
        return sorted(REQUIRED_FLAGS[path] - self.flags)

    def paths(self) -> list[CpuPath]:
        """Every path this CPU can run, fastest first (portable always last)."""
        return [p for p in CpuPath if not self.missing(p)]

    def to_dict(self) -> dict[str, str]:
        return {"arch": self.arch, "model": self.model, "family": self.family}


def parse_cpuinfo(text: str, arch: str) -> CpuInfo:
    """A CpuInfo from the text of /proc/cpuinfo (x86: ``model name`` / ``flags``; aarch64: ``Features`` and, for
    the name, ``Model`` or ``CPU implementer`` / ``CPU part``)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first processor's entry
            fields[key.strip()] = value.strip()
    flags = frozenset((fields.get("flags") or fields.get("Features") or "").split())
    model = fields.get("model name") or fields.get("Model") or ""
    if not model and "CPU part" in fields:
        model = f"implementer {fields.get('CPU implementer', '?')} part {fields['CPU part']}"
    return CpuInfo(arch=arch, model=model or platform.processor() or "unknown", flags=flags)


@functools.cache
def probe_cpu() -> CpuInfo:
    """This machine's CPU (read once). Without /proc/cpuinfo (macOS, Windows) the flags are empty, so only the
    portable path is offered."""
    arch = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return parse_cpuinfo(f.read(), arch)
    except OSError:
        return CpuInfo(arch=arch, model=platform.processor() or "unknown", flags=frozenset())
