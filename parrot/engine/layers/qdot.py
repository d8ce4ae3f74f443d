"""The integer-dot path of a linear layer (kernels/qdot_gemm.cpp): int8 activations x 4-bit weight codes.

The kernel's weight is P planes of 4-bit codes per group of 32 input features,

    W[n][32 g + j] = sum_p  d[p][n][g] * q[p][n][32 g + j] + m[p][n][g],     q in [0, 15], d and m fp16

built here from float weights by their source format, exactly where the file's own codes can be recovered:

    format        planes  codes                                                   exact for the file's values
    q4_1          1       d = (max - min) / 15, m = min  (GGUF Q4_1)               yes
    q4_0          1       d = -w[argmax |w|] / 8, m = -8 d  (GGUF Q4_0)            yes
    q8_0          2       u = round(w / d) + 128 = 16 hi + lo, d = max|w| / 127    yes
                          (hi: 16 d, -128 d; lo: d, 0)
    anything else: weight_quant "int4" -> the q4_1 rule (4-bit requantization), "int8" -> the q8_0 rule

The activations are quantized per row and group of 32 inside the kernel, as one int8 term (llama.cpp's Q8_1) or
two (~16 bits, the default: QDotKernel.terms). :class:`QDotWeight` runs the kernel at every row count (decode and
prefill; with two terms, prefill-sized batches on torch's fp32 GEMM instead) and keeps no dense copy of the weight.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from parrot.engine.layers.int4 import INT4_GROUP, q4_1_codes, q8_0_planes
from parrot.engine.layers.weight import LinearWeight, NativeCall

log = logging.getLogger(__name__)

QDOT_QUANTS = ("int4", "int8")
# GGUF formats whose own codes the kernel runs exactly, per weight_quant they satisfy
EXACT_FORMATS = {"int4": ("q4_0", "q4_1"), "int8": ("q8_0",)}


@dataclass(frozen=True)
class Planes:
    """A weight as P planes of 4-bit codes: codes uint8 [P, N, K], d / m float32 [P, N, K / 32]."""

    codes: Tensor
    d: Tensor
    m: Tensor

    @staticmethod
    def cat(parts: list["Planes"]) -> "Planes":
        """Stack weights along the output dim (the fused qkv / gate_up matmuls); all must have as many planes."""
        if len({p.codes.shape[0] for p in parts}) != 1:
            raise ValueError("fused weights must have the same number of planes")
        return Planes(torch.cat([p.codes for p in parts], 1), torch.cat([p.d for p in parts], 1),
                      torch.cat([p.m for p in parts], 1))

    def dequantize(self) -> Tensor:
        """The float32 weight [N, K] the planes encode."""
        p, n, k = self.codes.shape
        w = self.codes.float().view(p, n, k // INT4_GROUP, INT4_GROUP) * self.d[..., None] + self.m[..., None]
        return w.sum(0).view(n, k)


def _q4_0_codes(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """GGUF Q4_0's codes of float values dequantized from a Q4_0 tensor: w = d (q - 8), where the value of largest
    magnitude has q = 0 (ggml's quantizer sets d = that value / -8), so d = -w[argmax |w|] / 8 exactly."""
    n, k = weight.shape
    w = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    idx = w.abs().argmax(dim=2, keepdim=True)
    d = (-torch.gather(w, 2, idx) / 8.0).half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = (torch.round(w / safe) + 8).clamp_(0, 15).to(torch.uint8).view(n, k)
    return q.contiguous(), d.squeeze(2).contiguous(), (-8.0 * d).squeeze(2).contiguous()


def to_planes(weight: Tensor, quant: str, fmt: str | None = None) -> Planes:
    """Float [N, K] -> Planes for ``quant`` ("int4": one plane, "int8": two), from the file's own codes when the
    weight came from a GGUF tensor of format ``fmt`` that ``quant`` holds exactly (see the module docstring)."""
    if quant not in QDOT_QUANTS:
        raise ValueError(f"qdot quant must be one of {QDOT_QUANTS}, got {quant!r}")
    if weight.dim() != 2 or weight.shape[1] % INT4_GROUP:
        raise ValueError(f"qdot needs a 2-D weight with in_features divisible by {INT4_GROUP}, got "
                         f"{tuple(weight.shape)}")
    if quant == "int8":
        codes, d, m = q8_0_planes(weight)
        return Planes(codes, d, m)
    codes, d, m = _q4_0_codes(weight) if fmt == "q4_0" else q4_1_codes(weight)
    return Planes(codes[None], d[None], m[None])


# Two activation terms cost twice the integer work; from this many rows (prefill chunks) the weight dequantized
# once per call (O(N K)) and multiplied by torch's fp32 GEMM is faster (the crossover lies between 128 and 512 rows
# on AVX2: docs/results/README.md#kernel-design-measurements) and as exact. One term stays on the kernel at every
# size (it outruns the fp32 GEMM there).
DENSE_MIN_ROWS_TWO_TERMS = 256


@dataclass(frozen=True)
class QDotKernel:
    """The native integer-dot GEMM on one variant ("avx2" or the portable "scalar" twin, bit-identical), with
    activations as ``terms`` int8 terms per group of 32 (1: ~8 bits, llama.cpp's numerics; 2: ~16 bits, see
    kernels/qdot_gemm.cpp). From ``dense_min_rows`` rows on (None: never) QDotWeight runs a float32 product on
    torch's GEMM with the weight dequantized for the call instead."""

    ops: Any
    variant: str
    terms: int = 2
    dense_min_rows: int | None = None

    @staticmethod
    def packable(n: int, k: int) -> bool:
        """Whether ``qdot_pack`` takes an [n, k] weight."""
        return n % 8 == 0 and k % INT4_GROUP == 0 and k > 0

    def pack(self, planes: Planes) -> Tensor:
        return self.ops.qdot_pack(planes.codes, planes.d, planes.m)

    def linear(self, x: Tensor, packed: Tensor) -> Tensor:
        return self.ops.qdot_linear(x, packed, self.variant, self.terms)

    def runs_dense(self, rows: int) -> bool:
        return self.dense_min_rows is not None and rows >= self.dense_min_rows


@functools.cache
def qdot_kernel(variant: str, terms: int = 2) -> QDotKernel | None:
    """The native kernel's ``variant`` with ``terms`` activation terms when the library is built and offers the
    variant here (checked once per variant); two terms hand prefill-sized products to torch's fp32 GEMM."""
    from parrot.engine.kernels import KernelBuildError, load_kernels

    try:
        ops = load_kernels(build_if_missing=False)
    except (KernelBuildError, OSError, RuntimeError) as e:
        log.warning("native kernels failed to load (%s); no integer-dot matmuls", e)
        return None
    if ops is None or not hasattr(ops, "qdot_linear") or variant not in ops.qdot_variants():
        return None
    return QDotKernel(ops, variant, terms, DENSE_MIN_ROWS_TWO_TERMS if terms == 2 else None)


class QDotWeight(LinearWeight):
    """A weight as packed planes of 4-bit codes on the integer-dot kernel, every row count:

        rows <  kernel.dense_min_rows (or any, without it)   ``qdot_linear`` (int8 activations x 4-bit codes)
        rows >= kernel.dense_min_rows, fp32 activations      ``F.linear`` on the weight dequantized for the call

    ``quant``: "int4" (one plane) or "int8" (Q8_0 as two planes); shape per :meth:`QDotKernel.packable`."""

    def __init__(self, planes: Planes, kernel: QDotKernel, *, dtype: torch.dtype, quant: str) -> None:
        super().__init__(planes.codes.shape[1], planes.codes.shape[2], dtype, quant)
        self.planes = planes.codes.shape[0]
        self.kernel = kernel
        self.packed = kernel.pack(planes)
        self._dense: Tensor | None = None  # dense(), unpacked on first use

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel.runs_dense(x.shape[0]) and x.dtype == torch.float32:
            return F.linear(x, self.kernel.ops.qdot_dequantize(self.packed))
        return self.kernel.linear(x, self.packed)

    def native_call(self, rows: int) -> NativeCall | None:
        if self.kernel.runs_dense(rows):
            return None
        return NativeCall(self.packed, self.kernel.variant, self.kernel.terms)

    def dense(self) -> Tensor:
        """The weight the planes encode, in the compute dtype (unpacked once, then kept)."""
        if self._dense is None:
            self._dense = self.kernel.ops.qdot_dequantize(self.packed).to(self.dtype)
        return self._dense

    def decode_bytes(self) -> int:
        return self.packed.nbytes

    def describe(self) -> str:
        return (f"QDotWeight[{self.kernel.variant}, {self.quant}, {self.planes} plane(s), "
                f"{self.kernel.terms} act term(s)]")
