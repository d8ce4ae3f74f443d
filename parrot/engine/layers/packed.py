"""Pre-packed bf16 weights for oneDNN's matmul (CPU).

``F.linear`` on a plain [N, K] bf16 weight makes oneDNN re-layout ("copy B chunk into buffer") the weight on
every call before its AMX/AVX512-BF16 micro-kernels can run; at decode sizes that copy costs as much as the
multiply. ``torch.ops.mkldnn._reorder_linear_weight`` does the re-layout once, for an expected row count, and
``torch.ops.mkldnn._linear_pointwise`` multiplies with the packed weight. Results are bit-identical to
``F.linear`` (same micro-kernels); measured on the dev box (1 thread, SmolLM2 shapes) 1.3-2x faster for 2-128 rows
(the 49152 x 576 head at 64 rows: 21.7 -> 10.9 ms), and a weight packed for 512 rows runs a 512-row prefill
~1.7x faster than the dense call. fp32 weights gain nothing (slower below 8 rows) and are not packed.

On a CPU with AMX, the decode pack is instead the layout of the native ``amx_linear`` kernel
(parrot/engine/kernels/amx_gemm.cpp) when the library is built and the shape allows it (both dims multiples of
32): at 2-32 rows it streams the weights at the machine's read bandwidth, ~2x oneDNN (SmolLM2's 30 layers at 16 rows,
2 threads: 21 -> 11 ms); from 33 rows on the oneDNN prefill pack runs (as fast as the kernel at 64 rows, faster
above), so there are still two bf16 copies.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# rows the two packs are laid out for, and the row count above which the prefill pack is used
DECODE_PACK_ROWS = 64
PREFILL_PACK_ROWS = 512
DECODE_PACK_MAX_ROWS = 128
# rows up to which the AMX kernel's pack is used (above: the oneDNN prefill pack)
AMX_MAX_ROWS = 32


def packed_gemm_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether packed oneDNN matmuls run (and pay off) for ``dtype`` on ``device``: bf16 on a CPU with oneDNN."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(32, 64).to(dtype)
        x = torch.randn(3, 64).to(dtype)
        return torch.equal(packed_linear(x, pack_weight(w, DECODE_PACK_ROWS)), torch.nn.functional.linear(x, w))
    except (RuntimeError, AttributeError):
        return False


def pack_weight(weight: Tensor, rows: int) -> Tensor:
    """A bf16 [N, K] weight re-laid-out for ``rows``-row activations (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def packed_linear(x: Tensor, packed: Tensor) -> Tensor:
    """``x @ W.T`` for 2-D ``x`` with a weight from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


@functools.cache
def amx_ops():
    """The native kernels namespace when its ``amx_linear`` runs on this CPU/OS, else None (checked once: AMX
    needs the CPU feature, a kernel build with AMX enabled, and the OS granting tile state to the process)."""
    from parrot.engine.kernels import KernelBuildError, load_kernels

    try:
        ops = load_kernels(build_if_missing=False)
    except (KernelBuildError, OSError, RuntimeError) as e:
        log.warning("native kernels failed to load (%s); using oneDNN for decode matmuls", e)
        return None
    if ops is None or not hasattr(ops, "amx_linear") or not ops.amx_available():
        return None
    return ops


def amx_packable(weight: Tensor) -> bool:
    """Whether ``amx_pack`` takes this weight (bf16 on the CPU, both dims multiples of 32)."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 32 == 0 and k % 32 == 0
