"""Group-wise asymmetric int4 weights for ``torch._weight_int4pack_mm_for_cpu`` (decode GEMV kernel).

Per group of ``group`` consecutive input features of one output row:

    w ~= (q - 8) * scale + zero,   q in [0, 15],   scale = (max - min) / 15,   zero = min + 8 * scale

This is exactly GGUF Q4_1's layout (blocks of 32 along the input dimension with ``d = (max - min) / 15`` and
``m = min``), so re-quantizing weights that were dequantized from a Q4_1 file recovers the file's own 4-bit
codes: the only loss is rounding scale/zero to the activation dtype. For weights from other formats it is an
ordinary 4-bit quantization (use int8 or none there).

Two kernels run these weights, each as a weight object over the layer's dense form for larger batches: torch's
``_weight_int4pack_mm_for_cpu`` (any CPU; :class:`Int4Weight`) and, where the CPU has AVX512-BF16, the native
``int4_linear`` (parrot/engine/kernels/int4_gemm.cpp; :class:`NativeInt4Weight`), which keeps the file's fp16
scale and minimum per group and streams the codes at the machine's read bandwidth, faster than torch's int4
kernel and than the bf16 VNNI kernel up to its 8 rows (figures: docs/results/README.md#kernel-design-measurements).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from parrot.engine.layers.weight import DenseWeight, FewRowsWeight, LinearWeight, NativeCall

log = logging.getLogger(__name__)

INT4_GROUP = 32
# rows up to which the native int4 kernel runs (its limit, where it is faster than the bf16 VNNI kernel)
NATIVE_INT4_MAX_ROWS = 8
# ... and a two-plane Q8_0 weight (twice the dot products per byte: it beats bf16 at fewer rows)
NATIVE_Q8_0_MAX_ROWS = 2
# rows up to which torch's int4 GEMV (half of int8's bytes) beats the dense GEMM, and a pre-packed bf16 weight
# (layers/packed.py), which wins from 2 rows on (figures: the module docstring's link)
INT4_MAX_ROWS = 4
INT4_MAX_ROWS_PACKED = 1


def int4_kernel_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the CPU int4 kernels run for ``dtype`` activations on ``device`` (probed with a tiny call)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    try:
        q, sz = quantize_int4(torch.randn(16, 64), INT4_GROUP, dtype)
        torch._weight_int4pack_mm_for_cpu(torch.zeros(1, 64, dtype=dtype), q, INT4_GROUP, sz)
    except (RuntimeError, AttributeError):
        return False
    return True


def quantize_int4(weight: Tensor, group: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Float [N, K] -> (packed int4 weight for the CPU kernel, scales_and_zeros [K/group, N, 2] in ``dtype``)."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"int4 needs in_features ({k}) divisible by the group size ({group})")
    w = weight.float().view(n, k // group, group)
    lo = w.amin(dim=2, keepdim=True)
    hi = w.amax(dim=2, keepdim=True)
    scale = ((hi - lo) / 15.0).to(dtype).float()  # rounded first, so codes are chosen for the stored scale
    zero = (lo + 8.0 * scale).to(dtype).float()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round((w - zero) / safe + 8.0).clamp_(0, 15).to(torch.int32).view(n, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    sz = torch.stack([scale.squeeze(2), zero.squeeze(2)], dim=2).transpose(0, 1).contiguous().to(dtype)
    return packed, sz


def int4_matmul(x: Tensor, packed: Tensor, scales_zeros: Tensor, group: int = INT4_GROUP) -> Tensor:
    return torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


def q4_1_codes(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Float [N, K] -> (codes uint8 [N, K] in [0, 15], d [N, K/32], m [N, K/32]) with W ~= d * q + m per group of
    32 (GGUF Q4_1: d = (max - min) / 15, m = min). d and m are rounded to fp16 first, as the native kernel stores
    them, and the codes are chosen for the rounded values."""
    n, k = weight.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs in_features ({k}) divisible by the group size ({INT4_GROUP})")
    w = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo = w.amin(dim=2, keepdim=True)
    d = ((w.amax(dim=2, keepdim=True) - lo) / 15.0).half().float()
    m = lo.half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((w - m) / safe).clamp_(0, 15).to(torch.uint8).view(n, k)
    return q.contiguous(), d.squeeze(2).contiguous(), m.squeeze(2).contiguous()


