"""Weights in their GGUF file's own codes on the native quantized matmul (kernels/qmm.cpp): one resident form per
layer, every row count.

A GGUF tensor in one of the formats the kernels read (:data:`NATIVE_FORMATS`) arrives from the loader as a
:class:`QTensor`, the file's bytes untouched. :meth:`QuantKernel.pack` moves those codes and scales into the
kernels' layout (kernels/qformats.h; a fused matmul's parts may each keep their own format), and
:class:`QuantWeight` runs ``qlinear`` on it at every row count, with one of the kernel's two activation rules
(:class:`ActNumerics`): ``precise`` for forwards that process prompt tokens, ``fast`` for decode-only batches:

    rows <= x2_rows        int8 activations in two terms (~16 bits per group of 32)
    rows >  x2_rows        ``terms`` int8 terms (1: llama.cpp's activation precision, the fast one; 2: as above)
    rows >= big_rows       (when > 0) the weight dequantized one 32-row bf16 tile (AVX512-BF16, bf16 activations)
                           or one 256-row float32 chunk (elsewhere) at a time, through a dense GEMM

A float weight that should run quantized (a float model with weight_quant "int4" / "int8", a format without a
kernel, the fp32 paths' float tensors) is quantized by the ``gguf`` package's reference quantizers into a real
GGUF format first (:func:`quantize_float`), so every quantized weight is a GGUF tensor and there is one packer.
:class:`QuantEmbedding` reads token rows out of a packed table (a tied head's, or the file's quantized
``token_embd``) instead of keeping a dense copy.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from parrot.engine.layers.weight import LinearWeight, NativeCall


# ggml type ids of the formats the kernels read (kernels/qformats.h)
GGML_TYPE_IDS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
NATIVE_FORMATS = frozenset(GGML_TYPE_IDS)
# formats gguf's reference quantizer writes from floats (what weight_quant "int4" / "int8" and conversions use)
FLOAT_QUANTS = {"int4": "q4_1", "int8": "q8_0"}
PACK_ROWS = 16  # output rows per column block of the packed layout


@dataclass(frozen=True)
class QTensor:
    """A 2-D GGUF tensor as the file stores it: ``raw`` uint8 [rows, row bytes] (a view of the file mapping, or
    bytes written by :func:`quantize_float`) in format ``fmt`` (ggml's type name, lower case) of logical
    ``shape`` (rows = output features, cols = input features)."""

    fmt: str
    raw: Tensor
    shape: tuple[int, int]

    def select(self, rows: Tensor | slice) -> QTensor:
        """The tensor's rows ``rows`` (an index tensor or a slice): whole rows of blocks, no decoding."""
        raw = self.raw[rows]
        return QTensor(self.fmt, raw, (raw.shape[0], self.shape[1]))

    def dequantize(self) -> Tensor:
        """The float32 values (gguf's reference dequantization)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return torch.from_numpy(np.ascontiguousarray(
            dequantize(self.raw.numpy(), GGMLQuantizationType[self.fmt.upper()]), dtype=np.float32)).view(self.shape)


def quantize_float(weight: Tensor, fmt: str) -> QTensor:
    """A float [rows, cols] weight in GGUF format ``fmt`` by the ``gguf`` package's reference quantizer (what
    llama.cpp writes for that type)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(weight.detach().float().contiguous().numpy(), GGMLQuantizationType[fmt.upper()])
    return QTensor(fmt, torch.from_numpy(np.ascontiguousarray(raw)), (weight.shape[0], weight.shape[1]))


def packable(shape: tuple[int, int], fmt: str) -> bool:
    """Whether the kernels take a [rows, cols] tensor of ``fmt`` (whole column blocks of 16 rows)."""
    return fmt in NATIVE_FORMATS and shape[0] % PACK_ROWS == 0 and shape[0] > 0 and shape[1] % 32 == 0


@dataclass(frozen=True)
class ActNumerics:
    """What a quantized matmul does with its activations, by row count: two int8 terms up to ``x2_rows`` rows,
    ``terms`` above, and from ``big_rows`` rows (0: never) the big-batch path (qmm.cpp)."""

    terms: int = 2
    x2_rows: int = 0
    big_rows: int = 0

    def describe(self) -> str:
        out = f"int8x2 <= {self.x2_rows} rows, int8x{self.terms} above" if self.x2_rows and self.terms == 1 \
            else f"int8x{self.terms}"
        return out + (f", dense from {self.big_rows} rows" if self.big_rows else "")


