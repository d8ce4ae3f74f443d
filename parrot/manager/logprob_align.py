"""Which logprobs a choice lists (see :mod:`parrot.manager.completions`): completions list every generated token
(:class:`AllTokens`); chat lists the tokens whose bytes are in the message text (:class:`TextAligned`).
"""

from __future__ import annotations

from collections.abc import Sequence

from parrot.common.errors import EngineError
from parrot.common.sampling import PositionLogprobs
from parrot.manager.completion_types import CompletionPlan, Position


def generated_positions(plan: CompletionPlan, token_ids: Sequence[int],
                         logprobs: Sequence[PositionLogprobs]) -> tuple[PositionLogprobs, ...]:
    """The engine's logprobs of ``token_ids`` (one each), or () when the request asked for none."""
    if plan.logprobs is None:
        return ()
    if len(logprobs) != len(token_ids):
        raise EngineError(f"the engine returned {len(logprobs)} logprobs for {len(token_ids)} generated tokens")
    return tuple(logprobs)


class AllTokens:
    """Completions: every generated token is listed, as it arrives."""

    def push(self, positions: tuple[Position, ...], text: str, *, final: bool) -> tuple[Position, ...]:
        return positions


class TextAligned:
    """Chat: a token is listed once its first byte is in the text sent so far (text lags tokens while a
    codepoint or a possible stop string is incomplete); at the end the tokens past the text (a stop token, the
    tail of a cut stop string) are dropped::

        tokens: | He | llo | <eos> |        text sent: "Hello"  -> He, llo listed; <eos> starts at byte 5: dropped
    """

    def __init__(self) -> None:
        self.pending: list[Position] = []
        self.text_bytes = 0  # bytes of text sent
        self.listed_bytes = 0  # bytes of the tokens listed

    def push(self, positions: tuple[Position, ...], text: str, *, final: bool) -> tuple[Position, ...]:
        self.pending.extend(positions)
        self.text_bytes += len(text.encode("utf-8"))
        out: list[Position] = []
        while self.pending and self.listed_bytes < self.text_bytes:
            p = self.pending.pop(0)
            out.append(p)
            self.listed_bytes += len(p.chosen.token_bytes) if isinstance(p, PositionLogprobs) else 0
        if final:
            self.pending.clear()
        return tuple(out)


def aligner(plan: CompletionPlan) -> AllTokens | TextAligned:
    return TextAligned() if plan.chat else AllTokens()
