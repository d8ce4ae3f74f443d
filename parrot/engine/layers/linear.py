"""The linear layer a model holds: a thin module over exactly one weight object (layers/weight.py), whose
numerics path is chosen once, at load, from the matmul kernels the engine's NumericsPlan allows.

:func:`make_linear` takes a matmul's parts (float tensors and / or GGUF tensors in their file codes, QTensor) and
``quant``, the model's weight rule:

    kernels.quant (the native quantized matmul; every CPU path with the kernel library)
        "auto"    GGUF parts keep their codes (QuantWeight); all-float parts are dense on a bf16 model and Q8_0
                  on an fp32 one (the fp32 paths run no dense matmul kernel of their own); mixed: floats as Q8_0
        "int4"    every part as Q4_1 (a Q4_1 part as it is; the others requantized from floats)
        "int8"    every part as Q8_0 (likewise)
        "none"    dense
    no quantized kernel (torch's kernels: attention_kernel="torch", no kernel library)
        GGUF parts dequantized, then "int4" -> Int4Weight > base (bf16, in_features % 32 == 0), "int8" ->
        Int8Weight > base, anything else -> base

where the dense form (``base``) is

    VnniWeight          bf16 with the native VNNI kernel, both dims multiples of 32
    PackedBf16Weight    bf16 with oneDNN packing
    DenseWeight         otherwise

A shape the quantized kernels cannot pack (rows not a multiple of 16) is dense. ``A > B``: A runs up to its row
limit, B every larger batch -- the torch fallback's only two-form weights; every other path keeps one form.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from parrot.engine.layers.int4 import INT4_GROUP, Int4Weight, int4_max_rows
from parrot.engine.layers.int8 import INT8_MAX_ROWS, Int8Weight
from parrot.engine.layers.packed import PackedBf16Weight, VnniKernel, VnniWeight, packed_gemm_available, vnni_kernel
from parrot.engine.layers.quant import (FLOAT_QUANTS, ActNumerics, QTensor, QuantKernel, QuantWeight, packable,
                                        quant_kernel, quantize_float)
from parrot.engine.layers.weight import DenseWeight, FewRowsWeight, LinearWeight, NativeCall

if TYPE_CHECKING:
    from parrot.engine.loader.pack_cache import PackCache
    from parrot.engine.runtime.numerics import NumericsPlan

log = logging.getLogger(__name__)

WEIGHT_QUANTS = ("none", "int8", "int4")
FLOAT_FORMATS = frozenset({"f32", "f16", "bf16", "f64", "float"})
Part = Tensor | QTensor


@dataclass(frozen=True)
class MatmulKernels:
    """The matmul kernels a model's linear layers may run, fixed for the model's life: from the engine's
    NumericsPlan (:meth:`for_plan`) or everything this machine runs (:meth:`available`, the default of tests and
    benchmarks). Native kernels are CPU kernels: none for another
    device."""

    onednn: bool = False  # bf16 weights pre-packed for oneDNN (layers/packed.py)
    vnni: VnniKernel | None = None  # dense bf16 weights
    quant: QuantKernel | None = None  # GGUF-coded weights

    @staticmethod
    def available(device: torch.device | str, dtype: torch.dtype) -> MatmulKernels:
        """oneDNN packing where it runs, the fastest VNNI backend, and the quantized matmul on the fastest variant
        with two activation terms."""
        cpu = torch.device(device).type == "cpu"
        quant = None
        if cpu:
            from parrot.engine.layers.quant import quant_ops

            ops = quant_ops()
            variant = next(iter(ops.qmm_variants()), None) if ops is not None else None
            quant = quant_kernel(variant) if variant else None
        return MatmulKernels(onednn=packed_gemm_available(device, dtype), vnni=vnni_kernel() if cpu else None,
                             quant=quant)

    @staticmethod
    def for_plan(plan: NumericsPlan, device: torch.device | str, dtype: torch.dtype) -> MatmulKernels:
        """The plan's kernels: the quantized matmul on ``plan.qmm`` with its activation settings, the VNNI backend
        ``plan.vnni`` for dense bf16 weights, oneDNN packing wherever it runs (torch's)."""
        cpu = torch.device(device).type == "cpu"
        quant = quant_kernel(plan.qmm, ActNumerics(*plan.fast_acts), ActNumerics(*plan.precise_acts)) \
            if cpu and plan.qmm else None
        return MatmulKernels(onednn=packed_gemm_available(device, dtype),
                             vnni=vnni_kernel(plan.vnni) if cpu and plan.vnni else None, quant=quant)


@dataclass
class Conversions:
    """What a model's assembly converted (logged once at the end of the load, so nothing changes silently)."""

    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def note(self, name: str, src: str, dst: str) -> None:
        key = (src, dst)
        self.counts[key] += 1
        self.examples.setdefault(key, name)

    def log(self, model: str) -> None:
        for (src, dst), n in sorted(self.counts.items()):
            log.info("%s: %d weight(s) converted %s -> %s (e.g. %s)", model, n, src, dst, self.examples[(src, dst)])


@dataclass(frozen=True)
class LinearPath:
    """The weight object a matmul gets (:func:`choose_path`): ``weight`` its class; for a QuantWeight, ``formats``
    the GGUF format each part runs in; for the torch fallback, ``few`` the few-row class over ``weight`` (the
    dense base) up to ``few_rows`` rows."""

    weight: type[LinearWeight]
    formats: tuple[str, ...] = ()
    few: type[FewRowsWeight] | None = None
    few_rows: int | None = None


def _dense_class(n: int, k: int, dtype: torch.dtype, kernels: MatmulKernels) -> type[LinearWeight]:
    if dtype == torch.bfloat16 and kernels.vnni is not None and VnniKernel.packable(n, k):
        return VnniWeight
    if dtype == torch.bfloat16 and kernels.onednn:
        return PackedBf16Weight
    return DenseWeight


def choose_path(parts: Sequence[tuple[tuple[int, int], str | None]], *, dtype: torch.dtype, quant: str,
                kernels: MatmulKernels) -> LinearPath:
    """The path of a matmul whose weight is ``parts`` -- (shape, GGUF format the kernels read it in, or None for a
    float tensor) each, stacked along the rows -- per the rules in the module docstring. Pure: nothing is built."""
    if quant not in (*WEIGHT_QUANTS, "auto"):
        raise ValueError(f"quant must be one of {(*WEIGHT_QUANTS, 'auto')}, got {quant!r}")
    if not parts or any(s[1] != parts[0][0][1] for s, _ in parts):
        raise ValueError(f"linear weights must be 2-D with one in_features, got {[s for s, _ in parts]}")
    n, k = sum(s[0] for s, _ in parts), parts[0][0][1]
    if kernels.quant is not None and quant != "none" and n % 16 == 0 and k % 32 == 0:
        all_float = all(f is None for _, f in parts)
        if not (quant == "auto" and all_float and dtype != torch.float32):
            target = FLOAT_QUANTS.get(quant)  # "auto": keep the GGUF codes, floats as Q8_0
            formats = tuple(f if f is not None and (target is None or f == target) and packable(s, f)
                            else target or "q8_0" for s, f in parts)
            return LinearPath(QuantWeight, formats)
    base = _dense_class(n, k, dtype, kernels)
    if kernels.quant is None and quant == "int4" and dtype == torch.bfloat16 and k % INT4_GROUP == 0:
        return LinearPath(base, few=Int4Weight, few_rows=int4_max_rows(base))
    if kernels.quant is None and quant in ("int4", "int8"):
        return LinearPath(base, few=Int8Weight, few_rows=INT8_MAX_ROWS)
    return LinearPath(base)


def _float(part: Part) -> Tensor:
    return part.dequantize() if isinstance(part, QTensor) else part.float()


def build_weight(parts: Sequence[Part], path: LinearPath, *, dtype: torch.dtype, kernels: MatmulKernels,
                 name: str = "", conversions: Conversions | None = None, sources: Sequence[str | None] | None = None,
                 cache: PackCache | None = None) -> LinearWeight:
    """The weight object of ``path`` from ``parts``; every part that changes form on the way (a GGUF matrix
    dequantized or requantized, a float requantized) is noted in ``conversions`` under ``name``, with ``sources``
    naming where a float part came from (e.g. "q3_k", dequantized by the loader for lack of a kernel). A
    QuantWeight's packed form is looked up in ``cache`` under ``name`` (then its parts are not even read) and
    handed to it when it had to be made."""
    conv = conversions if conversions is not None else Conversions()
    sources = list(sources or [None] * len(parts))
    fmts = [p.fmt if isinstance(p, QTensor) else (src or "float") for p, src in zip(parts, sources)]
    if path.weight is QuantWeight:
        shapes = [QTensor(fmt, torch.empty(0), tuple(p.shape)) for p, fmt in zip(parts, path.formats)]
        cached = cache.get(name) if cache is not None else None
        if cached is not None:
            return QuantWeight(shapes, kernels.quant, dtype=dtype, packed=cached)
        coded = []
        for p, src_fmt, fmt in zip(parts, fmts, path.formats):
            if isinstance(p, QTensor) and p.fmt == fmt:
                coded.append(p)
                continue
            if src_fmt != "float":
                conv.note(name, src_fmt, fmt)
            coded.append(quantize_float(_float(p), fmt))
        weight = QuantWeight(coded, kernels.quant, dtype=dtype)
        if cache is not None:
            cache.put(name, weight.packed)
        return weight
    for fmt in fmts:
        if fmt not in FLOAT_FORMATS:
            conv.note(name, fmt, "dense " + str(dtype).removeprefix("torch."))
    weight = torch.cat([_float(p) for p in parts]) if len(parts) > 1 else _float(parts[0])
    w = weight.to(dtype).contiguous()
    base: LinearWeight
    if path.weight is VnniWeight:
        base = VnniWeight(w, kernels.vnni)
    elif path.weight is PackedBf16Weight:
        base = PackedBf16Weight(w)
    else:
        base = DenseWeight(w)
    if path.few is Int4Weight:
        return Int4Weight(weight, base, path.few_rows)
    if path.few is Int8Weight:
        return Int8Weight(weight, base, path.few_rows)
    return base


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

    def forward(self, x: Tensor, precise: bool = True) -> Tensor:
        return self.path.forward(x, precise)

    def native_call(self, rows: int) -> NativeCall | None:
        return self.path.native_call(rows)

    def dense_weight(self) -> Tensor:
        return self.path.dense()

    def decode_bytes(self) -> int:
        return self.path.decode_bytes()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, quant={self.quant}: {self.path.describe()}"


def make_linear(parts: Sequence[Part], *, dtype: torch.dtype, quant: str, kernels: MatmulKernels, name: str = "",
                conversions: Conversions | None = None, sources: Sequence[str | None] | None = None,
                cache: PackCache | None = None) -> Linear:
    """The layer of a matmul whose weight is ``parts`` (float tensors and / or QTensors, stacked along the output
    dim) on the path :func:`choose_path` picks (``build_weight`` explains the rest)."""
    desc = [(tuple(p.shape), p.fmt if isinstance(p, QTensor) and packable(p.shape, p.fmt) else None) for p in parts]
    path = choose_path(desc, dtype=dtype, quant=quant, kernels=kernels)
    return Linear(build_weight(parts, path, dtype=dtype, kernels=kernels, name=name, conversions=conversions,
                               sources=sources, cache=cache))
