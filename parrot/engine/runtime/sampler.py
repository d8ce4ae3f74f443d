"""Token sampling for a batch of GENERATE ops (torch), and the logprobs reported with the tokens.

Greedy rows take one batched argmax. Sampled rows share batched temperature / top-k / top-p masking and then
draw with their own ``torch.Generator`` (seeded per request), so a seeded request gives the same tokens
whatever else is in the batch. Logit bias, bad words, penalties and min_tokens are applied per row before either
path; ``min_p`` (after temperature, before top-k / top-p) only matters to sampled rows.

Logprobs convention (``SamplingParams.logprobs``): ``log_softmax`` in fp32 of the logits the sampler chose from
*after* the logit bias, the bad-words ban, the repetition / presence / frequency penalties and the min_tokens
ban of EOS and stop tokens, *before* temperature, min_p, top-k and top-p. So they describe the model's (penalized)
distribution, not the truncated one a sampled token was drawn from: a greedy token is always the first of the
top, a sampled one need not be in it.
Only rows that ask pay for them. Prompt logprobs (the runner's) are the same ``log_softmax`` of raw logits.

Constrained rows (``op.guide``, parrot.engine.runtime.guided) get their grammar's mask first, in one batched fill for all
of them: tokens the grammar forbids are -inf before anything else, so logprobs describe the constrained
distribution. The min_tokens ban yields to the grammar when the grammar allows nothing but the end.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from parrot.common.sampling import SamplingParams
from parrot.engine.runtime.context import Op, RawLogprobs
from parrot.engine.runtime.guided import Guide


_ARGMAX_CHUNK = 1024
_LOGPROB_FLOOR = torch.finfo(torch.float32).min  # stands for -inf (a banned token), which JSON cannot carry


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[RawLogprobs]:
    """Per row of ``logits`` ([N, vocab]): fp32 ``log_softmax``, the logprob of ``token_ids[i]`` and the ``ks[i]``
    most likely tokens, most likely first. One batched log_softmax / gather / topk for all rows."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    chosen = logp.gather(1, ids.unsqueeze(1)).squeeze(1).clamp_(min=_LOGPROB_FLOOR).tolist()
    kmax = min(max(ks, default=0), logp.shape[1])
    if kmax:
        vals, idx = logp.topk(kmax, dim=-1)  # sorted, descending
        top_vals, top_ids = vals.clamp_(min=_LOGPROB_FLOOR).tolist(), idx.tolist()
    out = []
    for i, (t, k) in enumerate(zip(token_ids, ks)):
        n = min(k, kmax)
        out.append(RawLogprobs(int(t), chosen[i], k, tuple(top_ids[i][:n]) if n else (),
                               tuple(top_vals[i][:n]) if n else ()))
    return out


