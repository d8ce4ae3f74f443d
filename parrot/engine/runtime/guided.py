"""Constrained decoding: per-sequence grammar state from llguidance (no torch; the sampler applies the masks).

Why llguidance (measured with ``python -m parrot.bench.structured_bench libs`` on this project's CPUs; see
docs/results/README.md, "Structured output"): it computes a mask for a 49k-token vocabulary in tens of
microseconds per token without a per-schema precompile step over the vocabulary, its Python wheel has no
dependencies (xgrammar's pulls torch, transformers and triton), and it fills a batch of masks in one call.

Flow for one GENERATE op with ``sampling.constraint``::

    engine thread, op start      GrammarCompiler.matcher(constraint)   template compiled once per constraint
                                                                        (LRU), each op gets a deep copy
    every step, sampler          MaskFiller.fill(guides) -> int32 bitmask [rows, ceil(V/32)]  (one batched call)
                                 apply_bitmask(logits rows, bitmask)    disallowed tokens -> -inf
    engine thread, token back    Guide.consume(tok)
                                 Guide.complete -> the op finishes with STOP

Bitmask layout (llguidance's, as vLLM / SGLang use it): row r, token t is allowed iff bit (t % 32) of
word (t // 32) is set::

    word 0: tokens 0..31   (bit 0 = token 0)   word 1: tokens 32..63   ...   ceil(V/32) words per row

Logit columns past the tokenizer's vocabulary (model padding) are never allowed under a constraint.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from parrot.common.constraints import Constraint
from parrot.common.errors import BadSamplingParams, EngineError

DEFAULT_CACHED_GRAMMARS = 128


class _LlgTokenizerView:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer: every token's bytes, EOS / BOS, the special
    tokens (which never match grammar text), and string encoding (for llguidance's token healing checks)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.tokens = [tokenizer.token_to_bytes(i) for i in range(tokenizer.vocab_size)]
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TypeError tells TokenizerWrapper to pass str, not bytes
            raise TypeError("text must be str")
        return self._tok.encode(text)


@dataclass(eq=False)
class Guide:
    """One op's constraint state: its own llguidance matcher over a vocabulary of ``vocab_size`` tokens."""

    matcher: Any
    vocab_size: int

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token. The sampler only draws allowed tokens, so a refusal is an engine bug."""
        if not self.matcher.consume_token(token_id):
            raise EngineError(f"constraint refused sampled token {token_id}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar is finished: nothing but the end may follow (the op ends here)."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles constraints into llguidance matchers for one tokenizer. The tokenizer view (~0.5 s for a 49k
    vocabulary) is built on the first constrained request; compiled matchers are kept per constraint value (LRU
    of ``capacity``) and every op gets its own deep copy, so forks and concurrent requests never share state."""

    def __init__(self, tokenizer, capacity: int = DEFAULT_CACHED_GRAMMARS) -> None:
        self._tokenizer = tokenizer
        self.capacity = capacity
        self._llg_tokenizer = None
        self._templates: OrderedDict[Constraint, object] = OrderedDict()
        self.hits = 0
        self.compiled = 0

    def _llg(self):
        if self._llg_tokenizer is None:
            import llguidance

            view = _LlgTokenizerView(self._tokenizer)
            self._llg_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view),
                                                         eos_token=list(self._tokenizer.eos_token_ids))
        return self._llg_tokenizer

    def guide(self, constraint: Constraint) -> Guide:
        """A fresh :class:`Guide` for ``constraint``; BadSamplingParams if it does not compile for this vocabulary."""
        import llguidance

        template = self._templates.get(constraint)
        if template is not None:
            self._templates.move_to_end(constraint)
            self.hits += 1
            return Guide(template.deep_copy(), self._llg().vocab_size)
        template = llguidance.LLMatcher(self._llg(), constraint.llguidance_grammar(), log_level=0)
        if template.is_error():
            raise BadSamplingParams(f"{constraint.kind.value} constraint does not compile for this model: "
                                    f"{template.get_error()}", param="constraint")
        self.compiled += 1
        self._templates[constraint] = template
        while len(self._templates) > self.capacity:
            self._templates.popitem(last=False)
        return Guide(template.deep_copy(), self._llg().vocab_size)
