"""Dense bf16 weights, pre-packed once: the native VNNI GEMM's layout (AMX / AVX512-BF16) or oneDNN's, as the weight
objects :class:`VnniWeight` and :class:`PackedBf16Weight`; each is the layer's one resident form at every row count.

``F.linear`` on a plain [N, K] bf16 weight makes oneDNN re-layout ("copy B chunk into buffer") the weight on
every call before its AMX/AVX512-BF16 micro-kernels can run; at decode sizes that copy costs as much as the
multiply. ``torch.ops.mkldnn._reorder_linear_weight`` does the re-layout once, for an expected row count, and
``torch.ops.mkldnn._linear_pointwise`` multiplies with the packed weight (bit-identical to ``F.linear``). Where
the native kernel library runs (a CPU with AMX or AVX512-BF16), ``vnni_linear`` (kernels/vnni_gemm.cpp) takes
its own layout instead: it streams the weights at the machine's read bandwidth at decode sizes, where oneDNN does
not. fp32 weights gain nothing from packing and stay plain (DenseWeight).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from parrot.engine.layers.weight import LinearWeight, NativeCall


# the activation row count oneDNN's pack is laid out for (it serves every row count)
PREFILL_PACK_ROWS = 512
VNNI_BACKENDS = ("amx", "avx512_bf16")  # fastest first


def packed_gemm_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether packed oneDNN matmuls run (and pay off) for ``dtype`` on ``device``: bf16 on a CPU with oneDNN."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(32, 64).to(dtype)
        x = torch.randn(3, 64).to(dtype)
        return torch.equal(packed_linear(x, pack_weight(w, PREFILL_PACK_ROWS)), torch.nn.functional.linear(x, w))
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
    from parrot.engine.kernels import kernels_if_built

    ops = kernels_if_built("vnni_linear", instead="using oneDNN for decode matmuls")
    if ops is None:
        return []
    have = set(ops.vnni_backends())
    return [VnniKernel(ops, b) for b in VNNI_BACKENDS if b in have]


@functools.cache
def vnni_kernel(backend: str | None = None) -> VnniKernel | None:
    """The native decode GEMM on ``backend`` ("amx" / "avx512_bf16"; None = the fastest on this machine), or None
    where it does not run (checked once per backend)."""
    kernels = [k for k in vnni_kernels() if backend is None or k.backend == backend]
    return kernels[0] if kernels else None


class PackedBf16Weight(LinearWeight):
    """A bf16 weight pre-packed once for oneDNN (for PREFILL_PACK_ROWS-row activations; no dense copy is kept),
    every row count: the dense bf16 form where the native VNNI kernel does not run."""

    def __init__(self, dense: Tensor) -> None:
        super().__init__(dense.shape[0], dense.shape[1], dense.dtype, "none")
        self.packed = pack_weight(dense, PREFILL_PACK_ROWS)

    def forward(self, x: Tensor, precise: bool = True) -> Tensor:
        return packed_linear(x, self.packed)

    def native_call(self, rows: int) -> NativeCall | None:
        return None

    def dense(self) -> Tensor:
        return self.packed.to_dense()

    def decode_bytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize


class VnniWeight(LinearWeight):
    """A bf16 weight in the native VNNI GEMM's layout (kernels/vnni_gemm.cpp, AMX or AVX512-BF16), every row count:
    the one dense bf16 form on those CPUs. The weight must have both dims multiples of 32
    (:meth:`VnniKernel.packable`)."""

    def __init__(self, dense: Tensor, kernel: VnniKernel) -> None:
        super().__init__(dense.shape[0], dense.shape[1], dense.dtype, "none")
        self.kernel = kernel
        self.packed = kernel.pack(dense)

    def forward(self, x: Tensor, precise: bool = True) -> Tensor:
        return self.kernel.linear(x, self.packed)

    def native_call(self, rows: int) -> NativeCall | None:
        return NativeCall(self.packed)

    def dense(self) -> Tensor:
        n, k = self.out_features, self.in_features
        # [N/32, K/32, 2, 16, 16, 2] -> [N, K]
        # (vnni_block.h: P[n][kb][j][r][c][i] = W[32 n + 16 j + c][32 kb + 2 r + i])
        return self.packed.permute(0, 2, 4, 1, 3, 5).reshape(n, k)

    def decode_bytes(self) -> int:
        return self.packed.nbytes

    def describe(self) -> str:
        return f"VnniWeight[{self.kernel.backend}]"
