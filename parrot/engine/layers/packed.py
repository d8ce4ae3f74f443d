"""Pre-packed bf16 weights for oneDNN's matmul (CPU).

``F.linear`` on a plain [N, K] bf16 weight makes oneDNN re-layout ("copy B chunk into buffer") the weight on
every call before its AMX/AVX512-BF16 micro-kernels can run; at decode sizes that copy costs as much as the
multiply. ``torch.ops.mkldnn._reorder_linear_weight`` does the re-layout once, for an expected row count, and
``torch.ops.mkldnn._linear_pointwise`` multiplies with the packed weight. Results are bit-identical to
``F.linear`` (same micro-kernels); measured on the dev box (1 thread, SmolLM2 shapes) 1.3-2x faster for 2-128 rows
(the 49152 x 576 head at 64 rows: 21.7 -> 10.9 ms), and a weight packed for 512 rows runs a 512-row prefill
~1.7x faster than the dense call. fp32 weights gain nothing (slower below 8 rows) and are not packed.

On a CPU with AMX or AVX512-BF16, the decode pack is instead the layout of the native ``vnni_linear`` kernel
(parrot/engine/kernels/vnni_gemm.cpp) when the library is built and the shape allows it (both dims multiples of
32): at a few dozen rows it streams the weights at the machine's read bandwidth, well above oneDNN (AMX: SmolLM2's
30 layers at 16 rows, 2 threads: 21 -> 11 ms); above its row limit (per backend, measured) the oneDNN prefill pack
runs, so there are still two bf16 copies.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# rows the two packs are laid out for, and the row count above which the prefill pack is used
DECODE_PACK_ROWS = 64
PREFILL_PACK_ROWS = 512
DECODE_PACK_MAX_ROWS = 128
# rows up to which the native kernel's pack is used, per backend (above: the oneDNN prefill pack). Measured on
# SmolLM2's four matmul shapes x 30 layers, 2 threads: AMX (Xeon) ties oneDNN at 64 rows; AVX512-BF16 (Zen 4,
# 42 GB/s read) beats oneDNN's decode pack at 1-64 rows (1: 5.1 vs 7.5 ms, 16: 11.0 vs 12.5, 64: 36.2 vs 38.2)
# and ties its prefill pack at 96-128
VNNI_MAX_ROWS = {"amx": 32, "avx512_bf16": 64}


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


@dataclass(frozen=True)
class VnniKernel:
    """The native bf16 GEMM of kernels/vnni_gemm.cpp on one backend ("amx" or "avx512_bf16")."""

    ops: Any
    backend: str
    max_rows: int  # FastLinear uses it for 1..max_rows rows

    def pack(self, weight: Tensor) -> Tensor:
        return self.ops.vnni_pack(weight)

    def linear(self, x: Tensor, packed: Tensor) -> Tensor:
        return self.ops.vnni_linear(x, packed, self.backend)


def vnni_kernels() -> list[VnniKernel]:
    """Every backend of the native kernel that runs here (AMX needs the CPU feature, a build with AMX enabled and
    the OS granting tile state to the process; AVX512-BF16 only the CPU feature), fastest first."""
    from parrot.engine.kernels import KernelBuildError, load_kernels

    try:
        ops = load_kernels(build_if_missing=False)
    except (KernelBuildError, OSError, RuntimeError) as e:
        log.warning("native kernels failed to load (%s); using oneDNN for decode matmuls", e)
        return []
    if ops is None or not hasattr(ops, "vnni_linear"):
        return []
    have = set(ops.vnni_backends())
    return [VnniKernel(ops, b, VNNI_MAX_ROWS[b]) for b in VNNI_MAX_ROWS if b in have]


@functools.cache
def vnni_kernel(backend: str | None = None) -> VnniKernel | None:
    """The native decode GEMM on ``backend`` ("amx" / "avx512_bf16"; None = the fastest on this machine), or None
    where it does not run (checked once per backend)."""
    kernels = [k for k in vnni_kernels() if backend is None or k.backend == backend]
    return kernels[0] if kernels else None


def vnni_packable(weight: Tensor) -> bool:
    """Whether ``vnni_pack`` takes this weight (bf16 on the CPU, both dims multiples of 32)."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 32 == 0 and k % 32 == 0
