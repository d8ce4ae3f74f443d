"""Paged attention over the block pool, with shared-prefix decode attention (torch). One instance per iteration.

KV layout, per layer (``block_size`` = bs, ``n_kv`` heads of ``head_dim``):

    k_cache[num_blocks, bs, n_kv, head_dim]      v_cache alike
    slot of token t of a context = block_table[t // bs] * bs + t % bs

The flat batch of one iteration is

    | decode group 0 (plain) | decode group 1 (share prefix A) | group 2 (prefix B) | prefill 0 | prefill 1 | ...

Every layer first writes the new K/V of all T tokens into their slots (one index_copy), then:
  * a plain decode group: the native paged-decode kernel (parrot/engine/kernels) reads each sequence's blocks
    where they lie; without it, gather each sequence's blocks (padded to the longest, masked) and run one
    batched SDPA with grouped-query heads;
  * a shared-prefix decode group (sequences whose block tables start with the same P full blocks, e.g. forks
    of one context): the prefix K/V is read ONCE and all m queries of the group attend to it in one matmul
    (as m*G query rows per KV head), giving partial outputs and log-sum-exp; each sequence then attends to its
    own suffix blocks; the two parts merge exactly:

        lse = logaddexp(lse_prefix, lse_suffix)
        out = out_prefix * exp(lse_prefix - lse) + out_suffix * exp(lse_suffix - lse)

    Several groups (different prefixes) per batch are fine;
  * prefill chunks: a chunk that starts at 0 attends over its own fresh K/V (causal): the native
    ``causal_prefill`` op (kernels/prefill_attention.cpp: bf16 where the CPU has AVX512-BF16, fp32 where it has
    AVX2), else one SDPA;
    a later chunk gathers its context's blocks and runs SDPA with an explicit causal mask offset by its start.

Per layer (:class:`LayerAttention`, from the model family) attention may also be windowed (a query at position
p sees keys p - window < k <= p) and soft-capped (scores = cap * tanh(scores / cap)). A window changes nothing
while a sequence is no longer than it, so the paths above run unchanged until then; past it, and on every
soft-capped layer, a group or chunk takes the masked path: gather each row's blocks (prefix + own), build the
causal-and-window mask, and attend with SDPA (window only) or the explicit softmax (soft-capping; fp32 softmax).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float,
            cap: float | None) -> torch.Tensor:
    """q [B, H, n, hd], k/v [B, KV, L, hd], ``keep`` bool broadcastable to [B, H, n, L] -> [B, H, n, hd]. With a
    soft-cap: the explicit softmax (scores in q's dtype, softmax in fp32, as transformers' eager attention)."""
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / cap) * cap
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention applies beside causality (None: nothing): a sliding ``window`` (the last
    ``window`` tokens, the query's own included) and score soft-capping."""

    window: int | None = None
    softcap: float | None = None


@dataclass
class BlockRef:
    """Which blocks to read, row-major [B, n] (B = 1 for one sequence). When the ids are one consecutive run
    (the common case for a single sequence: the pool hands out blocks in order) ``first`` is set and the read
    is a view of the cache instead of a gather."""

    ids: torch.Tensor  # long [B * n]
    batch: int
    first: int | None = None

    def read(self, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cache [num_blocks, bs, n_kv, hd] -> [B, n * bs, n_kv, hd] in ``dtype`` (the compute dtype; the cache
        may store another)."""
        nb, bs, n_kv, hd = cache.shape
        if self.first is not None:
            out = cache[self.first : self.first + self.ids.numel()].view(1, -1, n_kv, hd)
        else:
            out = cache.view(nb, -1).index_select(0, self.ids).view(self.batch, -1, n_kv, hd)
        return out.to(dtype)

    @staticmethod
    def of(rows: list[list[int]], device: torch.device) -> "BlockRef":
        flat = [b for r in rows for b in r]
        first = None
        if len(rows) == 1 and flat == list(range(flat[0], flat[0] + len(flat))):
            first = flat[0]
        return BlockRef(torch.tensor(flat, dtype=torch.long, device=device), len(rows), first)


@dataclass
class DecodeGroup:
    """Decode rows [row0, row0 + num_rows). ``prefix`` (shared, ``prefix_len`` tokens) is None for a plain
    group. ``table`` holds each row's blocks after the prefix (int32 [m, max_blocks], padded with block 0) and
    ``lens`` each row's token count after the prefix, incl. the new token (int32 [m]); ``suffix_len`` = the
    longest. The native kernel reads exactly that; the torch path gathers the table's blocks and masks the
    padding (``suffix`` / ``suffix_mask``, built on first use)."""

    row0: int
    num_rows: int
    prefix: BlockRef | None
    prefix_len: int
    table: torch.Tensor
    lens: torch.Tensor
    suffix_len: int
    _suffix: BlockRef | None = None
    _mask: torch.Tensor | None = None
    _mask_built: bool = False

    @property
    def suffix(self) -> BlockRef:
        if self._suffix is None:
            self._suffix = BlockRef(self.table.view(-1).long(), self.num_rows)
        return self._suffix

    def suffix_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """None when all rows have ``suffix_len`` tokens, else [m, 1, 1, suffix_len]: bool for a plain group,
        additive in ``dtype`` for a shared-prefix group (the flash kernel with LSE wants it so)."""
        if not self._mask_built:
            self._mask_built = True
            if int(self.lens.min()) != self.suffix_len:
                keep = torch.arange(self.suffix_len, device=self.table.device).unsqueeze(0) < \
                    self.lens.to(self.table.device).unsqueeze(1)
                keep = keep.view(self.num_rows, 1, 1, self.suffix_len)
                if self.prefix is None:
                    self._mask = keep
                else:
                    self._mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(
                        ~keep, float("-inf"))
        return self._mask


@dataclass
class PrefillMeta:
    row0: int  # first row of the chunk in the flat batch
    num_tokens: int
    start: int  # position of the chunk's first token in its context
    blocks: BlockRef | None  # blocks covering [0, start + num_tokens) when start > 0
    mask: torch.Tensor | None  # bool [num_tokens, start + num_tokens] when start > 0


_PLAIN = LayerAttention()


@dataclass(frozen=True)
class PlainDecode:
    """An iteration of decode rows only, all in one plain group for the native paged-decode kernel: what the
    all-layers decode op (kernels/decode_layers.cpp) needs to write each layer's new K/V and attend."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slots: torch.Tensor  # long [T]
    table: torch.Tensor  # int32 [T, max_blocks]
    lens: torch.Tensor  # int32 [T]
    scale: float


class PagedAttention:
    """The model's AttentionBackend for one iteration; reads/writes the runner's KV cache."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: torch.Tensor,
        decode_groups: list[DecodeGroup],
        prefills: list[PrefillMeta],
        scale: float,
        decode_kernel: Callable | None = None,
        prefill_kernel: Callable | None = None,
        layers: list[LayerAttention] | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        self.layers = layers  # per layer window / soft-cap (None: plain causal attention everywhere)
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel  # for the model's dtype (the builder picks it)
        self.slots = slots
        self.decode_groups = decode_groups
        self.prefills = prefills
        self.scale = scale

    def plain_decode(self) -> PlainDecode | None:
        """This iteration as a :class:`PlainDecode` when it is one (no prefill chunk, no shared-prefix group,
        the native kernel present), else None."""
        if self.prefills or len(self.decode_groups) != 1 or self.decode_kernel is None:
            return None
        g = self.decode_groups[0]
        if g.prefix is not None or g.num_rows != self.slots.numel():
            return None
        return PlainDecode(self.kv_caches, self.slots, g.table, g.lens, self.scale)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_idx]
        nb, bs, n_kv, hd = k_cache.shape
        k_cache.view(nb * bs, n_kv, hd).index_copy_(0, self.slots, k.to(k_cache.dtype))
        v_cache.view(nb * bs, n_kv, hd).index_copy_(0, self.slots, v.to(v_cache.dtype))
        n_heads = q.shape[1]
        gqa = n_heads != n_kv
        spec = self.layers[layer_idx] if self.layers is not None else _PLAIN
        window, cap = spec.window, spec.softcap
        outs: list[torch.Tensor] = []
        for g in self.decode_groups:
            qg = q[g.row0 : g.row0 + g.num_rows]
            if cap is not None or (window is not None and g.prefix_len + g.suffix_len > window):
                outs.append(self._masked_decode(g, qg, k_cache, v_cache, window, cap))
            elif g.prefix is None and self.decode_kernel is not None:
                od, _ = self.decode_kernel(qg, k_cache, v_cache, g.table, g.lens, self.scale, False)
                outs.append(od.view(g.num_rows, n_heads * hd))
            elif g.prefix is None:
                kd = g.suffix.read(k_cache, q.dtype)[:, : g.suffix_len].transpose(1, 2)
                vd = g.suffix.read(v_cache, q.dtype)[:, : g.suffix_len].transpose(1, 2)
                od = F.scaled_dot_product_attention(qg.unsqueeze(2), kd, vd, attn_mask=g.suffix_mask(qg.dtype),
                                                    scale=self.scale, enable_gqa=gqa)
                outs.append(od.reshape(g.num_rows, n_heads * hd))
            else:
                outs.append(self._shared_prefix(g, qg, k_cache, v_cache))
        for p in self.prefills:
            rows = slice(p.row0, p.row0 + p.num_tokens)
            if cap is not None or (window is not None and p.start + p.num_tokens > window):
                outs.append(self._masked_prefill(p, q, k, v, k_cache, v_cache, window, cap))
            elif p.start == 0 and self.prefill_kernel is not None:
                outs.append(self.prefill_kernel(q[rows], k[rows], v[rows], self.scale))
            else:
                outs.append(self._sdpa_prefill(p, q, k, v, k_cache, v_cache, gqa))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    def _sdpa_prefill(self, p: PrefillMeta, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, gqa: bool) -> torch.Tensor:
        """A prefill chunk without window or soft-cap in effect, on SDPA."""
        n_heads, hd = q.shape[1], q.shape[2]
        rows = slice(p.row0, p.row0 + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if p.start == 0:
            kp = k[p.row0 : p.row0 + p.num_tokens].transpose(0, 1).unsqueeze(0)
            vp = v[p.row0 : p.row0 + p.num_tokens].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            L = p.start + p.num_tokens
            kp = p.blocks.read(k_cache, q.dtype)[:, :L].transpose(1, 2)
            vp = p.blocks.read(v_cache, q.dtype)[:, :L].transpose(1, 2)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=self.scale, enable_gqa=gqa)
        return op.squeeze(0).transpose(0, 1).reshape(p.num_tokens, n_heads * hd)

    def _masked_decode(self, g: DecodeGroup, qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       window: int | None, cap: float | None) -> torch.Tensor:
        """A decode group on the masked path: each row reads its whole context (prefix blocks, then its own)."""
        m, n_heads, hd = qg.shape
        dev = qg.device
        table = g.table.to(dev).long()
        if g.prefix is not None:
            table = torch.cat([g.prefix.ids.view(1, -1).expand(m, -1), table], 1)
        ref = BlockRef(table.reshape(-1), m)
        L = g.prefix_len + g.suffix_len
        kd = ref.read(k_cache, qg.dtype)[:, :L].transpose(1, 2)
        vd = ref.read(v_cache, qg.dtype)[:, :L].transpose(1, 2)
        total = g.lens.to(dev).long() + g.prefix_len  # each row's context length, its new token included
        key_pos = torch.arange(L, device=dev).unsqueeze(0)
        keep = key_pos < total.unsqueeze(1)
        if window is not None:
            keep &= key_pos >= (total - window).unsqueeze(1)
        out = _attend(qg.unsqueeze(2), kd, vd, keep.view(m, 1, 1, L), self.scale, cap)
        return out.reshape(m, n_heads * hd)

    def _masked_prefill(self, p: PrefillMeta, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None,
                        cap: float | None) -> torch.Tensor:
        """A prefill chunk on the masked path (causal + window mask over its context so far)."""
        rows = slice(p.row0, p.row0 + p.num_tokens)
        n_heads, hd = q.shape[1], q.shape[2]
        L = p.start + p.num_tokens
        qp = q[rows].transpose(0, 1).unsqueeze(0)
        if p.start == 0:
            kp, vp = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
        else:
            kp = p.blocks.read(k_cache, q.dtype)[:, :L].transpose(1, 2)
            vp = p.blocks.read(v_cache, q.dtype)[:, :L].transpose(1, 2)
        q_pos = torch.arange(p.start, L, device=q.device).unsqueeze(1)
        key_pos = torch.arange(L, device=q.device).unsqueeze(0)
        keep = key_pos <= q_pos
        if window is not None:
            keep &= key_pos > q_pos - window
        out = _attend(qp, kp, vp, keep, self.scale, cap)
        return out.squeeze(0).transpose(0, 1).reshape(p.num_tokens, n_heads * hd)

    def _shared_prefix(self, g: DecodeGroup, qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        m, n_heads, hd = qg.shape
        n_kv = k_cache.shape[2]
        G = n_heads // n_kv
        q4 = qg.view(m, n_kv, G, hd)
        # prefix: one [n_kv, m*G, P] problem -- the prefix K/V is read once for the whole group
        qp = q4.permute(1, 0, 2, 3).reshape(1, n_kv, m * G, hd)
        kp = g.prefix.read(k_cache, qg.dtype)[:, : g.prefix_len].transpose(1, 2)
        vp = g.prefix.read(v_cache, qg.dtype)[:, : g.prefix_len].transpose(1, 2)
        op, lp = _flash_with_lse(qp, kp, vp, 0.0, False, scale=self.scale)
        op = op.view(n_kv, m, G, hd).permute(1, 0, 2, 3)  # [m, n_kv, G, hd]
        lp = lp.view(n_kv, m, G).permute(1, 0, 2)  # [m, n_kv, G]
        # suffix: each row against its own blocks (G query rows per KV head, padding masked)
        if self.decode_kernel is not None:
            os_, ls = self.decode_kernel(qg, k_cache, v_cache, g.table, g.lens, self.scale, True)
            os_, ls = os_.view(m, n_kv, G, hd), ls.view(m, n_kv, G)
        else:
            ks = g.suffix.read(k_cache, qg.dtype)[:, : g.suffix_len].transpose(1, 2)
            vs = g.suffix.read(v_cache, qg.dtype)[:, : g.suffix_len].transpose(1, 2)
            os_, ls = _flash_with_lse(q4, ks, vs, 0.0, False, attn_mask=g.suffix_mask(qg.dtype), scale=self.scale)
        lse = torch.logaddexp(lp, ls)
        out = op.float() * (lp - lse).exp_().unsqueeze(-1) + os_.float() * (ls - lse).exp_().unsqueeze(-1)
        return out.to(qg.dtype).reshape(m, n_heads * hd)
