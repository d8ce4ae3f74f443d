"""Group-wise asymmetric int4 weights for ``torch._weight_int4pack_mm_for_cpu`` (decode GEMV kernel).

Per group of ``group`` consecutive input features of one output row:

    w ~= (q - 8) * scale + zero,   q in [0, 15],   scale = (max - min) / 15,   zero = min + 8 * scale

This is exactly GGUF Q4_1's layout (blocks of 32 along the input dimension with ``d = (max - min) / 15`` and
``m = min``), so re-quantizing weights that were dequantized from a Q4_1 file recovers the file's own 4-bit
codes: the only loss is rounding scale/zero to the activation dtype. For weights from other formats it is an
ordinary 4-bit quantization (use int8 or none there).

:class:`Int4Weight` runs them on torch's ``_weight_int4pack_mm_for_cpu`` for decode batches over the layer's dense
form: the fallback when the native kernel library does not run (with it, layers/quant.py reads the file's own codes
at every row count).
"""

from __future__ import annotations

import torch
from torch import Tensor

from parrot.engine.layers.weight import DenseWeight, FewRowsWeight, LinearWeight, NativeCall

INT4_GROUP = 32
# rows up to which torch's int4 GEMV (half of int8's bytes) beats the dense GEMM, and a pre-packed bf16 weight
# (layers/packed.py), which wins from 2 rows on (figures: docs/results/kernels.md)
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
