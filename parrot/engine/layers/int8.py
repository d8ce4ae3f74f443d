"""Weight-only int8 (``weight_quant="int8"`` without the integer-dot kernel): per-output-channel symmetric
quantization

    W[n, :] ~= scale[n] * Wq[n, :],   Wq in [-127, 127],   scale[n] = max|W[n, :]| / 127

run by ``torch.ops.aten._weight_int8pack_mm(x, Wq[N, K], scale[N])``, which streams 1 byte per weight. It wins
where the layer is bandwidth-bound (decode: few rows) and loses to the dense bf16/fp32 GEMM (AMX/AVX-512) once
there are enough rows to be compute-bound (prefill), so :class:`Int8Weight` keeps the dense form for larger
batches (1 + 2 bytes per weight with bf16).

The kernel is fast only for bf16 activations, so an fp32 model runs its int8 matmuls in bf16 (activations cast
in, result cast back). Figures: docs/results/kernels.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parrot.engine.layers.weight import FewRowsWeight, LinearWeight, NativeCall

# rows up to which the int8 kernel beats the dense GEMM on SmolLM2's shapes, bf16 activations (see the module
# docstring's figures)
INT8_MAX_ROWS = 4
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


class Int8Weight(FewRowsWeight):
    """Weight-only int8 for decode batches over the dense form:

        rows <= max_rows (INT8_MAX_ROWS)   ``_weight_int8pack_mm`` in int8_compute_dtype (fp32 x: cast in and back)
        more rows                          ``above`` (DenseWeight, PackedBf16Weight or VnniWeight)

    ``weight`` is the float weight the int8 codes are quantized from."""

    def __init__(self, weight: Tensor, above: LinearWeight, max_rows: int = INT8_MAX_ROWS) -> None:
        super().__init__(above, max_rows, "int8")
        self.compute_dtype = int8_compute_dtype(above.dtype)  # the scales must match the activations
        self.qweight, self.scales = quantize_int8(weight, self.compute_dtype)

    def _few(self, x: Tensor) -> Tensor:
        if x.dtype == self.compute_dtype:
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x.to(self.compute_dtype), self.qweight, self.scales).to(x.dtype)

    def _few_call(self) -> NativeCall | None:
        return None

    def decode_bytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes
