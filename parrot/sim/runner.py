"""SimRunner: stands in for the torch ModelRunner -- the StepOutput of a batch plan without running a model, and
what the iteration would cost (seconds, from a cost model). No torch.

Tokens are counted, not computed. A generated token is ``GEN_TOKEN`` (text ``" tok"``); a generation ends after
``max_tokens`` with ``ignore_eos``, else after a length drawn (seeded, once per op, at its first token) from
:class:`OutputLengths`, by sampling ``EOS``. The hidden state stored in a context is an opaque marker: it only
tells the scheduler that the last token's logits are available (a later Generate samples without a forward).

Cost of a plan (see :mod:`parrot.sim.cost_model`): prefill chunks count their tokens P and query-key pairs A;
decode rows (one new token at the end of the context) count D and the context tokens C their attention reads.
With shared-prefix attention (the builtin engine's kernel, paper §7) decode rows whose block tables begin with
the same blocks read that prefix once per group -- the ModelRunner's own grouping rule,
:func:`parrot.engine.runtime.decode_groups.shared_prefix_groups`. The host<->pool block copies of tool pauses
(``BatchPlan.copies``) cost ``CostModel.swap_s`` per block (bytes / the model's copy rate), added to the
iteration: the batch waits for them.
"""

from __future__ import annotations

import random
import weakref

from parrot.engine.runtime.context import Op
from parrot.engine.runtime.core import StepOutput
from parrot.engine.runtime.decode_groups import min_shared_blocks, shared_prefix_groups
from parrot.engine.scheduler.scheduler import BatchPlan, Chunk
from parrot.sim.cost_model import CostModel
from parrot.sim.tokenizer import EOS, GEN_TOKEN, OutputLengths


class _Hidden:
    """Marker in Context.last_hidden: the last token's logits are available (no tensor in the simulator)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<sim hidden state>"


HIDDEN = _Hidden()


class SimRunner:
    def __init__(self, cost: CostModel, rng: random.Random, output_lengths: OutputLengths = OutputLengths(), *,
                 shared_prefix_attention: bool = True, min_shared_tokens: int = 32) -> None:
        self.cost = cost
        self.rng = rng
        self.output_lengths = output_lengths
        self.shared_prefix_attention = shared_prefix_attention
        self.min_shared_blocks = min_shared_blocks(min_shared_tokens, cost.block_size)
        self.num_shared_prefix_rows = 0  # decode rows that read a shared prefix once per group (a metric)
        # what the engine core weighs swaps with (EngineToolCosts): the model's copy rate, and the KV bytes per
        # token that make its swap time (effective bytes when the model states a time per block)
        self.copy_bytes_per_s = cost.swap_bytes_per_s
        self.default_copy_bytes_per_s = cost.swap_bytes_per_s
        self.kv_bytes_per_token = max(1, round(cost.swap_token_s * cost.swap_bytes_per_s))
        self.num_copied_blocks = 0
        # generation length of each op, drawn at its first token; dropped with the op
        self._targets: weakref.WeakKeyDictionary[Op, int] = weakref.WeakKeyDictionary()

    # ---- outputs -------------------------------------------------------------------------------------------------
    def execute(self, plan: BatchPlan) -> StepOutput:
        self.num_copied_blocks += len(plan.copies.swap_out) + len(plan.copies.swap_in)
        computed, last_hidden, sampled = [], [], []
        for ch in plan.chunks:
            ctx = ch.op.ctx
            if ch.num_tokens:
                computed.append((ctx, ch.num_tokens))
                if ch.start + ch.num_tokens == len(ctx.tokens):
                    last_hidden.append((ctx, HIDDEN))
            if ch.sample:  # the scheduler samples only at the end of a context (or from its stored state)
                sampled.append((ch.op, self._next_token(ch.op)))
        return StepOutput(tuple(computed), tuple(last_hidden), tuple(sampled))

    def _next_token(self, op: Op) -> int:
        sp = op.sampling
        assert sp is not None
        if sp.ignore_eos:
            return GEN_TOKEN
        target = self._targets.get(op)
        if target is None:
            target = self._targets[op] = max(1, sp.min_tokens, min(sp.max_tokens, self.output_lengths.draw(self.rng)))
        n = len(op.output_ids) + 1
        return EOS if target <= n < sp.max_tokens else GEN_TOKEN

    # ---- time ------------------------------------------------------------------------------------------------------
    def cost_s(self, plan: BatchPlan) -> float:
        """Seconds the plan's iteration takes on the modelled engine (its block copies included)."""
        copies = len(plan.copies.swap_out) + len(plan.copies.swap_in)
        return self._compute_s(plan) + (self.cost.swap_s(copies) if copies else 0.0)

    def _compute_s(self, plan: BatchPlan) -> float:
        p = d = c = sample_only = 0
        a = 0.0
        decodes: list[Chunk] = []
        for ch in plan.chunks:
            if ch.num_tokens == 0:
                sample_only += ch.sample  # logits from the stored hidden state: no forward pass
            elif ch.num_tokens == 1 and ch.sample and ch.start == len(ch.op.ctx.tokens) - 1:
                d += 1
                c += ch.start + 1
                decodes.append(ch)
            else:
                p += ch.num_tokens
                a += ch.num_tokens * (ch.start + ch.num_tokens / 2)
        if self.shared_prefix_attention and len(decodes) > 1:
            c -= self._prefix_tokens_read_once(decodes)
        if p == 0 and d == 0:  # nothing to compute: only the sampling of stored hidden states (no base cost)
            return self.cost.decode_row_s * sample_only
        return self.cost.iteration_s(p, a, d + sample_only, c)

    def _prefix_tokens_read_once(self, decodes: list[Chunk]) -> int:
        """Context tokens the shared-prefix kernel does not re-read: in each group of the runner's rule
        (parrot.engine.runtime.decode_groups), all rows but one skip the common blocks."""
        _, groups = shared_prefix_groups(decodes, self.cost.block_size, self.min_shared_blocks)
        saved = 0
        for common, rows in groups:
            saved += (len(rows) - 1) * common * self.cost.block_size
            self.num_shared_prefix_rows += len(rows)
        return saved
