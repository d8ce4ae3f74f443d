"""The weight of a linear layer as one object per numerics path, chosen once at load (layers/linear.py).

Each object computes ``y = x @ W.T`` (2-D ``x`` [rows, in_features], no bias) and owns its row-count dispatch:

    weight object       runs                                                 module
    DenseWeight         F.linear at every row count                          here
    PackedBf16Weight    oneDNN on bf16 packs, one per row range              layers/packed.py
    VnniWeight          the native bf16 GEMM up to its rows, then ``above``  layers/packed.py
    Int8Weight          torch's int8 kernel up to max_rows, then ``above``   layers/int8.py
    Int4Weight          torch's int4 kernel up to max_rows, then ``above``   layers/int4.py
    NativeInt4Weight    the native int4 kernel (int4 / Q8_0 planes) up to    layers/int4.py
                        max_rows, then ``above``
    QDotWeight          the integer-dot kernel at every row count            layers/qdot.py

The few-row forms (:class:`FewRowsWeight`) hold the form that serves larger batches (``above``), so one object
answers for every row count, e.g. NativeInt4Weight (1-8 rows) > VnniWeight (9-64) > PackedBf16Weight (more).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class NativeCall:
    """A packed weight as the all-layers decode op (kernels/decode_layers.cpp) takes it: the op tells the kernel
    from the weight's dtype and shape; ``backend`` is the VNNI backend or the qdot variant ("" for the int4 kernel)
    and ``act_terms`` the qdot kernel's activation terms (1 for the others)."""

    weight: Tensor
    backend: str = ""
    act_terms: int = 1


class LinearWeight(ABC):
    """One numerics path of a linear layer: ``forward(x)`` for any row count, the same kernel for the same row
    count every call. ``dtype`` is the compute dtype (activations and outputs), ``quant`` the weight form the
    layer was asked for ("none", "int8", "int4", "q8_0")."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, quant: str) -> None:
        self.out_features, self.in_features = out_features, in_features
        self.dtype = dtype
        self.quant = quant

    @abstractmethod
    def forward(self, x: Tensor) -> Tensor:
        """``x @ W.T`` for 2-D ``x`` in the compute dtype."""

    @abstractmethod
    def native_call(self, rows: int) -> NativeCall | None:
        """The packed weight :meth:`forward` hands a native kernel for ``rows`` rows, or None when a torch kernel
        runs them (the all-layers decode op then is not taken)."""

    @abstractmethod
    def dense(self) -> Tensor:
        """The weight as a dense [out, in] tensor in the compute dtype (export, tests); the dense form the path
        keeps for large batches, else the quantized weight dequantized."""

    @abstractmethod
    def decode_bytes(self) -> int:
        """Bytes of weight a one-row forward reads (the engine benchmark's bandwidth figure)."""

    def forms(self) -> tuple[LinearWeight, ...]:
        """The objects that serve some row count, fewest rows first (this one alone unless it is a few-row form)."""
        return (self,)

    def describe(self) -> str:
        return type(self).__name__


class DenseWeight(LinearWeight):
    """The weight as one dense tensor in the compute dtype: ``F.linear`` at every row count (fp32 / fp16 models,
    and bf16 ones where oneDNN packing does not run). Shares ``weight``'s storage (e.g. a tied head's embedding)."""

    def __init__(self, weight: Tensor, quant: str = "none") -> None:
        super().__init__(weight.shape[0], weight.shape[1], weight.dtype, quant)
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)

    def native_call(self, rows: int) -> NativeCall | None:
        return None

    def dense(self) -> Tensor:
        return self.weight

    def decode_bytes(self) -> int:
        return self.weight.nbytes


class FewRowsWeight(LinearWeight):
    """A kernel for batches of up to ``max_rows`` rows over the form that serves larger ones:

        rows <= max_rows    the subclass's kernel (:meth:`_few`)
        rows >  max_rows    ``above.forward(x)``

    The dense weight is ``above``'s (the quantized weight is never dequantized for it)."""

    def __init__(self, above: LinearWeight, max_rows: int, quant: str) -> None:
        super().__init__(above.out_features, above.in_features, above.dtype, quant)
        self.above = above
        self.max_rows = max_rows

    @abstractmethod
    def _few(self, x: Tensor) -> Tensor:
        """The product for a batch of at most ``max_rows`` rows."""

    @abstractmethod
    def _few_call(self) -> NativeCall | None:
        """What :meth:`_few` hands a native kernel (None: a torch kernel)."""

    def forward(self, x: Tensor) -> Tensor:
        return self._few(x) if x.shape[0] <= self.max_rows else self.above.forward(x)

    def native_call(self, rows: int) -> NativeCall | None:
        return self._few_call() if rows <= self.max_rows else self.above.native_call(rows)

    def dense(self) -> Tensor:
        return self.above.dense()

    def forms(self) -> tuple[LinearWeight, ...]:
        return (self, *self.above.forms())

    def describe(self) -> str:
        return f"{type(self).__name__} (<= {self.max_rows} rows) > {self.above.describe()}"
