"""ModelRunner: turns a BatchPlan into one model forward over the paged KV cache, then samples (torch).

Flat batch layout of one iteration (rows of input_ids / positions / slots):

    | decode rows: 1 token per seq (B) | prefill chunk 0 (n0 tokens) | prefill chunk 1 | ... |

Chunks with 0 tokens ("sample only": a Generate on a context whose last hidden state is cached) take no
row; their hidden state comes from the context.

Logits: by default only for the rows that sample (the last row of a chunk reaching its context's end, and the
sample-only chunks). A Fill asking for prompt logprobs also gets the logits of every row of its chunks whose next
token is a filled token with unknown logprob (parrot.engine.kv_cache.prompt_logprobs.needs_logits), computed
``_LOGIT_ROWS`` rows at a time so a long chunk never holds [tokens, vocab] logits at once.

Swap space (tool pauses, :mod:`parrot.engine.kv_cache.host_store`): host tensors shaped like the pool's, one
slot per block, per layer. Before the forward the runner performs the plan's copies (``BatchPlan.copies``): every
swap-out (pool block -> host slot), then every swap-in (host slot -> pool block), and keeps the measured copy
rate (bytes/s, an EMA) for the scheduler's swap cost.
"""

from __future__ import annotations

from collections.abc import Callable

import time

import torch

from parrot.engine.runtime.context import Context, Op, RawLogprobs
from parrot.engine.runtime.core import StepOutput
from parrot.engine.runtime.decode_groups import min_shared_blocks, shared_prefix_groups
from parrot.engine.kv_cache.manager import KVCopies
from parrot.engine.kv_cache.prompt_logprobs import needs_logits, wants_prompt_logprobs
from parrot.engine.layers.attention import BlockRef, DecodeGroup, PagedAttention, PrefillMeta
from parrot.engine.runtime.sampler import Sampler, token_logprobs
from parrot.engine.scheduler.scheduler import BatchPlan, Chunk

