"""How long one engine iteration takes as a function of its batch, learned online from the engine's own steps.

An iteration (see the engine scheduler) decodes ``rows`` sequences whose KV covers ``ctx`` tokens in all and
prefills ``prefill`` prompt tokens. Its time is modelled as linear in those counts (Preble §2.1; the simulator's
:mod:`parrot.sim.cost_model` is the same model plus a small quadratic prefill-attention term)::

    step_s = base_s + decode_row_s * rows + decode_ctx_s * ctx + prefill_token_s * prefill

The ratio of the slopes to ``base_s`` says how free batching is: on a GPU a decode step is dominated by
streaming the weights once (``base_s``), so one more sequence costs ~1% of a step; on a 1-thread CPU engine one
more sequence costs ~7% and every prompt token ~4% (parrot/sim/cost_models/this-machine-1t.json).

:class:`StepStats` is what an engine keeps and reports in its status (``extra["step_stats"]``): the decayed
sufficient statistics of a weighted least-squares fit, 15 numbers whatever the number of iterations, which can
be summed over engines running the same model on the same hardware (the manager pools them). :meth:`StepStats.fit`
solves for non-negative coefficients, minimizing the *relative* error (each row weighted by 1/seconds) with a
small ridge on the slopes: a slope the data does not identify (an engine that only ever decoded one sequence
at a time) is attributed to ``base_s``, i.e. batching is assumed free until an engine shows otherwise.
No torch, no numpy: a 4x4 solve.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

NUM_FEATURES = 4  # 1, decode rows, decode context tokens, prefill tokens
MIN_SAMPLES = 8.0  # (decayed) iterations before a fit is reported
RIDGE = 1e-3  # ridge on each slope, relative to its feature's weighted sum of squares
DECAY = 0.999  # per iteration: the statistics follow a machine whose speed drifts (half-life ~700 iterations)


@dataclass(frozen=True)
class StepCost:
    """A fitted iteration-time model (seconds)."""

    base_s: float
    decode_row_s: float
    decode_ctx_s: float
    prefill_token_s: float

    def __post_init__(self) -> None:
        for name in ("base_s", "decode_row_s", "decode_ctx_s", "prefill_token_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"StepCost.{name} must be a finite number >= 0, got {v!r}")

    def step_s(self, rows: int, ctx_tokens: int, prefill_tokens: int = 0) -> float:
        """One iteration decoding ``rows`` sequences over ``ctx_tokens`` of KV and prefilling ``prefill_tokens``."""
        if rows <= 0 and prefill_tokens <= 0:
            return 0.0
        return (self.base_s + self.decode_row_s * rows + self.decode_ctx_s * ctx_tokens
                + self.prefill_token_s * prefill_tokens)


class StepStats:
    """Decayed weighted least-squares statistics of (features, seconds) per iteration; see the module docstring."""

    def __init__(self, decay: float = DECAY) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.decay = decay
        self.n = 0.0  # decayed number of iterations
        self.xx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]  # sum of w^2 x x^T
        self.xy = [0.0] * NUM_FEATURES  # sum of w^2 x y

    def add(self, rows: int, ctx_tokens: int, prefill_tokens: int, seconds: float) -> None:
        """One measured iteration (ignored if it took no time: a clock that did not move tells nothing)."""
        if not seconds > 0 or not math.isfinite(seconds):
            return
        x = (1.0, float(rows), float(ctx_tokens), float(prefill_tokens))
        w2 = 1.0 / (seconds * seconds)
        d = self.decay
        self.n = self.n * d + 1.0
        for i in range(NUM_FEATURES):
            self.xy[i] = self.xy[i] * d + w2 * x[i] * seconds
            row = self.xx[i]
            for j in range(NUM_FEATURES):
                row[j] = row[j] * d + w2 * x[i] * x[j]

    # ---- wire / pooling ---------------------------------------------------------------------------------------
    def to_wire(self) -> dict:
        return {"n": self.n, "xx": [list(r) for r in self.xx], "xy": list(self.xy)}

    @classmethod
    def from_wire(cls, data: Mapping) -> "StepStats":
        """Parse what :meth:`to_wire` produced; ValueError if malformed."""
        try:
            xx = [[float(v) for v in row] for row in data["xx"]]
            xy = [float(v) for v in data["xy"]]
            n = float(data["n"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed step statistics: {e}") from None
        if len(xx) != NUM_FEATURES or any(len(r) != NUM_FEATURES for r in xx) or len(xy) != NUM_FEATURES:
            raise ValueError("malformed step statistics: wrong shape")
        out = cls()
        out.n, out.xx, out.xy = n, xx, xy
        return out

    @classmethod
    def pooled(cls, stats: Iterable["StepStats"]) -> "StepStats":
        """The statistics of all of ``stats`` together (engines of one model on the same hardware)."""
        out = cls()
        for s in stats:
            out.n += s.n
            for i in range(NUM_FEATURES):
                out.xy[i] += s.xy[i]
                for j in range(NUM_FEATURES):
                    out.xx[i][j] += s.xx[i][j]
        return out

    # ---- fit --------------------------------------------------------------------------------------------------
    def fit(self) -> StepCost | None:
        """Non-negative coefficients (None before MIN_SAMPLES iterations or if nothing is identified)."""
        if self.n < MIN_SAMPLES or self.xx[0][0] <= 0:
            return None
        active = [i for i in range(NUM_FEATURES) if self.xx[i][i] > 0]
        while active:
            sol = _solve([[self.xx[i][j] + (RIDGE * self.xx[i][i] if i == j and i > 0 else 0.0) for j in active]
                          for i in active], [self.xy[i] for i in active])
            if sol is None:
                return None
            if min(sol) >= 0:
                coef = [0.0] * NUM_FEATURES
                for i, v in zip(active, sol):
                    coef[i] = v
                return StepCost(*coef)
            # drop the most negative coefficient and refit (active-set NNLS; ties drop one at a time)
            active.pop(min(range(len(sol)), key=lambda k: sol[k]))
        return None


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        scale = max(abs(m[r][c]) for r in range(n)) or 1.0
        if abs(m[p][c]) <= 1e-12 * scale:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c and m[r][c] != 0.0:
                f = m[r][c] / m[c][c]
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    return [m[i][n] / m[i][i] for i in range(n)]
