"""Pre-packed bf16 weights: oneDNN's packs (any CPU with oneDNN bf16) and the native VNNI GEMM's (AMX /
AVX512-BF16), as the weight objects :class:`PackedBf16Weight` and :class:`VnniWeight`.

``F.linear`` on a plain [N, K] bf16 weight makes oneDNN re-layout ("copy B chunk into buffer") the weight on
every call before its AMX/AVX512-BF16 micro-kernels can run; at decode sizes that copy costs as much as the
multiply. ``torch.ops.mkldnn._reorder_linear_weight`` does the re-layout once, for an expected row count, and
``torch.ops.mkldnn._linear_pointwise`` multiplies with the packed weight. Results are bit-identical to
``F.linear`` (same micro-kernels) and faster: a pack for 64 rows serves decode batches (up to 128 rows), one for
512 rows prefill. fp32 weights gain nothing and are not packed. Figures for both packs and the VNNI kernel below:
docs/results/README.md#kernel-design-measurements.

On a CPU with AMX or AVX512-BF16, the decode pack is instead the layout of the native ``vnni_linear`` kernel
(parrot/engine/kernels/vnni_gemm.cpp) when the library is built and the shape allows it (both dims multiples of
32): at a few dozen rows it streams the weights at the machine's read bandwidth, well above oneDNN; above its row
limit (per backend) the oneDNN prefill pack runs, so there are still two bf16 copies.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from parrot.engine.layers.weight import FewRowsWeight, LinearWeight, NativeCall

log = logging.getLogger(__name__)

# rows the two packs are laid out for, and the row count above which the prefill pack is used
DECODE_PACK_ROWS = 64
PREFILL_PACK_ROWS = 512
DECODE_PACK_MAX_ROWS = 128
# rows up to which the native kernel's pack is used, per backend (above: the oneDNN prefill pack): where it stops
# beating oneDNN on SmolLM2's matmul shapes (docs/results/README.md#kernel-design-measurements)
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
    max_rows: int  # VnniWeight runs it for 1..max_rows rows

    @staticmethod
    def packable(n: int, k: int) -> bool:
        """Whether ``vnni_pack`` takes an [n, k] bf16 weight (both dims multiples of 32)."""
        return n % 32 == 0 and k % 32 == 0

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


class PackedBf16Weight(LinearWeight):
    """A bf16 weight pre-packed for oneDNN (no dense copy is kept):

        rows <= DECODE_PACK_MAX_ROWS    the pack for DECODE_PACK_ROWS rows     (``decode_pack=True``)
        more rows                       the pack for PREFILL_PACK_ROWS rows    (every row count without the
                                                                                decode pack: under a VnniWeight)
    """

    def __init__(self, dense: Tensor, *, decode_pack: bool) -> None:
        super().__init__(dense.shape[0], dense.shape[1], dense.dtype, "none")
        self.decode = pack_weight(dense, DECODE_PACK_ROWS) if decode_pack else None
        self.prefill = pack_weight(dense, PREFILL_PACK_ROWS)

    def forward(self, x: Tensor) -> Tensor:
        small = self.decode is not None and x.shape[0] <= DECODE_PACK_MAX_ROWS
        return packed_linear(x, self.decode if small else self.prefill)

    def native_call(self, rows: int) -> NativeCall | None:
        return None

    def dense(self) -> Tensor:
        return self.prefill.to_dense()

    def decode_bytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize


class VnniWeight(FewRowsWeight):
    """The native VNNI bf16 GEMM (kernels/vnni_gemm.cpp, AMX or AVX512-BF16) for decode-sized batches:

        rows <= kernel.max_rows    ``vnni_linear`` on the kernel's packed layout
        more rows                  the oneDNN prefill pack (a PackedBf16Weight without the decode pack)

    The weight must be bf16 with both dims multiples of 32 (:meth:`VnniKernel.packable`)."""

    def __init__(self, dense: Tensor, kernel: VnniKernel) -> None:
        super().__init__(PackedBf16Weight(dense, decode_pack=False), kernel.max_rows, "none")
        self.kernel = kernel
        self.packed = kernel.pack(dense)

    def _few(self, x: Tensor) -> Tensor:
        return self.kernel.linear(x, self.packed)

    def _few_call(self) -> NativeCall | None:
        return NativeCall(self.packed, self.kernel.backend)

    def decode_bytes(self) -> int:
        return self.above.decode_bytes()

    def describe(self) -> str:
        return f"VnniWeight[{self.kernel.backend}] (<= {self.max_rows} rows) > {self.above.describe()}"
