"""Bias-free linear layer with optional weight-only int8/int4 kernels and pre-packed bf16 weights, picked per
call by the number of rows.

Weight-only int8 (``weight_quant="int8"``): per-output-channel symmetric quantization

    W[n, :] ~= scale[n] * Wq[n, :],   Wq in [-127, 127],   scale[n] = max|W[n, :]| / 127

run by ``torch.ops.aten._weight_int8pack_mm(x, Wq[N, K], scale[N])``, which streams 1 byte per weight. It wins
where the layer is bandwidth-bound (decode: few rows) and loses to the dense bf16/fp32 GEMM (AMX/AVX-512)
once there are enough rows to be compute-bound (prefill). So an int8 layer also keeps the dense copy and uses
it for ``rows > int8_max_rows``. That costs 1 + 2 bytes per weight (bf16) -- ~0.4 GB for a 135M model, fine
here; pass ``int8_max_rows=None`` to drop the dense copy and always use int8.

The kernel is fast only for bf16 activations (measured: with fp32 activations it is ~7x slower than the fp32
dense GEMV), so an fp32 model runs its int8 matmuls in bf16 (activations cast in, result cast back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parrot.engine.layers.int4 import (INT4_GROUP, NATIVE_Q8_0_MAX_ROWS, NativeInt4, native_int4,
                                       quantize_int4)
from parrot.engine.layers.packed import (DECODE_PACK_MAX_ROWS, DECODE_PACK_ROWS, PREFILL_PACK_ROWS, VnniKernel,
                                         pack_weight, packed_linear, vnni_kernel, vnni_packable)

WEIGHT_QUANTS = ("none", "int8", "int4")
# FastLinear also takes "q8_0": GGUF Q8_0 as two planes of the native int4 kernel (exact for a Q8_0 weight, e.g.
# the output head of an int4 model); only native, so without the kernel such a layer is a plain bf16 one
LINEAR_QUANTS = (*WEIGHT_QUANTS, "q8_0")
# Measured on the dev box (SmolLM2 shapes, bf16 activations): int8 beats the dense kernel up to 4 rows
# (T=1: ~2.5x, T=4: ~1.1x); from 8 rows on the dense bf16 GEMM wins.
INT8_MAX_ROWS = 4
# int4 (group 32) GEMV streams half of int8's bytes; like int8 it loses to the dense GEMM beyond a few rows
INT4_MAX_ROWS = 4
# ... and to a pre-packed bf16 weight (layers/packed.py) from 2 rows on (measured: 331 vs 229 us at 1 row for
# the 576 x 3072 gate/up, 343 vs 429 us at 4 rows)
INT4_MAX_ROWS_PACKED = 1
_INT8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def int8_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the int8 kernel runs in for a model of ``dtype`` (fp32 models use bf16 there)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


def int8_kernel_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``_weight_int8pack_mm`` runs for activations of ``dtype`` on ``device`` (probed with a tiny call)."""
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is None or dtype not in _INT8_DTYPES:
        return False
    try:
        x = torch.zeros(1, 32, dtype=dtype, device=device)
        w = torch.zeros(8, 32, dtype=torch.int8, device=device)
        op(x, w, torch.ones(8, dtype=dtype, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def quantize_int8(weight: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-row symmetric int8 of a float [N, K] weight -> (int8 [N, K], scales [N] in ``scale_dtype``).

    The kernel wants scales in the activation dtype; we round the scale to that dtype *before* quantizing, so
    the only error is the int8 rounding (a bf16-rounded scale would otherwise bias a whole output row)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class FastLinear(nn.Module):
    """``y = x @ W.T`` for 2-D ``x`` [rows, in_features]; no bias. Three kernels, picked per call by row count:

        rows <= quant_max_rows          quantized weight-only kernel (bandwidth-bound decode of a few rows;
                                        int4: the native kernel where it runs, else torch's)
        rows <= vnni.max_rows           the native VNNI kernel's packed bf16 weight    (``pack=True``, AMX or
                                                                                        AVX512-BF16)
        rows <= DECODE_PACK_MAX_ROWS    bf16 weight packed for DECODE_PACK_ROWS rows   (``pack=True``, no VNNI)
        more rows                       bf16 weight packed for PREFILL_PACK_ROWS rows  (``pack=True``)
        (without packing: the dense ``F.linear``)

    Buffers: ``weight`` (dense, compute dtype; dropped when packed -- ``dense_weight()`` unpacks on demand),
    ``qweight`` and ``scales`` for a quantized layer (int8: [N] per-row scales; int4: [K/32, N, 2] group scales
    and zeros, see layers/int4.py). The oneDNN packed weights are opaque mkldnn tensors kept as plain attributes;
    ``vnni_weight`` is the native kernel's layout (kernels/vnni_gemm.cpp) and replaces the oneDNN decode pack;
    ``int4_weight`` the native int4 kernel's (kernels/int4_gemm.cpp, codes + fp16 scales in one stream), kept
    beside torch's int4 form so :meth:`use_native` can switch either native kernel off."""

    weight: Tensor | None
    qweight: Tensor | None
    scales: Tensor | None

    def __init__(self, weight: Tensor, *, dtype: torch.dtype, quant: str = "none",
                 quant_max_rows: int | None = None, pack: bool = False, vnni_backend: str | None = None) -> None:
        super().__init__()
        if quant not in LINEAR_QUANTS:
            raise ValueError(f"quant must be one of {LINEAR_QUANTS}, got {quant!r}")
        if weight.dim() != 2:
            raise ValueError(f"FastLinear weight must be 2-D, got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.quant = quant
        dense = weight.to(dtype).contiguous()
        native4 = native_int4() if quant in ("int4", "q8_0") and dtype == torch.bfloat16 \
            and NativeInt4.packable(weight) else None
        self.int4_native_for: NativeInt4 | None = native4
        self.int4 = native4  # None while use_native(False)
        self.int4_weight = None
        if native4 is not None:
            self.int4_weight = native4.pack(weight) if quant == "int4" else native4.pack_q8_0(weight)
        self._pack = pack
        self._quant_max_rows = quant_max_rows
        self.quant_max_rows = self._rows_limit()
        self.dtype = dense.dtype
        # the machine's fastest native backend, if any and the shape fits; ``vnni`` is None while use_native(False)
        kernel = vnni_kernel(vnni_backend) if pack and vnni_packable(dense) else None
        self.vnni_packed_for: VnniKernel | None = kernel
        self.vnni = kernel
        self.vnni_weight = kernel.pack(dense) if kernel is not None else None
        self.packed_decode = pack_weight(dense, DECODE_PACK_ROWS) if pack and self.vnni is None else None
        self.packed_prefill = pack_weight(dense, PREFILL_PACK_ROWS) if pack else None
        self.register_buffer("weight", None if pack else dense)
        # the dtype the quantized kernel runs in (its scales must match the activations)
        self.int8_dtype = int8_compute_dtype(dtype) if quant == "int8" else dtype
        if quant == "int8":
            qweight, scales = quantize_int8(weight, self.int8_dtype)
        elif quant == "int4":
            qweight, scales = quantize_int4(weight, INT4_GROUP, dtype)
        else:
            qweight = scales = None
        self.register_buffer("qweight", None if qweight is None else qweight.to(weight.device))
        self.register_buffer("scales", None if scales is None else scales.to(weight.device))

    def _rows_limit(self) -> int | None:
        """Rows up to which the quantized kernel runs: the caller's choice, else measured per kernel."""
        if self.quant == "none":
            return None
        if self._quant_max_rows is not None:
            if self.int4 is not None and self._quant_max_rows > self.int4.max_rows:
                raise ValueError(f"quant_max_rows={self._quant_max_rows} exceeds the native int4 kernel's "
                                 f"{self.int4.max_rows} rows")
            return self._quant_max_rows
        if self.quant == "int8":
            return INT8_MAX_ROWS
        if self.quant == "q8_0":
            return NATIVE_Q8_0_MAX_ROWS if self.int4 is not None else None
        if self.int4 is not None:
            return self.int4.max_rows
        return INT4_MAX_ROWS_PACKED if self._pack else INT4_MAX_ROWS

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        if self.int4 is not None and rows <= self.quant_max_rows:
            return self.int4.linear(x, self.int4_weight)
        if self.qweight is not None and rows <= self.quant_max_rows:
            if self.quant == "int4":
                return torch._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP, self.scales)
            if x.dtype == self.int8_dtype:
                return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
            return torch.ops.aten._weight_int8pack_mm(x.to(self.int8_dtype), self.qweight, self.scales).to(x.dtype)
        if self.vnni is not None and rows <= self.vnni.max_rows:
            return self.vnni.linear(x, self.vnni_weight)
        if self.packed_prefill is not None:
            small = self.packed_decode is not None and rows <= DECODE_PACK_MAX_ROWS
            return packed_linear(x, self.packed_decode if small else self.packed_prefill)
        return F.linear(x, self.weight)

    def native_weight(self, rows: int) -> Tensor | None:
        """The packed weight :meth:`forward` hands a native kernel for ``rows`` rows (the int4 or the VNNI form;
        the dtype tells which), or None when it would run a torch kernel."""
        if self.int4 is not None and rows <= self.quant_max_rows:
            return self.int4_weight
        if self.qweight is not None and rows <= self.quant_max_rows:
            return None
        if self.vnni is not None and rows <= self.vnni.max_rows:
            return self.vnni_weight
        return None

    def use_native(self, enabled: bool) -> bool:
        """Switch the native kernels off (the VNNI GEMM: the oneDNN prefill pack then runs every packed call; the
        int4 GEMM: torch's int4 kernel, up to its own row limit) or back on where this layer has their weights.
        Returns whether one of them is on."""
        self.vnni = self.vnni_packed_for if enabled else None
        self.int4 = self.int4_native_for if enabled else None
        self.quant_max_rows = self._rows_limit()
        return self.vnni is not None or self.int4 is not None

    def dense_weight(self) -> Tensor:
        """The weight as a dense tensor in the compute dtype."""
        return self.weight if self.weight is not None else self.packed_prefill.to_dense()

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, quant={self.quant}, "
                f"quant_max_rows={self.quant_max_rows}, packed={self.packed_prefill is not None}, "
                f"vnni={self.vnni.backend if self.vnni is not None else None}, native_int4={self.int4 is not None}")
