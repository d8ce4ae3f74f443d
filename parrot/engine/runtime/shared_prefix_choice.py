"""Whether shared-prefix decode attention pays on this machine (``PARROT_ENGINE_SHARED_PREFIX_ATTENTION=auto``).

The shared-prefix path (paper §7; :meth:`~parrot.engine.layers.attention.PagedAttention._shared_prefix`) reads a
prefix shared by a group of decode rows once per layer instead of once per row, then merges it with each row's own
suffix by log-sum-exp. It saves memory traffic. It pays where decode attention is bound by that traffic (GPUs;
the AVX2 machine at 32 sharers, ``docs/results/README.md``, prefix sharing). Where attention is bound by
compute, it only costs: the same FLOPs run in extra calls, and an iteration with a shared group leaves the native
all-layers decode op (``kernels/decode_layers.cpp``) for the per-layer path. With one thread per engine on a
CPU whose native kernel is compute-bound (avx512_bf16), attending a group row by row can beat the shared path,
so which one wins depends on the machine and is measured, not assumed.

So ``auto`` measures, once when the engine is built, one layer of decode attention for a representative group
(:data:`ROWS` rows sharing :data:`PREFIX` tokens, :data:`SUFFIX` tokens of their own; the model's head shapes,
compute and KV dtypes, kernel and thread count) through the layer's own two code paths, and turns the shared
path on only if it is at least :data:`MARGIN` faster there. That is a necessary condition: the lost all-layers
decode op only adds to the shared path's cost. ``on`` / ``off`` skip the measurement.

Layout of the probe's KV pool (block ids; each row's table lists the prefix blocks, then its own)::

    [ prefix: PREFIX / bs blocks | row 0: SUFFIX / bs + 1 blocks | row 1 | ... | row ROWS-1 ]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parrot.engine.layers.attention import BlockRef, DecodeGroup, PagedAttention

log = logging.getLogger(__name__)

ROWS = 16  # decode rows in the probe's group
PREFIX = 1024  # tokens they share
SUFFIX = 64  # tokens of each row's own, its new token included
MARGIN = 0.9  # the shared path must take at most this share of the plain path's time
REPEATS = 5  # timed runs of each path (after one warm-up); the fastest counts


@dataclass(frozen=True)
class Probe:
    """The two timings (seconds per layer call) and the decision."""

    plain_s: float
    shared_s: float

    @property
    def shared_pays(self) -> bool:
        return self.shared_s <= MARGIN * self.plain_s

    def describe(self) -> str:
        return (f"{ROWS} rows sharing {PREFIX} tokens: plain {self.plain_s * 1e6:.0f} us, shared "
                f"{self.shared_s * 1e6:.0f} us per layer -> shared-prefix attention "
                f"{'on' if self.shared_pays else 'off'}")


@dataclass(frozen=True)
class Problem:
    """The probe's inputs: one layer's KV pool, the new tokens' slots and q / k / v, and the same rows described
    as one plain group (whole tables) and as one shared-prefix group (prefix + own blocks)."""

    caches: list[tuple[torch.Tensor, torch.Tensor]]
    slots: torch.Tensor
    plain: DecodeGroup
    shared: DecodeGroup
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float

    def attend(self, group: DecodeGroup, decode_kernel: Callable | None) -> torch.Tensor:
        """One layer of decode attention for the rows described by ``group``."""
        attn = PagedAttention(self.caches, self.slots, [group], [], self.scale, decode_kernel=decode_kernel)
        with torch.inference_mode():
            return attn(0, self.q, self.k, self.v)


def problem(*, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
            block_size: int, scale: float, seed: int = 0) -> Problem:
    """The probe's group on random q / K / V (see the module docstring for the pool's layout)."""
    gen = torch.Generator().manual_seed(seed)
    bs = block_size
    prefix_blocks = -(-PREFIX // bs)
    own_blocks = -(-SUFFIX // bs)
    shape = (prefix_blocks + ROWS * own_blocks, bs, num_kv_heads, head_dim)
    caches = [(torch.randn(shape, generator=gen).to(kv_dtype), torch.randn(shape, generator=gen).to(kv_dtype))]
    prefix = list(range(prefix_blocks))
    own = [list(range(prefix_blocks + r * own_blocks, prefix_blocks + (r + 1) * own_blocks)) for r in range(ROWS)]
    length = prefix_blocks * bs + SUFFIX
    # each row's new token goes to its last position (the slot the runner would have given it)
    slots = torch.tensor([own[r][(SUFFIX - 1) // bs] * bs + (SUFFIX - 1) % bs for r in range(ROWS)],
                         dtype=torch.long)
    plain = DecodeGroup(0, ROWS, None, 0, torch.tensor([prefix + o for o in own], dtype=torch.int32),
                        torch.full((ROWS,), length, dtype=torch.int32), length)
    shared = DecodeGroup(0, ROWS, BlockRef.of([prefix], torch.device("cpu")), prefix_blocks * bs,
                         torch.tensor(own, dtype=torch.int32), torch.full((ROWS,), SUFFIX, dtype=torch.int32),
                         SUFFIX)
    q = torch.randn(ROWS, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(ROWS, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(ROWS, num_kv_heads, head_dim, generator=gen).to(dtype)
    return Problem(caches, slots, plain, shared, q, k, v, scale)


def probe(*, decode_kernel: Callable | None, **shapes) -> Probe:
    """Time one layer of decode attention for the probe's group on both paths (``shapes``: :func:`problem`'s)."""
    prob = problem(**shapes)

    def timed(group: DecodeGroup) -> float:
        best = float("inf")
        for i in range(REPEATS + 1):
            t = time.perf_counter()
            prob.attend(group, decode_kernel)
            if i:  # the first run warms up
                best = min(best, time.perf_counter() - t)
        return best

    return Probe(timed(prob.plain), timed(prob.shared))


def choose(setting: str, name: str, **shapes) -> bool:
    """The runner's ``shared_prefix_attention`` for an engine's setting (auto / on / off)."""
    if setting == "on":
        return True
    if setting == "off":
        return False
    result = probe(**shapes)
    log.info("engine %s: %s", name, result.describe())
    return result.shared_pays