def q8_0_planes(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Float [N, K] -> two int4 planes (codes [2, N, K], d [2, N, K/32], m [2, N, K/32]) whose sum is the GGUF
    Q8_0 quantization of the weight (groups of 32: d = max|w| / 127 in fp16, q = round(w / d) in [-127, 127]):
    with u = q + 128 = 16 hi + lo,

        d q = (16 d) hi + (-128 d)  +  d lo + 0        (16 d and 128 d are exact in fp16)

    For weights dequantized from a Q8_0 file (e.g. a GGUF's token_embd) that is the file's exact values."""
    n, k = weight.shape
    if k % INT4_GROUP:
        raise ValueError(f"q8_0 needs in_features ({k}) divisible by the group size ({INT4_GROUP})")
    w = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    d = (w.abs().amax(dim=2, keepdim=True) / 127.0).half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    u = (torch.round(w / safe).clamp_(-127, 127) + 128).to(torch.uint8).view(n, k)
    d = d.squeeze(2)
    codes = torch.stack([u >> 4, u & 15])
    return codes, torch.stack([16 * d, d]), torch.stack([-128 * d, torch.zeros_like(d)])


@dataclass(frozen=True)
class NativeInt4:
    """The native int4 GEMM (kernels/int4_gemm.cpp): bf16 activations, 1..max_rows rows."""

    ops: Any
    max_rows: int = NATIVE_INT4_MAX_ROWS

    @staticmethod
    def packable(n: int, k: int) -> bool:
        """Whether ``int4_pack`` takes an [n, k] weight."""
        return n % 16 == 0 and k % INT4_GROUP == 0

    def pack(self, weight: Tensor) -> Tensor:
        return self.ops.int4_pack(*q4_1_codes(weight))

    def pack_q8_0(self, weight: Tensor) -> Tensor:
        """The weight's Q8_0 quantization as two planes (:func:`q8_0_planes`), for the same kernel."""
        return self.ops.int4_pack(*q8_0_planes(weight))

    def linear(self, x: Tensor, packed: Tensor) -> Tensor:
        return self.ops.int4_linear(x, packed)


@functools.cache
def native_int4() -> NativeInt4 | None:
    """The native int4 kernel when the kernel library is built and the CPU has AVX512-BF16 (checked once)."""
    from parrot.engine.kernels import KernelBuildError, load_kernels

    try:
        ops = load_kernels(build_if_missing=False)
    except (KernelBuildError, OSError, RuntimeError) as e:
        log.warning("native kernels failed to load (%s); int4 layers use torch's kernel", e)
        return None
    if ops is None or not hasattr(ops, "int4_linear") or not ops.int4_available():
        return None
    return NativeInt4(ops)


class Int4Weight(FewRowsWeight):
    """Group-wise int4 (this module's rule) on torch's ``_weight_int4pack_mm_for_cpu`` for decode batches:

        rows <= max_rows    torch's int4 kernel (bf16 activations)
        more rows           ``above`` (the dense form)

    ``max_rows`` is INT4_MAX_ROWS over a DenseWeight and INT4_MAX_ROWS_PACKED over pre-packed bf16
    (:func:`int4_max_rows`). ``weight`` is the float weight the codes are quantized from."""

    def __init__(self, weight: Tensor, above: LinearWeight, max_rows: int) -> None:
        super().__init__(above, max_rows, "int4")
        self.qweight, self.scales = quantize_int4(weight, INT4_GROUP, above.dtype)

    def _few(self, x: Tensor) -> Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP, self.scales)

    def _few_call(self) -> NativeCall | None:
        return None

    def decode_bytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


def int4_max_rows(above: type[LinearWeight]) -> int:
    """Rows up to which torch's int4 kernel runs over a dense form of type ``above``."""
    return INT4_MAX_ROWS if above is DenseWeight else INT4_MAX_ROWS_PACKED


def native_int4_max_rows(kernel: NativeInt4, quant: str) -> int:
    """Rows up to which the native kernel runs a weight of ``quant`` ("int4": its limit; "q8_0": fewer)."""
    return kernel.max_rows if quant == "int4" else NATIVE_Q8_0_MAX_ROWS


class NativeInt4Weight(FewRowsWeight):
    """The native int4 kernel (kernels/int4_gemm.cpp) for decode batches, on one of two weight forms:

        quant "int4"   Q4_1 codes (q4_1_codes)            rows <= NATIVE_INT4_MAX_ROWS (the kernel's limit)
        quant "q8_0"   Q8_0 as two planes (q8_0_planes)   rows <= NATIVE_Q8_0_MAX_ROWS
        more rows      ``above`` (the dense form)

    ``weight`` is the float weight the codes come from (exact for a Q4_1 / Q8_0 file's values); bf16 activations,
    shape per :meth:`NativeInt4.packable`; ``max_rows`` per quant (:func:`native_int4_max_rows`)."""

    def __init__(self, weight: Tensor, above: LinearWeight, kernel: NativeInt4, *, quant: str, max_rows: int) -> None:
        if quant not in ("int4", "q8_0") or max_rows > kernel.max_rows:
            raise ValueError(f"the native int4 kernel runs quant 'int4' or 'q8_0' for at most {kernel.max_rows} "
                             f"rows, got {quant!r} for {max_rows}")
        super().__init__(above, max_rows, quant)
        self.kernel = kernel
        self.packed = kernel.pack(weight) if quant == "int4" else kernel.pack_q8_0(weight)

    def _few(self, x: Tensor) -> Tensor:
        return self.kernel.linear(x, self.packed)

    def _few_call(self) -> NativeCall | None:
        return NativeCall(self.packed)

    def decode_bytes(self) -> int:
        return self.packed.nbytes