_LOGIT_ROWS = 256  # prompt-logprob rows per lm_head call
# host<->pool copy rate before one is measured: PCIe 4.0 x16 effective for a GPU, a memcpy of DRAM for a CPU
DEFAULT_COPY_BYTES_PER_S = {"cuda": 25e9, "cpu": 5e9}
_RATE_EMA = 0.2  # weight of the newest copy in the measured rate


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, sampler: Sampler, *,
                 shared_prefix_attention: bool = True, min_shared_tokens: int = 32,
                 decode_kernel: Callable | None = None, prefill_kernel: Callable | None = None,
                 kv_dtype: torch.dtype | None = None, host_blocks: int = 0) -> None:
        cfg = model.config
        self.model = model
        self.sampler = sampler
        self.block_size = block_size
        self.device = model.device
        self.dtype = model.dtype
        self.kv_dtype = kv_dtype or model.dtype  # KV storage; attention computes in the model's dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * \
            torch.tensor([], dtype=self.kv_dtype).element_size()
        # swap space: host tensors of ``host_blocks`` slots per layer (pinned for a GPU: async-capable DMA);
        # allocated on the first swap-out (untouched pages cost nothing until then)
        self.host_blocks = host_blocks
        self._host_shape = (host_blocks,) + shape[1:]
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.default_copy_bytes_per_s = DEFAULT_COPY_BYTES_PER_S.get(torch.device(self.device).type, 5e9)
        self.copy_bytes_per_s: float | None = None  # measured (EMA); None before any copy
        self.num_copied_blocks = 0
        self.scale = cfg.attention_scale
        # per layer sliding window / soft-cap of the model's family (models without the attribute: plain causal)
        self.attention_layers = getattr(model, "attention_layers", None)
        self.shared_prefix_attention = shared_prefix_attention
        self.min_shared_blocks = min_shared_blocks(min_shared_tokens, block_size)
        self.num_shared_prefix_rows = 0  # decode rows served by the shared-prefix path (a metric)
        # the native paged-decode and causal-prefill ops (parrot.engine.kernels) or None for the pure-torch path
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, elem_size: int) -> int:
        return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * elem_size

    def _slots(self, ctx: Context, start: int, n: int) -> list[int]:
        bs, table = self.block_size, ctx.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    @torch.inference_mode()
    def copy_blocks(self, copies: KVCopies) -> None:
        """Every swap-out (pool block -> host slot), then every swap-in (host slot -> pool block), all layers."""
        n = len(copies.swap_out) + len(copies.swap_in)
        if not n:
            return
        t0 = time.perf_counter()
        if self.host_caches is None:
            pin = torch.device(self.device).type == "cuda"
            self.host_caches = [(torch.empty(self._host_shape, dtype=self.kv_dtype, pin_memory=pin),
                                 torch.empty(self._host_shape, dtype=self.kv_dtype, pin_memory=pin))
                                for _ in self.kv_caches]
        if copies.swap_out:
            blocks = torch.tensor([b for b, _ in copies.swap_out], dtype=torch.long, device=self.device)
            slots = torch.tensor([s for _, s in copies.swap_out], dtype=torch.long)
            for (k, v), (hk, hv) in zip(self.kv_caches, self.host_caches):
                hk.index_copy_(0, slots, k.index_select(0, blocks).to("cpu"))
                hv.index_copy_(0, slots, v.index_select(0, blocks).to("cpu"))
        if copies.swap_in:
            slots = torch.tensor([s for s, _ in copies.swap_in], dtype=torch.long)
            blocks = torch.tensor([b for _, b in copies.swap_in], dtype=torch.long, device=self.device)
            for (k, v), (hk, hv) in zip(self.kv_caches, self.host_caches):
                k.index_copy_(0, blocks, hk.index_select(0, slots).to(self.device, non_blocking=True))
                v.index_copy_(0, blocks, hv.index_select(0, slots).to(self.device, non_blocking=True))
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.num_copied_blocks += n
        if dt > 0:
            rate = n * self.block_size * self.kv_bytes_per_token / dt
            prev = self.copy_bytes_per_s
            self.copy_bytes_per_s = rate if prev is None else prev + _RATE_EMA * (rate - prev)

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepOutput:
        self.copy_blocks(plan.copies)
        decodes = [c for c in plan.chunks if c.num_tokens == 1]
        prefills = [c for c in plan.chunks if c.num_tokens > 1]
        sample_only = [c for c in plan.chunks if c.num_tokens == 0 and c.sample]
        dev = self.device
        hidden = None
        rows: dict[int, int] = {}  # id(chunk) -> row of its last token in `hidden`
        if decodes or prefills:
            decodes, groups = self._decode_groups(decodes)
            ids: list[int] = []
            pos: list[int] = []
            slots: list[int] = []
            for c in decodes + prefills:
                ctx = c.op.ctx
                ids.extend(ctx.tokens[c.start : c.start + c.num_tokens])
                pos.extend(range(c.start, c.start + c.num_tokens))
                slots.extend(self._slots(ctx, c.start, c.num_tokens))
                rows[id(c)] = len(ids) - 1
            prefill_meta = []
            row = len(decodes)
            for c in prefills:
                prefill_meta.append(self._prefill_meta(c, row))
                row += c.num_tokens
            attn = PagedAttention(
                self.kv_caches, torch.tensor(slots, dtype=torch.long, device=dev), groups, prefill_meta, self.scale,
                self.decode_kernel, self.prefill_kernel, self.attention_layers,
            )
            # a batch that processes prompt tokens takes the precise activation rule of quantized matmuls
            hidden = self.model(
                torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev), attn,
                precise=bool(prefills),
            )
        computed = tuple((c.op.ctx, c.num_tokens) for c in decodes + prefills)
        last_hidden = []
        sample_rows: list[torch.Tensor] = []
        sample_ops: list[Op] = []
        for c in decodes + prefills:
            if c.start + c.num_tokens == len(c.op.ctx.tokens):
                h = hidden[rows[id(c)]].clone()
                last_hidden.append((c.op.ctx, h))
                if c.sample:
                    sample_rows.append(h)
                    sample_ops.append(c.op)
        for c in sample_only:
            sample_rows.append(c.op.ctx.last_hidden)
            sample_ops.append(c.op)
        sampled: tuple[tuple[Op, int], ...] = ()
        token_lps: list[tuple[Op, RawLogprobs]] = []
        if sample_ops:
            logits = self.model.compute_logits(torch.stack(sample_rows), precise=bool(prefills))
            toks = self.sampler.sample(logits, sample_ops)
            sampled = tuple(zip(sample_ops, toks))
            if any(op.sampling.logprobs is not None for op in sample_ops):  # type: ignore[union-attr]
                lps = self.sampler.logprobs(logits, sample_ops, toks)
                token_lps = [(op, lp) for op, lp in zip(sample_ops, lps) if lp is not None]
        prompt_lps = self._prompt_logprobs(hidden, decodes + prefills, rows) if hidden is not None else ()
        return StepOutput(computed, tuple(last_hidden), sampled, tuple(token_lps), prompt_lps)

    def _prompt_logprobs(self, hidden: torch.Tensor, chunks: list[Chunk],
                         rows: dict[int, int]) -> tuple[tuple[Op, int, RawLogprobs], ...]:
        """Logprobs of the filled tokens the rows of prompt-logprob fills predict: row p gives position p + 1."""
        want: list[tuple[Op, int, int]] = []  # (op, position predicted, row in hidden)
        for c in chunks:
            op = c.op
            if not wants_prompt_logprobs(op):
                continue
            last = c.start + c.num_tokens - 1
            want += [(op, p + 1, rows[id(c)] - (last - p)) for p in range(c.start, last + 1) if needs_logits(op, p)]
        out: list[tuple[Op, int, RawLogprobs]] = []
        for i in range(0, len(want), _LOGIT_ROWS):
            part = want[i : i + _LOGIT_ROWS]
            idx = torch.tensor([r for _, _, r in part], dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx))
            lps = token_logprobs(logits, [op.ctx.tokens[pos] for op, pos, _ in part],
                                 [op.prompt_logprobs for op, _, _ in part])  # type: ignore[misc]
            out += [(op, pos, lp) for (op, pos, _), lp in zip(part, lps)]
        return tuple(out)

    def _decode_groups(self, decodes: list[Chunk]) -> tuple[list[Chunk], list[DecodeGroup]]:
        """Order decode rows as [plain | shared group 1 | shared group 2 ...] and describe each group
        (the grouping rule: parrot.engine.runtime.decode_groups)."""
        if not decodes:
            return decodes, []
        if self.shared_prefix_attention and len(decodes) > 1:
            plain, shared = shared_prefix_groups(decodes, self.block_size, self.min_shared_blocks)
        else:
            plain, shared = list(decodes), []
        groups: list[DecodeGroup] = []
        ordered: list[Chunk] = []
        if plain:
            groups.append(self._group(len(ordered), plain, 0))
            ordered.extend(plain)
        for P, members in shared:
            self.num_shared_prefix_rows += len(members)
            groups.append(self._group(len(ordered), members, P))
            ordered.extend(members)
        return ordered, groups

    def _group(self, row0: int, chunks: list[Chunk], P: int) -> DecodeGroup:
        bs = self.block_size
        lens = [c.start + 1 - P * bs for c in chunks]  # suffix tokens incl. the new one
        max_len = max(lens)
        max_blocks = -(-max_len // bs)
        table = []
        for c in chunks:
            t = c.op.ctx.block_table[P : P + max_blocks]
            table.append(list(t) + [0] * (max_blocks - len(t)))
        prefix = BlockRef.of([chunks[0].op.ctx.block_table[:P]], self.device) if P else None
        return DecodeGroup(row0, len(chunks), prefix, P * bs,
                           torch.tensor(table, dtype=torch.int32, device=self.device),
                           torch.tensor(lens, dtype=torch.int32), max_len)

    def _prefill_meta(self, c: Chunk, row0: int) -> PrefillMeta:
        if c.start == 0:
            return PrefillMeta(row0, c.num_tokens, 0, None, None)
        bs = self.block_size
        L = c.start + c.num_tokens
        dev = self.device
        blocks = BlockRef.of([c.op.ctx.block_table[: -(-L // bs)]], dev)
        q_pos = torch.arange(c.start, L, device=dev).unsqueeze(1)
        mask = torch.arange(L, device=dev).unsqueeze(0) <= q_pos
        return PrefillMeta(row0, c.num_tokens, c.start, blocks, mask)