def bad_word_tokens(words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens ``words`` (token sequences) ban after ``output_ids`` (vLLM's bad words): a sequence's last token
    where the output ends with the rest of the sequence (a one-token sequence: always)."""
    banned = []
    for seq in words:
        head = len(seq) - 1
        if head == 0 or (len(output_ids) >= head and tuple(output_ids[len(output_ids) - head:]) == tuple(seq[:head])):
            banned.append(seq[-1])
    return banned


class MaskFiller:
    """Fills the token bitmasks of a batch of guides in one llguidance call (its thread pool). Calls the executor
    directly: ``llguidance.torch`` would import torch.compile machinery (seconds) for a helper we do not use."""

    def __init__(self) -> None:
        self._executor = None

    def fill(self, guides: Sequence[Guide]) -> torch.Tensor:
        """int32 [len(guides), words]: row i = the tokens guides[i] allows next (layout in parrot.engine.runtime.guided)."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        words = -(-max(g.vocab_size for g in guides) // 32)
        bitmask = torch.zeros((len(guides), words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(guides)], bitmask.data_ptr(),
                                               words * 4, len(guides))
        return bitmask


# byte value -> its 8 bits as additive logit masks (0 allowed, -inf not), bit 0 first: a mask row's bytes (the
# int32 words read little-endian) index this table, so one embedding lookup unpacks a whole batch of masks
_BYTE_BITS = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def mask_bias(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [rows, vocab]: 0 where a row's bitmask allows the token, -inf elsewhere (and past the mask)."""
    rows, words = bitmask.shape
    assert bitmask.dtype == torch.int32 and sys.byteorder == "little"
    bias = F.embedding(bitmask.contiguous().view(torch.uint8).long(), _BYTE_BITS).reshape(rows, words * 32)
    if words * 32 >= vocab:
        return bias[:, :vocab]
    return torch.cat([bias, bias.new_full((rows, vocab - words * 32), float("-inf"))], dim=1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: every token a row's mask does not allow becomes -inf in that row of ``logits`` [rows, vocab]
    (an added bias: ~1 ms for 16 x 49k on one core, vs ~7 ms unpacking bits with shifts)."""
    logits.add_(mask_bias(bitmask, logits.shape[1]).to(logits.dtype))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for 2-D ``x`` (first index of the row maximum), in two cheap steps: torch's CPU argmax
    runs a scalar loop (~15 ms for 64 x 49152 on one core) while ``amax`` is vectorized (~0.8 ms). So: the
    maximum of every chunk of 1024 columns (amax), the first chunk holding the row maximum (argmax over a few
    dozen values), then the first maximum inside that chunk (argmax over 1024 values)."""
    rows, vocab = x.shape
    n = vocab // _ARGMAX_CHUNK
    if n < 2:
        return x.argmax(dim=-1)
    maxima = x[:, : n * _ARGMAX_CHUNK].reshape(rows, n, _ARGMAX_CHUNK).amax(dim=-1)
    if vocab > n * _ARGMAX_CHUNK:
        maxima = torch.cat([maxima, x[:, n * _ARGMAX_CHUNK :].amax(dim=-1, keepdim=True)], dim=1)
    chunk = maxima.argmax(dim=-1, keepdim=True)  # [rows, 1]
    # columns of the winning chunk; the last chunk may be short: its overhang repeats the last column, which
    # cannot come before the true first maximum
    cols = (chunk * _ARGMAX_CHUNK + torch.arange(_ARGMAX_CHUNK, device=x.device)).clamp_(max=vocab - 1)
    return cols.gather(1, x.gather(1, cols).argmax(dim=-1, keepdim=True)).squeeze(1)


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], base_seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.base_seed = base_seed
        self._counter = 0
        self._masks = MaskFiller()

    def _generator(self, op: Op, device: torch.device) -> torch.Generator:
        if op.generator is None:
            sp = op.sampling
            assert sp is not None
            seed = sp.seed if sp.seed is not None else self.base_seed * 1_000_003 + op.seq_no
            g = torch.Generator(device=device)
            g.manual_seed(seed)
            op.generator = g
        return op.generator

    def _adjust_row(self, logits: torch.Tensor, op: Op) -> None:
        """In-place logit bias, bad words, penalties and min_tokens suppression on one row of logits (float32)."""
        sp = op.sampling
        assert sp is not None
        vocab = logits.shape[0]
        if sp.logit_bias:  # ids were checked against the vocabulary by the manager; others are ignored here
            pairs = [(t, b) for t, b in sp.logit_bias if t < vocab]
            if pairs:
                ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=logits.device)
                logits.index_add_(0, ids, torch.tensor([b for _, b in pairs], dtype=logits.dtype,
                                                       device=logits.device))
        if sp.bad_words_ids:
            banned_words = bad_word_tokens(sp.bad_words_ids, op.output_ids)
            banned_words = [t for t in banned_words if t < vocab]
            if banned_words:
                kept = logits[banned_words].clone()
                logits[banned_words] = float("-inf")
                if not bool(torch.isfinite(logits).any()):
                    logits[banned_words] = kept  # a grammar allowing nothing else wins over bad words
        if sp.needs_penalties:
            if sp.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(op.ctx.tokens[-4096:])), dtype=torch.long, device=logits.device)
                vals = logits.index_select(0, seen)
                vals = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
                logits.index_copy_(0, seen, vals)
            if op.output_ids and (sp.presence_penalty or sp.frequency_penalty):
                ids, counts = torch.tensor(op.output_ids, dtype=torch.long, device=logits.device).unique(
                    return_counts=True
                )
                pen = sp.presence_penalty + sp.frequency_penalty * counts.to(logits.dtype)
                logits.index_add_(0, ids, -pen)
        if len(op.output_ids) < sp.min_tokens:  # as vLLM: EOS and stop tokens cannot end it early
            banned = list(set(sp.stop_token_ids) | set(self.eos_token_ids))
            if banned:
                kept = logits[banned].clone() if op.guide is not None else None
                logits[banned] = float("-inf")
                if kept is not None and not bool(torch.isfinite(logits).any()):
                    logits[banned] = kept  # the grammar allows only the end: it wins over min_tokens

    def sample(self, logits: torch.Tensor, ops: Sequence[Op]) -> list[int]:
        """logits: float32 [N, vocab], one row per op (penalties and the min_tokens ban are applied in place: pass
        the same tensor to :meth:`logprobs`). Returns one token id per op."""
        self._apply_guides(logits, ops)
        for i, op in enumerate(ops):
            sp = op.sampling
            assert sp is not None
            if sp.shapes_logits or len(op.output_ids) < sp.min_tokens:
                self._adjust_row(logits[i], op)
        out = [0] * len(ops)
        greedy = [i for i, op in enumerate(ops) if op.sampling.greedy]  # type: ignore[union-attr]
        if greedy:
            if len(greedy) == len(ops):  # the common all-greedy batch: no copy of the [N, vocab] logits
                rows = logits
            else:
                rows = logits.index_select(0, torch.tensor(greedy, dtype=torch.long, device=logits.device))
            ids = argmax_rows(rows).tolist()
            for i, t in zip(greedy, ids):
                out[i] = t
        sampled = [i for i, op in enumerate(ops) if not op.sampling.greedy]  # type: ignore[union-attr]
        if sampled:
            params = [ops[i].sampling for i in sampled]
            rows = logits.index_select(0, torch.tensor(sampled, dtype=torch.long, device=logits.device))
            probs = self._probs(rows, params)  # type: ignore[arg-type]
            for j, i in enumerate(sampled):
                g = self._generator(ops[i], logits.device)
                out[i] = int(torch.multinomial(probs[j], 1, generator=g).item())
        return out

    def _apply_guides(self, logits: torch.Tensor, ops: Sequence[Op]) -> None:
        """Mask every constrained row by its grammar (one batched mask fill, in place)."""
        guided = [i for i, op in enumerate(ops) if op.guide is not None]
        if not guided:
            return
        bitmask = self._masks.fill([ops[i].guide for i in guided])
        if len(guided) == len(ops):
            apply_bitmask(logits, bitmask)
            return
        idx = torch.tensor(guided, dtype=torch.long, device=logits.device)
        rows = logits.index_select(0, idx)
        apply_bitmask(rows, bitmask)
        logits.index_copy_(0, idx, rows)

    @staticmethod
    def logprobs(logits: torch.Tensor, ops: Sequence[Op], token_ids: Sequence[int]) -> list[RawLogprobs | None]:
        """The logprobs of ``token_ids`` (what :meth:`sample` returned) for the rows whose sampling asks for them
        (None for the others, which cost nothing), from the logits :meth:`sample` adjusted (see the module)."""
        ks = [op.sampling.logprobs for op in ops]  # type: ignore[union-attr]
        rows = [i for i, k in enumerate(ks) if k is not None]
        out: list[RawLogprobs | None] = [None] * len(ops)
        if not rows:
            return out
        sel = logits if len(rows) == len(ops) else logits.index_select(
            0, torch.tensor(rows, dtype=torch.long, device=logits.device))
        lps = token_logprobs(sel, [token_ids[i] for i in rows], [ks[i] for i in rows])  # type: ignore[misc]
        for i, lp in zip(rows, lps):
            out[i] = lp
        return out

    @staticmethod
    def _probs(rows: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=rows.dtype, device=rows.device)
        rows = rows / temps.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):  # vLLM: drop tokens below min_p x the top token's probability
            min_ps = torch.tensor([p.min_p for p in params], dtype=rows.dtype, device=rows.device)
            probs = rows.softmax(dim=-1)
            low = probs < probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(1)
            rows = rows.masked_fill(low, float("-inf"))
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
            sorted_logits, sorted_idx = rows.sort(dim=-1, descending=True)
            vocab = rows.shape[1]
            ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=rows.device)
            ranks = torch.arange(vocab, device=rows.device).unsqueeze(0)
            remove = ranks >= ks.unsqueeze(1)
            top_ps = torch.tensor([p.top_p for p in params], dtype=rows.dtype, device=rows.device)
            sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            cum = sorted_probs.cumsum(dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the token crossing the threshold is kept)
            remove |= (cum - sorted_probs) >= top_ps.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
            rows = torch.full_like(rows, float("-inf")).scatter(1, sorted_idx, sorted_logits)
        return rows.softmax(dim=-1)
