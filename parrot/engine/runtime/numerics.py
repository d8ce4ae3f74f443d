"""The numerics plan of a builtin engine: which dtypes and kernels run, chosen once at engine start from the CPU
path (parrot.engine.runtime.cpu) and the settings (no torch).

    path          compute   KV cache   quantized matmuls (a GGUF's own codes)     dense matmuls
    amx           bf16      bf16       qmm avx512vnni                             VNNI bf16 on AMX tiles
    avx512_bf16   bf16      bf16       qmm avx512vnni                             VNNI bf16 (VDPBF16PS)
    avx512        fp32      fp16       qmm avx512vnni (avx2 without VNNI)         quantized as Q8_0
    avx2          fp32      fp16       qmm avx2                                   quantized as Q8_0
    portable      fp32      fp32       none: dequantized, torch (oneDNN / BLAS)   torch

"qmm" is the native quantized matmul (kernels/qmm.cpp): every GGUF matrix in a format it reads (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) runs from the file's codes at every row count (``weight_quant="auto"``), with
activations quantized to int8 per group of 32, by the rule ``act_quant`` sets for each kind of batch (a
batch that processes prompt tokens is "precise", a decode-only batch "fast"; layers/quant.py ActNumerics):

    act_quant   batch      rows <= X2_ROWS    more rows            from BIG_ROWS rows
    auto        prompts    int8x2             int8x2               bf16 tiles of the dequantized weight (bf16
                                                                   paths; avx2: fp32 chunks from DENSE_ROWS)
                decode     int8x2             int8 (llama.cpp's)   -
    int8x2      both       int8x2             int8x2               as auto's prompts
    int8        both       int8               int8                 -

int8x2 is two int8 terms (~16 bits per group): as close to fp32 as bf16 activations are or closer. One term is
llama.cpp's activation precision (~8 bits per group; its logits move several times more) and ~1.5x faster where
the dot products bound the matmul. So prompts -- which fill the KV cache every later token reads -- and small
decode batches (bound by the weight reads, where the second term is free) run two terms; large decode batches
one, unless ``act_quant="int8x2"`` asks for two everywhere.

A setting given explicitly overrides its part of the plan (``dtype``, ``kv_dtype``, ``weight_quant``,
``act_quant``), and ``attention_kernel="torch"`` turns every native kernel off (torch's matmuls at the chosen
dtype). The plan is logged at start, reported in the engine's status (``extra["numerics"]``) and in
``/v1/models``; parrot.engine.layers.linear.MatmulKernels.for_plan turns it into each layer's weight object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from parrot.engine.runtime.cpu import CpuInfo, CpuPath

BF16_PATHS = (CpuPath.AMX, CpuPath.AVX512_BF16)
FP32_NATIVE_PATHS = (CpuPath.AVX512, CpuPath.AVX2)
X2_ROWS = 8  # act_quant="auto": decode batches of up to this many rows keep two activation terms
BIG_ROWS = 48  # precise batches on the bf16 paths: bf16 tiles of the dequantized weight from this many rows
DENSE_ROWS = 256  # precise batches on avx2: float32 chunks from this many rows (faster than two terms there)


class PathUnavailable(ValueError):
    """A forced CPU path cannot run here (the message names the missing CPU features or kernels)."""


@dataclass(frozen=True)
class KernelSupport:
    """What the native kernel library offers on this machine (empty when it is not built or turned off)."""

    built: bool = False
    vnni_backends: tuple[str, ...] = ()  # "amx", "avx512_bf16" (the dense bf16 GEMM)
    qmm_variants: tuple[str, ...] = ()  # "avx512vnni", "avx2", "scalar" (the quantized matmul)


@dataclass(frozen=True)
class NumericsPlan:
    path: CpuPath
    cpu_model: str
    cpu_family: str
    dtype: str  # compute dtype of activations and matmul outputs: "bfloat16" | "float32"
    kv_dtype: str  # KV cache storage: "bfloat16" | "float16" | "float32"
    weight_quant: str  # "auto" (each GGUF matrix in its own codes) | "none" | "int8" | "int4"
    matmul: str  # the kernels, e.g. "qmm-avx512vnni + vnni-avx512_bf16", "qmm-avx2", "torch"
    native_ops: bool  # native paged attention and fused norm / SwiGLU / RoPE ops
    act_quant: str = "none"  # the quantized matmuls' activations: "auto" | "int8x2" | "int8" ("none": no qmm)
    qmm: str = ""  # the quantized matmul's variant ("" without it)
    vnni: str = ""  # the dense bf16 GEMM's backend ("" without it)
    # the activation rules (layers/quant.py ActNumerics: terms, x2_rows, big_rows) of decode-only batches and of
    # batches that process prompt tokens
    fast_acts: tuple[int, int, int] = (2, 0, 0)
    precise_acts: tuple[int, int, int] = (2, 0, 0)

    def to_dict(self) -> dict[str, str | bool | int]:
        d = asdict(self)
        d["path"] = self.path.value
        return d

    def summary(self) -> str:
        """The numerics alone: dtypes, weights, matmul kernels, native ops."""
        acts = f" ({self.act_quant} activations)" if self.qmm else ""
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
    if path is not CpuPath.PORTABLE and not {"avx512vnni", "avx2"} & set(kernels.qmm_variants):
        return "the kernel library has no quantized matmul for this CPU (built for a CPU without AVX2 + FMA + F16C)"
    return ""


def make_plan(path: CpuPath, cpu: CpuInfo, *, dtype: str = "auto", kv_dtype: str = "auto",
              weight_quant: str = "auto", act_quant: str = "auto", native: bool = True,
              qmm_variants: tuple[str, ...] = ("avx512vnni", "avx2", "scalar")) -> NumericsPlan:
    """The plan of ``path`` with the explicit settings applied. ``native=False`` (attention_kernel="torch") keeps
    the path's dtypes but runs torch's kernels everywhere; ``qmm_variants``: what the kernel library offers
    (the fastest that fits the path is taken)."""
    compute = dtype if dtype != "auto" else ("bfloat16" if path in BF16_PATHS else "float32")
    if kv_dtype == "auto":
        kv_dtype = "float16" if path in FP32_NATIVE_PATHS and compute == "float32" and native else compute
    qmm = vnni = ""
    if native and path is not CpuPath.PORTABLE:
        wanted = ("avx512vnni", "avx2") if path is not CpuPath.AVX2 else ("avx2",)
        qmm = next((v for v in wanted if v in qmm_variants and (v != "avx512vnni" or "avx512_vnni" in cpu.flags)), "")
        if path in BF16_PATHS and compute == "bfloat16":
            vnni = path.value
    if weight_quant == "auto" and not qmm:
        # torch's int4 kernel runs bf16 only; fp32 torch matmuls stay dense
        weight_quant = "int4" if compute == "bfloat16" and path is not CpuPath.PORTABLE else "none"
    fast = precise = (2, 0, 0)
    if not qmm or weight_quant == "none":
        acts = "none"
    else:
        acts = act_quant
        big = BIG_ROWS if vnni and qmm == "avx512vnni" else DENSE_ROWS if qmm == "avx2" else 0
        if act_quant == "int8":
            fast = precise = (1, 0, 0)
        else:
            precise = (2, 0, big)
            fast = (1, X2_ROWS, 0) if act_quant == "auto" else precise
    kinds = [f"qmm-{qmm}"] if acts != "none" else []
    kinds += [f"vnni-{vnni}"] if vnni else []
    return NumericsPlan(path=path, cpu_model=cpu.model, cpu_family=cpu.family, dtype=compute, kv_dtype=kv_dtype,
                        weight_quant=weight_quant, matmul=" + ".join(kinds) or "torch",
                        native_ops=native and path is not CpuPath.PORTABLE, act_quant=acts,
                        qmm=qmm if acts != "none" else "", vnni=vnni, fast_acts=fast, precise_acts=precise)
