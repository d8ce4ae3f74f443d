"""The linear layer a model holds: a thin module over exactly one weight object (layers/weight.py), whose
numerics path is chosen once, at load, from the matmul kernels the engine's NumericsPlan allows.

:func:`choose_path` (pure: the quant asked for, the compute dtype, the weight's shape, the kernels) picks

    quant             qdot kernel (avx2 / avx512 plans)    otherwise
    "int4"            QDotWeight                           NativeInt4Weight > base   (bf16, native int4 kernel)
                                                           Int4Weight > base         (else, in_features % 32 == 0)
                                                           Int8Weight > base         (else)
    "int8"            QDotWeight                           Int8Weight > base
    "q8_0" (a head)   -                                    NativeInt4Weight > base   (bf16, native int4 kernel)
                                                           base                      (else)
    "none"            base                                 base

where a shape the qdot kernel cannot pack runs ``base`` (exact), and ``base`` is the form for large batches:

    VnniWeight          bf16 with oneDNN packing and a VNNI kernel, both dims multiples of 32
    PackedBf16Weight    bf16 with oneDNN packing
    DenseWeight         otherwise

``A > B``: A runs up to its row limit, B every larger batch (each class documents its own row-count dispatch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from parrot.engine.layers.int4 import (INT4_GROUP, Int4Weight, NativeInt4, NativeInt4Weight, int4_max_rows,
                                       native_int4, native_int4_max_rows)
from parrot.engine.layers.int8 import INT8_MAX_ROWS, Int8Weight
from parrot.engine.layers.packed import (PackedBf16Weight, VnniKernel, VnniWeight, packed_gemm_available,
                                         vnni_kernel)
from parrot.engine.layers.qdot import QDOT_QUANTS, Planes, QDotKernel, QDotWeight, qdot_kernel, to_planes
from parrot.engine.layers.weight import DenseWeight, FewRowsWeight, LinearWeight, NativeCall

if TYPE_CHECKING:
    from parrot.engine.numerics import NumericsPlan

WEIGHT_QUANTS = ("none", "int8", "int4")
# a layer also takes "q8_0": GGUF Q8_0 as two planes of the native int4 kernel (exact for a Q8_0 weight, e.g. the
# output head of an int4 model); only native, so without the kernel such a layer is a plain bf16 one
LINEAR_QUANTS = (*WEIGHT_QUANTS, "q8_0")


@dataclass(frozen=True)
class MatmulKernels:
    """The matmul kernels a model's linear layers may run, fixed for the model's life: from the engine's
    NumericsPlan (:meth:`for_plan`) or everything this machine runs but the qdot kernel (:meth:`available`, the
    default of tests and benchmarks). Native kernels are CPU kernels: empty for another device."""

    onednn: bool = False  # bf16 weights pre-packed for oneDNN (layers/packed.py)
    vnni: VnniKernel | None = None
    int4: NativeInt4 | None = None
    qdot: QDotKernel | None = None

    @staticmethod
    def available(device: torch.device | str, dtype: torch.dtype) -> MatmulKernels:
        """oneDNN packing where it runs, the fastest VNNI backend and the native int4 kernel where they run."""
        cpu = torch.device(device).type == "cpu"
        return MatmulKernels(onednn=packed_gemm_available(device, dtype), vnni=vnni_kernel() if cpu else None,
                             int4=native_int4() if cpu else None)

    @staticmethod
    def for_plan(plan: NumericsPlan, device: torch.device | str, dtype: torch.dtype) -> MatmulKernels:
        """``plan.matmul`` "vnni-<backend>": that VNNI backend and the native int4 kernel (int4 decode runs where
        they do); "qdot-<variant>": the integer-dot kernel with the plan's activation terms; "torch": none. oneDNN
        packing (torch's) wherever it runs."""
        cpu = torch.device(device).type == "cpu"
        backend, variant = plan.vnni_backend, plan.qdot_variant
        return MatmulKernels(onednn=packed_gemm_available(device, dtype),
                             vnni=vnni_kernel(backend) if cpu and backend else None,
                             int4=native_int4() if cpu and backend else None,
                             qdot=qdot_kernel(variant, plan.act_terms) if cpu and variant else None)


@dataclass(frozen=True)
class LinearPath:
    """The weight classes of one matmul: ``few`` (if any) for batches of up to ``few_rows`` rows over ``base``,
    which serves every larger batch (every batch without ``few``)."""

    base: type[LinearWeight]
    few: type[FewRowsWeight] | None = None
    few_rows: int | None = None


def choose_path(quant: str, dtype: torch.dtype, shapes: Sequence[tuple[int, int]],
                kernels: MatmulKernels) -> LinearPath:
    """The path of a matmul whose weight is the parts of ``shapes`` ([N_i, K], concatenated along N) for
    ``quant`` in LINEAR_QUANTS (the table in the module docstring). Pure: no weight is touched."""
    if quant not in LINEAR_QUANTS:
        raise ValueError(f"quant must be one of {LINEAR_QUANTS}, got {quant!r}")
    n, k = sum(s[0] for s in shapes), shapes[0][1]
    if kernels.qdot is not None and quant in QDOT_QUANTS:
        if all(QDotKernel.packable(*s) for s in shapes):
            return LinearPath(QDotWeight)
        quant = "none"  # a shape the kernel cannot pack: dense, exact
    base: type[LinearWeight] = DenseWeight
    if kernels.onednn and dtype == torch.bfloat16:
        base = VnniWeight if kernels.vnni is not None and VnniKernel.packable(n, k) else PackedBf16Weight
    if quant in ("int4", "q8_0") and kernels.int4 is not None and dtype == torch.bfloat16 \
            and NativeInt4.packable(n, k):
        return LinearPath(base, NativeInt4Weight, native_int4_max_rows(kernels.int4, quant))
    if quant == "int4" and k % INT4_GROUP == 0:
        return LinearPath(base, Int4Weight, int4_max_rows(base))
    if quant == "int4":
        quant = "int8"  # in_features the int4 groups cannot split (a small model's odd width): the int8 rule
    if quant == "int8":
        return LinearPath(base, Int8Weight, INT8_MAX_ROWS)
    return LinearPath(base)  # "none", or "q8_0" without the native kernel


# how each class of a path is built: a base from the dense weight in the compute dtype, a few-row form from the
# float weight (its codes are quantized from that) over the base
_BASES: dict[type[LinearWeight], Callable[[Tensor, MatmulKernels], LinearWeight]] = {
    DenseWeight: lambda dense, kernels: DenseWeight(dense),
    PackedBf16Weight: lambda dense, kernels: PackedBf16Weight(dense, decode_pack=True),
    VnniWeight: lambda dense, kernels: VnniWeight(dense, kernels.vnni),
}
_FEW_ROWS: dict[type[FewRowsWeight], Callable[[Tensor, LinearWeight, int, str, MatmulKernels], FewRowsWeight]] = {
    Int8Weight: lambda weight, above, rows, quant, kernels: Int8Weight(weight, above, rows),
    Int4Weight: lambda weight, above, rows, quant, kernels: Int4Weight(weight, above, rows),
    NativeInt4Weight: lambda weight, above, rows, quant, kernels: NativeInt4Weight(
        weight, above, kernels.int4, quant=quant, max_rows=rows),
}


class Linear(nn.Module):
    """``y = x @ W.T`` for 2-D ``x`` [rows, in_features], no bias, on exactly one weight object (``path``), fixed
    at construction (:func:`make_linear`)."""

    def __init__(self, path: LinearWeight) -> None:
        super().__init__()
        self.path = path

    @property
    def in_features(self) -> int:
        return self.path.in_features

    @property
    def out_features(self) -> int:
        return self.path.out_features

    @property
    def dtype(self) -> torch.dtype:
        return self.path.dtype

    @property
    def quant(self) -> str:
        return self.path.quant

    def forward(self, x: Tensor) -> Tensor:
        return self.path.forward(x)

    def native_call(self, rows: int) -> NativeCall | None:
        return self.path.native_call(rows)

    def dense_weight(self) -> Tensor:
        return self.path.dense()

    def decode_bytes(self) -> int:
        return self.path.decode_bytes()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, quant={self.quant}: {self.path.describe()}"


def make_linear(parts: Sequence[tuple[Tensor, str | None]], *, dtype: torch.dtype, quant: str,
                kernels: MatmulKernels) -> Linear:
    """The layer of a matmul whose weight is ``parts`` (2-D float weights, concatenated along the output dim, each
    with its GGUF format or None) in the compute ``dtype``, on the path :func:`choose_path` picks. A qdot weight
    keeps each part's own codes where its format allows (layers/qdot.py)."""
    if not parts or any(w.dim() != 2 or w.shape[1] != parts[0][0].shape[1] for w, _ in parts):
        raise ValueError(f"linear weights must be 2-D with one in_features, got "
                         f"{[tuple(w.shape) for w, _ in parts]}")
    path = choose_path(quant, dtype, [(w.shape[0], w.shape[1]) for w, _ in parts], kernels)
    if path.base is QDotWeight:
        planes = Planes.cat([to_planes(w, quant, fmt) for w, fmt in parts])
        return Linear(QDotWeight(planes, kernels.qdot, dtype=dtype, quant=quant))
    weight = torch.cat([w for w, _ in parts]) if len(parts) > 1 else parts[0][0]
    base = _BASES[path.base](weight.to(dtype).contiguous(), kernels)
    if path.few is None:
        return Linear(base)
    return Linear(_FEW_ROWS[path.few](weight, base, path.few_rows, quant, kernels))
