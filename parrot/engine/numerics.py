"""The numerics plan of a builtin engine: which dtypes and kernels run, chosen once at engine start from the CPU
path (parrot.engine.cpu) and the settings (no torch).

    path          compute   KV cache   weights (weight_quant="auto")                  matmuls
    amx           bf16      bf16       4-bit codes of a Q4_0/Q4_1 GGUF, else bf16     AMX / VDPBF16PS + int4 decode
    avx512_bf16   bf16      bf16       (the same)                                     VDPBF16PS + int4 decode
    avx512        fp32      fp16       4-bit codes of a Q4_0/Q4_1 GGUF, else Q8_0     int8 x 4-bit dot (qdot, AVX2)
    avx2          fp32      fp16       (the same)                                     int8 x 4-bit dot (qdot, AVX2)
    portable      fp32      fp32       dense                                          torch (oneDNN / BLAS)

A setting given explicitly overrides its part of the plan (``dtype``, ``kv_dtype``, ``weight_quant``), and
``attention_kernel="torch"`` turns every native kernel off (torch's matmuls at the chosen dtype). The plan is
logged at start, reported in the engine's status (``extra["numerics"]``) and in ``/v1/models``. The matmul kernels
it allows become each layer's weight path once, at load (parrot.engine.layers.linear: MatmulKernels.for_plan).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from parrot.engine.cpu import CpuInfo, CpuPath

BF16_PATHS = (CpuPath.AMX, CpuPath.AVX512_BF16)
QDOT_PATHS = (CpuPath.AVX512, CpuPath.AVX2)


class PathUnavailable(ValueError):
    """A forced CPU path cannot run here (the message names the missing CPU features or kernels)."""


@dataclass(frozen=True)
class KernelSupport:
    """What the native kernel library offers on this machine (empty when it is not built or turned off)."""

    built: bool = False
    vnni_backends: tuple[str, ...] = ()  # "amx", "avx512_bf16" (bf16 GEMM; int4 decode runs where these do)
    qdot_variants: tuple[str, ...] = ()  # "avx2", "scalar"


@dataclass(frozen=True)
class NumericsPlan:
    path: CpuPath
    cpu_model: str
    cpu_family: str
    dtype: str  # compute dtype of activations and matmul outputs: "bfloat16" | "float32"
    kv_dtype: str  # KV cache storage: "bfloat16" | "float16" | "float32"
    weight_quant: str  # "auto" (per tensor, by its file format: numerics docstring) | "none" | "int8" | "int4"
    matmul: str  # "vnni-amx" | "vnni-avx512_bf16" | "qdot-avx2" | "torch"
    native_ops: bool  # native paged attention and fused norm / SwiGLU / RoPE ops
    act_quant: str = "none"  # the qdot matmuls' activations: "int8x2" | "int8" ("none" for the other kernels)

    @property
    def qdot_variant(self) -> str | None:
        return self.matmul.removeprefix("qdot-") if self.matmul.startswith("qdot-") else None

    @property
    def act_terms(self) -> int:
        """int8 terms per activation group of the qdot kernel (2 for int8x2)."""
        return 2 if self.act_quant == "int8x2" else 1

    @property
    def vnni_backend(self) -> str | None:
        return self.matmul.removeprefix("vnni-") if self.matmul.startswith("vnni-") else None

    def to_dict(self) -> dict[str, str | bool]:
        d = asdict(self)
        d["path"] = self.path.value
        return d

    def summary(self) -> str:
        """The numerics alone: dtypes, weights, matmul kernels, native ops."""
        acts = f" ({self.act_quant} activations)" if self.qdot_variant else ""
        return (f"compute {self.dtype}, KV {self.kv_dtype}, weights {self.weight_quant}, matmuls {self.matmul}{acts}, "
                f"native ops {'on' if self.native_ops else 'off'}")

    def describe(self) -> str:
        return f"{self.path.value} path on {self.cpu_model} [{self.cpu_family}]: {self.summary()}"


def choose_path(requested: str, cpu: CpuInfo, kernels: KernelSupport | None) -> CpuPath:
    """The path to run: ``requested`` ("auto" = the fastest this CPU and kernel build can run). ``kernels`` None:
    the native kernels are not in use (attention_kernel="torch"), so only the CPU's features decide (the plan then
    keeps the path's dtypes on torch's kernels). Raises PathUnavailable for a forced path the CPU or the kernel
    build cannot run."""
    if requested != "auto":
        path = CpuPath(requested)
        missing = cpu.missing(path)
        if missing:
            raise PathUnavailable(f"cpu_path={path.value!r} needs CPU features this {cpu.model} [{cpu.family}] "
                                  f"lacks: {', '.join(missing)}")
        why = _kernels_missing(path, kernels) if kernels is not None else ""
        if why:
            raise PathUnavailable(f"cpu_path={path.value!r} cannot run here: {why}")
        return path
    for path in cpu.paths():
        if kernels is None or not _kernels_missing(path, kernels):
            return path
    return CpuPath.PORTABLE


def _kernels_missing(path: CpuPath, kernels: KernelSupport) -> str:
    """Why the kernel library cannot serve ``path`` ("" when it can)."""
    if path is CpuPath.PORTABLE:
        return ""
    if not kernels.built:
        return "the native kernels are not built (python -m parrot.engine.kernels) or are turned off"
    if path in BF16_PATHS and path.value not in kernels.vnni_backends:
        return f"the kernel library has no {path.value} backend (built for another CPU, or the OS denies AMX)"
    if path in QDOT_PATHS and "avx2" not in kernels.qdot_variants:
        return "the kernel library has no AVX2 integer-dot kernels (built for a CPU without AVX2 + FMA + F16C)"
    return ""


def make_plan(path: CpuPath, cpu: CpuInfo, *, dtype: str = "auto", kv_dtype: str = "auto",
              weight_quant: str = "auto", act_quant: str = "auto", native: bool = True) -> NumericsPlan:
    """The plan of ``path`` with the explicit settings applied. ``native=False`` (attention_kernel="torch") keeps
    the path's dtypes but runs torch's kernels everywhere."""
    compute = dtype if dtype != "auto" else ("bfloat16" if path in BF16_PATHS else "float32")
    if kv_dtype == "auto":
        kv_dtype = "float16" if path in QDOT_PATHS and compute == "float32" and native else compute
    matmul = "torch"
    if native and path in BF16_PATHS and compute == "bfloat16":
        matmul = f"vnni-{path.value}"
    elif native and path in QDOT_PATHS and weight_quant != "none":
        matmul = "qdot-avx2"
    if weight_quant == "auto" and matmul.startswith("vnni-"):
        weight_quant = "int4"  # int4 decode kernels (the native one where it runs), bf16 GEMMs above them
    elif weight_quant == "auto" and matmul == "torch":
        # torch's int4 kernel runs bf16 only; fp32 torch matmuls stay dense
        weight_quant = "int4" if compute == "bfloat16" and path is not CpuPath.PORTABLE else "none"
    acts = "none" if not matmul.startswith("qdot-") else ("int8x2" if act_quant == "auto" else act_quant)
    return NumericsPlan(path=path, cpu_model=cpu.model, cpu_family=cpu.family, dtype=compute, kv_dtype=kv_dtype,
                        weight_quant=weight_quant, matmul=matmul, native_ops=native and path is not CpuPath.PORTABLE,
                        act_quant=acts)
