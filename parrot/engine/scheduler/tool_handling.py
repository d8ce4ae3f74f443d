"""What to do with a request's KV while its tool (API) call runs: INFERCEPT's waste model and LAMPS' rank. No torch.

A tool-calling request is a segment ``prompt -> decode output -> tool call -> resume``. While the tool runs the
request's context (``C`` tokens) is *paused* and handled one of three ways (LAMPS §2.3, INFERCEPT eq. 1-3):

    PRESERVE  keep the KV            waste = T_tool * C                              (eq. 1)
    DISCARD   free it, recompute     waste = T_fwd(C) * C + T_fwd(C) * C_other        (eq. 2)
    SWAP      copy out, copy back    waste = 2 * T_swap(C) * C_batch                  (eq. 3)

``C_other`` is the context of the other requests in the batch (they stall while the recompute runs),
``C_batch = C + C_other`` (a swap stalls the whole batch, once out and once in). Waste is in token-seconds
(INFERCEPT's ``M``, bytes per token, is a common factor and is left out). :func:`choose_handling` takes the
cheapest; ties go to ``preserve < swap < discard`` (least work first).

LAMPS ranks waiting requests by their *memory over time*: the area under the request's memory curve until the
end of its segment (Fig. 4). Memory grows by one token per decode step up to the tool call; the tool-call
region has the handling's shape; after the resume the post-tool tokens (if known) grow it further::

    PRESERVE                      DISCARD                        SWAP
    mem                           mem                            mem
    C |     +-------+  /          C |     +        +--+ /        C |     +-+        +-+ /
      |    /|       | /             |    /|        |  |/           |    /| |        | |/
    P |   / |       |/            P |   / |        |  |          P |   / | |        | |
      +--/--+-------+----> t        +--/--+--------+--+----> t     +--/--+-+--------+-+----> t
       decode  tool  post            decode  tool   r  post         decode o  tool   i  post
                                          (0 KV)                           (0 KV)

    area = prefill (T_fwd(P) * P)  +  decode growth  +  tool region  +  post-tool growth
    tool region = waste(h) with C_other = ``other_tokens``: preserve = T_tool * C (flat); discard = the
    recompute r (T_fwd(C) * C) plus the batch's stall during it; swap = out o + in i (2 * T_swap(C) * C)
    plus the batch's stall during both.

With ``other_tokens = 0`` the area is the request's own curve; LAMPS "combines this waste with our estimation of
the context size for batched requests" (§4.2), which the caller supplies as ``other_tokens`` (e.g. the KV in use
by the running batch). Decode growth is discrete: during decode step ``k`` (1-based) the request holds
``P + k`` tokens for ``T_step`` seconds.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class Handling(str, Enum):
    """How a paused context's KV is kept while its tool runs. Declaration order = tie-break order."""

    PRESERVE = "preserve"
    DISCARD = "discard"
    SWAP = "swap"


_TIE_ORDER = {Handling.PRESERVE: 0, Handling.SWAP: 1, Handling.DISCARD: 2}


class ToolCosts(Protocol):
    """Seconds; what the engine measures (its step-cost fit and the runner's copy rate)."""

    def fwd_s(self, tokens: int) -> float:
        """Recompute (prefill) ``tokens`` of context."""
        ...

    def swap_s(self, tokens: int) -> float:
        """Copy ``tokens`` of KV one way (out to the host store, or back in)."""
        ...

    def step_s(self) -> float:
        """One decode iteration of the current batch."""
        ...


