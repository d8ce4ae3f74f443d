"""Prompt logprobs over the prefix cache: an LRU of computed prompt logprobs keyed by KV block chain hashes, and the
rule that lets a prompt-logprob fill take cached KV only where those logprobs are known. No torch.

A Fill with ``prompt_logprobs=k`` needs, for every filled token at position p >= 1, log P(token_p | tokens_<p):
the logits of the row at p - 1. Cached KV skips a forward over its tokens, so it yields no logits; an eval harness
sending one long context with many continuations would lose the prefix cache. So the logprobs of a computed
prompt are kept too, per KV block: the entry of block j holds the logprobs of block j's own tokens, which depend
on tokens [0, (j + 1) * bs) only -- exactly what block j's chain hash names.

A fill after P = bs inherited tokens (``bs`` tokens a block) of four blocks and a tail; blocks 0-4 in the prefix
cache, logprob entries for blocks 1-3 (block 0 holds no filled token: it needs none)::

    position      0         P
    tokens        |inherited|<------------------ filled ------------------>|
    blocks        [   b0   ][   b1   ][   b2   ][   b3   ][   b4   ][ tail ]
    KV cached        yes       yes       yes       yes       yes      (partial blocks never are)
    lp entry          -        yes       yes       yes        no
    walk          take      take      take      take      stop: b4's logprobs unknown
    taken         ========  ========  ========                      b3 given back: the logits of its last row
    recomputed                                  ########  ########  ####   predict b4's first token
    logits rows                                        ^  ^^^^^^^^  ^^^   (rows whose next token is unknown)

* At the op's start, entries of the blocks it fills are copied into ``op.prompt_lp`` (served when stored with at
  least ``k`` alternatives; an entry keeps the largest ``k`` computed, per position).
* :func:`match_limit` (installed on the KV manager) takes cached blocks while each one's filled positions are
  known, then gives the last taken block back if the first position after it is not known: the context
  recomputes those tokens into a fresh block of its own (rebuilding the hidden state of the block's last token);
  the cached block is never written.
* The runner computes logits only for rows whose next token is a filled position still unknown
  (:func:`needs_logits`): rows of a recomputed block with a known entry only rebuild KV.
* When the fill finishes, its full blocks' logprobs are stored (:meth:`PromptLogprobCache.store`).

At the fill's start the context may be fully computed up to P (a fill appended to a computed context): the
logits at P - 1 are gone, so the core makes that token uncomputed again (KVManager.uncompute_tail) unless the
cache knows position P. A preempted fill keeps what it computed in ``op.prompt_lp``, so after its KV is dropped
the same walk takes back cached blocks it already has logprobs for.
"""

from __future__ import annotations

from collections import OrderedDict

from parrot.engine.runtime.context import Context, Op, OpKind, RawLogprobs

DEFAULT_CAPACITY_BLOCKS = 2048  # entries (KV blocks' worth of positions) kept; LRU beyond


def is_known(op: Op, pos: int) -> bool:
    """Whether ``op`` (a Fill) has the logprob of position ``pos`` or needs none there (not filled by it, or the
    context's first token, which nothing predicts)."""
    i = pos - op.prompt_len
    if pos == 0 or i < 0 or i >= len(op.prompt_lp):
        return True
    return op.prompt_lp[i] is not None


def wants_prompt_logprobs(op: Op | None) -> bool:
    return op is not None and op.kind is OpKind.FILL and op.prompt_logprobs is not None


def needs_logits(op: Op, pos: int) -> bool:
    """Whether the runner must compute the logits of row ``pos`` of ``op``'s context: they predict position
    ``pos + 1``, a filled position whose logprob is still unknown."""
    return wants_prompt_logprobs(op) and not is_known(op, pos + 1)


def match_limit(ctx: Context, first_block: int, run: int, block_size: int) -> int:
    """How many of the ``run`` cached blocks from table index ``first_block`` a context may take (the KV manager's
    match limit): all of them unless its active op is a prompt-logprob fill; then the walk of the module picture."""
    op = ctx.active
    if not wants_prompt_logprobs(op):
        return run
    assert op is not None
    bs = block_size
    m = 0
    while m < run and all(is_known(op, p) for p in range((first_block + m) * bs, (first_block + m + 1) * bs)):
        m += 1
    if m and not is_known(op, (first_block + m) * bs):  # its logits come from the last taken block's last row
        m -= 1
    return m


class PromptLogprobCache:
    """Computed prompt logprobs per full KV block, keyed by the block's chain hash; bounded, LRU.

    An entry is one ``RawLogprobs | None`` per token of the block (None: not computed, e.g. a token a fill
    inherited; the context's first token, which nothing predicts, also stays None)."""

    def __init__(self, block_size: int, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._entries: OrderedDict[int, tuple[RawLogprobs | None, ...]] = OrderedDict()
        self.num_hit_positions = 0  # positions served to ops (a metric)

    def __len__(self) -> int:
        return len(self._entries)

    def serve(self, op: Op) -> int:
        """Copy into ``op.prompt_lp`` the known logprobs (with at least ``op.prompt_logprobs`` alternatives) of the
        full blocks holding its filled tokens; returns how many positions were served."""
        k, bs, ctx = op.prompt_logprobs, self.block_size, op.ctx
        assert k is not None
        start, end = op.prompt_len, op.prompt_len + len(op.prompt_lp)
        hashes = ctx.block_hashes(end // bs, bs)
        served = 0
        for j in range(start // bs, end // bs):
            entry = self._entries.get(hashes[j])
            if entry is None:
                continue
            self._entries.move_to_end(hashes[j])
            for p in range(max(j * bs, start), (j + 1) * bs):
                raw = entry[p - j * bs]
                if raw is not None and raw.k >= k and op.prompt_lp[p - start] is None:
                    op.prompt_lp[p - start] = raw.truncated(k)
                    served += 1
        self.num_hit_positions += served
        return served

    def store(self, op: Op) -> None:
        """Keep the logprobs a finished fill knows for the full blocks holding its filled tokens (merged per position
        with what is stored: the larger ``k`` wins)."""
        if self.capacity_blocks == 0:
            return
        bs, ctx = self.block_size, op.ctx
        start, end = op.prompt_len, op.prompt_len + len(op.prompt_lp)
        hashes = ctx.block_hashes(end // bs, bs)
        for j in range(start // bs, end // bs):
            new = [op.prompt_lp[p - start] if p >= start else None for p in range(j * bs, (j + 1) * bs)]
            old = self._entries.pop(hashes[j], None)
            if old is not None:
                new = [_wider(a, b) for a, b in zip(old, new)]
            if any(x is not None for x in new):
                self._entries[hashes[j]] = tuple(new)
        while len(self._entries) > self.capacity_blocks:
            self._entries.popitem(last=False)


def _wider(a: RawLogprobs | None, b: RawLogprobs | None) -> RawLogprobs | None:
    if a is None:
        return b
    if b is None:
        return a
    return b if b.k > a.k else a