@dataclass(frozen=True)
class QuantKernel:
    """The native quantized matmul on one variant ("avx512vnni", "avx2" or the bit-identical "scalar") with its two
    activation rules: ``precise`` where prompt tokens are processed, ``fast`` for decode-only batches."""

    ops: Any
    variant: str
    fast: ActNumerics = ActNumerics()
    precise: ActNumerics = ActNumerics()

    def pack(self, parts: Sequence[QTensor]) -> Tensor:
        """The packed weight of ``parts`` stacked along the rows (each keeps its own format)."""
        k = parts[0].shape[1]
        if any(p.shape[1] != k for p in parts):
            raise ValueError(f"fused weights must share in_features, got {[p.shape for p in parts]}")
        return self.ops.qpack([p.raw for p in parts], [GGML_TYPE_IDS[p.fmt] for p in parts], k)

    def linear(self, x: Tensor, packed: Tensor, precise: bool = True) -> Tensor:
        a = self.precise if precise else self.fast
        return self.ops.qlinear(x, packed, self.variant, a.terms, a.x2_rows, a.big_rows)


@functools.cache
def quant_ops():
    """The kernel library when it is built and has the quantized matmul (None otherwise)."""
    from parrot.engine.kernels import kernels_if_built

    return kernels_if_built("qlinear", instead="no quantized matmuls")


def quant_kernel(variant: str, fast: ActNumerics = ActNumerics(),
                 precise: ActNumerics | None = None) -> QuantKernel | None:
    """The quantized matmul on ``variant`` with these activation rules (``precise`` defaults to ``fast``), or None
    where it does not run."""
    ops = quant_ops()
    if ops is None or variant not in ops.qmm_variants():
        return None
    return QuantKernel(ops, variant, fast, precise if precise is not None else fast)


class QuantWeight(LinearWeight):
    """A weight in its GGUF codes, packed (kernels/qformats.h), on ``qlinear`` at every row count; the only form
    the layer keeps. ``quant`` names the formats ("q4_k", or "q4_k+q6_k" for a fused matmul of mixed parts)."""

    def __init__(self, parts: Sequence[QTensor], kernel: QuantKernel, *, dtype: torch.dtype,
                 packed: Tensor | None = None) -> None:
        """``packed``: the parts already packed (a cache's copy); else they are packed here."""
        n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
        super().__init__(n, k, dtype, "+".join(dict.fromkeys(p.fmt for p in parts)))
        self.kernel = kernel
        self.packed = packed if packed is not None else kernel.pack(parts)
        info = kernel.ops.qinfo(self.packed)
        if (info[0], info[1]) != (k, n):
            raise ValueError(f"packed weight is {info[1]} x {info[0]}, the parts {n} x {k}")

    def forward(self, x: Tensor, precise: bool = True) -> Tensor:
        return self.kernel.linear(x, self.packed, precise)

    def native_call(self, rows: int) -> NativeCall | None:
        big = self.kernel.fast.big_rows
        return None if big and rows >= big else NativeCall(self.packed)

    def dense(self) -> Tensor:
        """The weight dequantized (a new tensor each call: nothing is kept)."""
        return self.kernel.ops.qdequantize(self.packed).to(self.dtype)

    def decode_bytes(self) -> int:
        return self.packed.nbytes

    def describe(self) -> str:
        k = self.kernel
        acts = (k.fast.describe() if k.fast == k.precise
                else f"decode {k.fast.describe()}; prompts {k.precise.describe()}")
        return f"QuantWeight[{k.variant}, {self.quant}, {acts}]"


class Embedding(ABC):
    """The token embedding table in the compute dtype ``dtype``."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device

    @abstractmethod
    def lookup(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` (int64 [T]) -> [T, hidden] in ``dtype``."""

    @abstractmethod
    def dense(self) -> Tensor:
        """The whole table [vocab, hidden] in ``dtype`` (export, tests)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the table keeps resident."""


class DenseEmbedding(Embedding):
    """A dense table in the compute dtype."""

    def __init__(self, table: Tensor) -> None:
        super().__init__(table.dtype, table.device)
        self.table = table

    def lookup(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.table)

    def dense(self) -> Tensor:
        return self.table

    @property
    def nbytes(self) -> int:
        return self.table.nbytes


class QuantEmbedding(Embedding):
    """Rows of a packed quantized table (a tied head's weight, or the file's quantized token_embd), dequantized
    per lookup: the table keeps its file's size."""

    def __init__(self, packed: Tensor, ops: Any, dtype: torch.dtype) -> None:
        super().__init__(dtype, packed.device)
        self.packed, self.ops = packed, ops

    def lookup(self, ids: Tensor) -> Tensor:
        return self.ops.qembed(self.packed, ids.to(torch.long), self.dtype)

    def dense(self) -> Tensor:
        return self.ops.qdequantize(self.packed).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes
