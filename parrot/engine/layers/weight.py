"""The weight of a linear layer as one object per numerics path, chosen once at load (layers/linear.py).

Each object computes ``y = x @ W.T`` (2-D ``x`` [rows, in_features], no bias) and owns its row-count dispatch:

    weight object       runs                                                 module
    QuantWeight         the native quantized matmul on the GGUF file's       layers/quant.py
                        codes, every row count
    VnniWeight          the native bf16 GEMM, every row count                layers/packed.py
    PackedBf16Weight    oneDNN on one bf16 pack, every row count             layers/packed.py
    DenseWeight         F.linear at every row count                          here
    Int8Weight          torch's int8 kernel up to max_rows, then ``above``   layers/int8.py
    Int4Weight          torch's int4 kernel up to max_rows, then ``above``   layers/int4.py

All but the last two keep one resident form. Int8Weight / Int4Weight (:class:`FewRowsWeight`) are the fallback
when the native kernel library does not run: they hold the form that serves larger batches (``above``) too.
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
    from the weight's dtype and shape (a uint8 vector: qlinear; bf16 [N/32, K/32, 2, 16, 16, 2]: vnni_linear) and
    runs it with the model's settings for that kernel."""

    weight: Tensor


class LinearWeight(ABC):
    """One numerics path of a linear layer: ``forward(x)`` for any row count, the same kernel for the same row
    count every call. ``dtype`` is the compute dtype (activations and outputs), ``quant`` the weight form the
    layer runs ("none", "int8", "int4", or the GGUF formats of a QuantWeight, e.g. "q4_k+q6_k")."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, quant: str) -> None:
        self.out_features, self.in_features = out_features, in_features
        self.dtype = dtype
        self.quant = quant

    @abstractmethod
    def forward(self, x: Tensor, precise: bool = True) -> Tensor:
        """``x @ W.T`` for 2-D ``x`` in the compute dtype. ``precise``: the batch processes prompt tokens (False:
        decode rows only), which only a QuantWeight's activation rule looks at (layers/quant.py)."""

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

    def forward(self, x: Tensor, precise: bool = True) -> Tensor:
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

    def forward(self, x: Tensor, precise: bool = True) -> Tensor:
        return self._few(x) if x.shape[0] <= self.max_rows else self.above.forward(x, precise)

    def native_call(self, rows: int) -> NativeCall | None:
        return self._few_call() if rows <= self.max_rows else self.above.native_call(rows)

    def dense(self) -> Tensor:
        return self.above.dense()

    def forms(self) -> tuple[LinearWeight, ...]:
        return (self, *self.above.forms())

    def describe(self) -> str:
        return f"{type(self).__name__} (<= {self.max_rows} rows) > {self.above.describe()}"
