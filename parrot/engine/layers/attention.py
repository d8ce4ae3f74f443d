"""Paged attention over the block pool (torch). One :class:`PagedAttention` per iteration.

KV layout, per layer (``block_size`` = bs, ``n_kv`` heads of ``head_dim``):

    k_cache[num_blocks, bs, n_kv, head_dim]      v_cache alike
    slot of token t of a context = block_table[t // bs] * bs + t % bs

The flat batch of one iteration is ``[decode tokens (1 per seq) | prefill chunk 0 | prefill chunk 1 | ...]``.
Every layer first writes the new K/V of all T tokens into their slots (one index_copy), then:
  * decode rows: all sequences at once -- gather each one's blocks (padded to the longest, masked), and one
    batched SDPA with grouped-query heads;
  * prefill chunks: one SDPA each; a chunk that starts at 0 attends over its own fresh K/V (causal), a later
    chunk gathers its context's blocks and uses an explicit causal mask offset by the chunk start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillMeta:
    row0: int  # first row of the chunk in the flat batch
    num_tokens: int
    start: int  # position of the chunk's first token in its context
    blocks: "BlockRef | None"  # blocks covering [0, start + num_tokens) when start > 0
    mask: torch.Tensor | None  # bool [num_tokens, start + num_tokens] when start > 0


@dataclass
class BlockRef:
    """Which blocks to read, row-major [B, n] (B = 1 for one sequence). When the ids are one consecutive run
    (the common case for a single sequence: the pool hands out blocks in order) ``first`` is set and the read
    is a view of the cache instead of a gather."""

    ids: torch.Tensor  # long [B * n]
    batch: int
    first: int | None = None

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """cache [num_blocks, bs, n_kv, hd] -> [B, n * bs, n_kv, hd]."""
        nb, bs, n_kv, hd = cache.shape
        if self.first is not None:
            return cache[self.first : self.first + self.ids.numel()].view(1, -1, n_kv, hd)
        return cache.view(nb, -1).index_select(0, self.ids).view(self.batch, -1, n_kv, hd)

    @staticmethod
    def of(rows: list[list[int]], device: torch.device) -> "BlockRef":
        flat = [b for r in rows for b in r]
        first = None
        if len(rows) == 1 and flat == list(range(flat[0], flat[0] + len(flat))):
            first = flat[0]
        return BlockRef(torch.tensor(flat, dtype=torch.long, device=device), len(rows), first)


@dataclass
class DecodeMeta:
    num_seqs: int
    blocks: BlockRef  # [B, max_blocks] (padded with block 0)
    max_len: int  # longest context among the decode rows (tokens)
    mask: torch.Tensor | None  # bool [B, 1, 1, max_len], True = attend; None when all have max_len


class PagedAttention:
    """The model's AttentionBackend for one iteration; reads/writes the runner's KV cache."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: torch.Tensor,
        decode: DecodeMeta | None,
        prefills: list[PrefillMeta],
        scale: float,
    ) -> None:
        self.kv_caches = kv_caches
        self.slots = slots
        self.decode = decode
        self.prefills = prefills
        self.scale = scale

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_idx]
        nb, bs, n_kv, hd = k_cache.shape
        k_cache.view(nb * bs, n_kv, hd).index_copy_(0, self.slots, k)
        v_cache.view(nb * bs, n_kv, hd).index_copy_(0, self.slots, v)
        n_heads = q.shape[1]
        gqa = n_heads != n_kv
        outs: list[torch.Tensor] = []
        d = self.decode
        if d is not None:
            B = d.num_seqs
            qd = q[:B].unsqueeze(2)  # [B, H, 1, hd]
            kd = d.blocks.read(k_cache)[:, : d.max_len].transpose(1, 2)
            vd = d.blocks.read(v_cache)[:, : d.max_len].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=self.scale, enable_gqa=gqa)
            outs.append(od.reshape(B, n_heads * hd))
        for p in self.prefills:
            qp = q[p.row0 : p.row0 + p.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
            if p.start == 0:
                kp = k[p.row0 : p.row0 + p.num_tokens].transpose(0, 1).unsqueeze(0)
                vp = v[p.row0 : p.row0 + p.num_tokens].transpose(0, 1).unsqueeze(0)
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=gqa)
            else:
                L = p.start + p.num_tokens
                kp = p.blocks.read(k_cache)[:, :L].transpose(1, 2)
                vp = p.blocks.read(v_cache)[:, :L].transpose(1, 2)
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=self.scale, enable_gqa=gqa)
            outs.append(op.squeeze(0).transpose(0, 1).reshape(p.num_tokens, n_heads * hd))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