@dataclass(frozen=True)
class FixedCosts:
    """A :class:`ToolCosts` from plain numbers: ``fwd_s(n) = fwd_base_s + n * fwd_per_token_s`` (0 for n <= 0),
    likewise ``swap_s``; ``step_s() = decode_step_s``."""

    fwd_per_token_s: float
    swap_per_token_s: float
    decode_step_s: float
    fwd_base_s: float = 0.0
    swap_base_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fwd_per_token_s", "swap_per_token_s", "decode_step_s", "fwd_base_s", "swap_base_s"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")

    def fwd_s(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else self.fwd_base_s + tokens * self.fwd_per_token_s

    def swap_s(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else self.swap_base_s + tokens * self.swap_per_token_s

    def step_s(self) -> float:
        return self.decode_step_s


def _check_tokens(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")


def waste(h: Handling, *, context_tokens: int, other_tokens: int, batch_tokens: int, tool_s: float,
          costs: ToolCosts) -> float:
    """INFERCEPT's memory waste (token-seconds) of handling a paused context of ``context_tokens`` with ``h``
    while a tool runs ``tool_s`` seconds; ``other_tokens`` / ``batch_tokens`` are the other requests' and the
    whole batch's context (eq. 1-3 in the module docstring)."""
    _check_tokens(context_tokens=context_tokens, other_tokens=other_tokens, batch_tokens=batch_tokens)
    if tool_s < 0:
        raise ValueError(f"tool_s must be >= 0, got {tool_s!r}")
    c = context_tokens
    if h is Handling.PRESERVE:
        return tool_s * c
    if h is Handling.DISCARD:
        t = costs.fwd_s(c)
        return t * c + t * other_tokens
    if h is Handling.SWAP:
        return 2.0 * costs.swap_s(c) * batch_tokens
    raise ValueError(f"unknown handling {h!r}")


def choose_handling(*, context_tokens: int, other_tokens: int, batch_tokens: int, tool_s: float,
                    costs: ToolCosts, allowed: Collection[Handling] = tuple(Handling)) -> Handling:
    """The handling in ``allowed`` with the least :func:`waste`; ties -> preserve < swap < discard."""
    if not allowed:
        raise ValueError("allowed must name at least one handling")
    return min(allowed, key=lambda h: (waste(h, context_tokens=context_tokens, other_tokens=other_tokens,
                                             batch_tokens=batch_tokens, tool_s=tool_s, costs=costs),
                                       _TIE_ORDER[h]))


def _growth_area(start_tokens: int, steps: int, step_s: float) -> float:
    """Area of decoding ``steps`` tokens from ``start_tokens``: step ``k`` holds ``start + k`` tokens."""
    return step_s * (steps * start_tokens + steps * (steps + 1) / 2.0)


def memory_time(*, prompt_tokens: int, output_tokens: int, tool_s: float | None, handling: Handling | None,
                costs: ToolCosts, post_tool_tokens: int = 0, other_tokens: int = 0, cached_tokens: int = 0) -> float:
    """LAMPS' rank score (token-seconds): the area under the request's memory curve to the end of its segment.

    ``prompt_tokens`` are prefilled (area ``T_fwd(P - cached) * P``: the ``cached_tokens`` of the prompt whose KV
    is already held -- a request resumed after a tool call, a shared prefix -- cost no prefill time), ``output_tokens``
    decoded (discrete growth), then,
    if ``tool_s`` and ``handling`` are given, the tool region of the handling's shape (:func:`waste` with the
    request's context ``C = P + output`` and ``other_tokens`` of batch context), then ``post_tool_tokens``
    decoded from ``C``. Without a tool the score is prefill + decode growth (plain shortest-memory-first).
    """
    _check_tokens(prompt_tokens=prompt_tokens, output_tokens=output_tokens, post_tool_tokens=post_tool_tokens,
                  other_tokens=other_tokens, cached_tokens=cached_tokens)
    step = costs.step_s()
    missed = max(0, prompt_tokens - cached_tokens)
    area = (costs.fwd_s(missed) * prompt_tokens if missed else 0.0) + _growth_area(prompt_tokens, output_tokens, step)
    context = prompt_tokens + output_tokens
    if tool_s is None or handling is None:
        return area
    area += waste(handling, context_tokens=context, other_tokens=other_tokens,
                  batch_tokens=context + other_tokens, tool_s=max(0.0, tool_s), costs=costs)
    return area + _growth_area(context, post_tool_tokens, step)
