"""Per-iteration token budget for work sharing an engine with ops that carry a per-token target. No torch.

An op whose hint carries ``tpot_s`` (:class:`~parrot.protocol.interface.OpHint`: latency work, e.g. a chat)
decodes one token per iteration, so every iteration it rides in must take at most ``tpot_s``. Other ops on the
engine (throughput work, e.g. a map stage's prompts) may fill what the latency work leaves::

    iteration = [ decode rows (all) | prompt chunks of ops with a target | prompt chunks of the rest ]
                                                                          '--- at most allowance tokens ---'
    measured step <= min tpot_s of the ops with a target in it        (the invariant the allowance follows)

The allowance is learned from the engine's own measured step times (additive increase, multiplicative decrease,
as TCP's congestion window): after a step that carried an op with a target, ``allowance += increase_tokens`` if
the step kept the strictest target, else ``allowance *= decrease``; never below ``min_tokens`` (the rest always
progresses) nor above the batch budget. No cost model is assumed, so it finds a GPU's free region (a decode
iteration streams the weights once; prompt tokens up to the roofline's ridge ride almost free) as well as a CPU's
linear one (every prompt token costs; the allowance stays small). Steps without a target do not change it.
"""

from __future__ import annotations

from dataclasses import dataclass

INCREASE_TOKENS = 16  # one KV block per step that kept its target
DECREASE = 0.5  # after a step that missed it
MIN_TOKENS = 16  # the rest's floor while targets run: throughput work is slowed, never stopped


@dataclass
class StepBudget:
    """The allowance of tokens that ops without a target may add to an iteration carrying ops with one."""

    max_tokens: int
    min_tokens: int = MIN_TOKENS
    increase_tokens: int = INCREASE_TOKENS
    decrease: float = DECREASE
    allowance: int = MIN_TOKENS
    num_over: int = 0  # steps that missed their target (metrics / tests)
    num_guarded: int = 0  # steps that carried a target

    def __post_init__(self) -> None:
        if not (1 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        if self.increase_tokens < 1 or not (0 < self.decrease < 1):
            raise ValueError("need increase_tokens >= 1 and 0 < decrease < 1")
        self.allowance = min(self.max_tokens, max(self.min_tokens, self.allowance))

    def observe(self, seconds: float, target_s: float) -> None:
        """A step that carried ops with a target (the strictest ``target_s``) took ``seconds``."""
        self.num_guarded += 1
        if seconds > target_s:
            self.num_over += 1
            self.allowance = max(self.min_tokens, int(self.allowance * self.decrease))
        else:
            self.allowance = min(self.max_tokens, self.allowance + self.increase_tokens)

    def to_wire(self) -> dict:
        return {"allowance_tokens": self.allowance, "guarded_steps": self.num_guarded,
                "steps_over_target": self.num_over}
