"""What the manager predicts for a generate (LAMPS §4.2): how many tokens it will write and, when a tool call
follows it, how long the tool will run. No torch; both predictors learn online from the server's own history.

:class:`ToolDurations` keeps a running mean / variance (Welford) per tool name. Until a tool has been observed
the client's declared ``expected_duration_s`` is the prediction (LAMPS: API durations are predictable per API
type, with low variance within a type).

:class:`OutputLengthPredictor` is the protocol of an output-length model; :class:`BinnedLengthPredictor`, the
default, is LAMPS' classifier over 50 bins of 10 tokens, made small: instead of an OPT-125M embedding it keys on
prompt features (:class:`PromptFeatures`) and keeps a histogram over the bins per key, at three levels::

    (model, template, tools, log2 prompt-token bucket)   most specific: used once it has MIN_SUPPORT observations
    (model, template)                                     the function / template alone
    (model,)                                              everything this model wrote

A prediction is the median bin of the most specific histogram with support (the bin minimising the expected
absolute error), reported as the mean length observed in that bin, capped at ``max_tokens``; with no history at
all, ``min(max_tokens, DEFAULT_TOKENS)``. Accuracy is measured prequentially: every observation is first
predicted with the model as it was, then learned, so the mean absolute error and within-bin rate it reports are
those of real predictions on unseen requests.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

NUM_BINS = 50  # LAMPS §5: 50 bins ...
BIN_TOKENS = 10  # ... of 10 tokens; the last bin is open-ended
MIN_SUPPORT = 3  # observations a histogram needs before it is trusted over a coarser one
DEFAULT_TOKENS = 64  # prediction with no history at all (capped at max_tokens)
MAX_KEYS = 4096  # histograms kept (LRU): bounds the manager's memory whatever the traffic
DECAY_AT = 512  # a histogram whose total reaches this is halved: recent traffic weighs more


@dataclass(frozen=True)
class PromptFeatures:
    """What an output-length prediction may look at: known before the generate starts."""

    model: str
    prompt_tokens: int
    max_tokens: int
    template: str = ""  # identity of the function / template (a DAG request's template, a chat's prompt head)
    tools: tuple[str, ...] = ()  # names of the tools offered (chat) or expected next (a tool-fed output)

    def keys(self) -> tuple[tuple, ...]:
        """Histogram keys, most specific first."""
        bucket = max(0, self.prompt_tokens).bit_length()  # log2 bucket
        return ((self.model, self.template, tuple(sorted(self.tools)), bucket), (self.model, self.template),
                (self.model,))


@dataclass(frozen=True)
class PredictionAccuracy:
    """Prequential accuracy of an output-length predictor (each prediction made before its outcome was learned)."""

    observations: int
    mean_abs_error: float | None  # tokens; None before any observation
    within_bin_rate: float | None  # share of predictions in the actual length's bin
    within_15_rate: float | None  # share within 15 tokens (LAMPS' Acc-15)

    def to_dict(self) -> dict:
        return {"observations": self.observations, "mean_abs_error": self.mean_abs_error,
                "within_bin_rate": self.within_bin_rate, "within_15_rate": self.within_15_rate}


class OutputLengthPredictor(Protocol):
    """Predicts a generate's output tokens from its prompt features; learns from completed generates."""

    def predict(self, features: PromptFeatures) -> int:
        """Predicted output tokens, 0 < p <= features.max_tokens (max_tokens >= 1)."""
        ...

    def observe(self, features: PromptFeatures, output_tokens: int) -> None:
        """A generate with ``features`` wrote ``output_tokens`` tokens; updates the model and its accuracy."""
        ...

    def accuracy(self) -> PredictionAccuracy:
        ...


def bin_of(tokens: int) -> int:
    return min(NUM_BINS - 1, max(0, tokens) // BIN_TOKENS)


@dataclass
class _Histogram:
    counts: list[float] = field(default_factory=lambda: [0.0] * NUM_BINS)
    sums: list[float] = field(default_factory=lambda: [0.0] * NUM_BINS)  # sum of the lengths seen per bin
    total: float = 0.0

    def add(self, tokens: int) -> None:
        b = bin_of(tokens)
        self.counts[b] += 1.0
        self.sums[b] += tokens
        self.total += 1.0
        if self.total >= DECAY_AT:
            self.counts = [c / 2 for c in self.counts]
            self.sums = [s / 2 for s in self.sums]
            self.total /= 2

    def median_mean(self) -> float:
        """The mean length observed in the median bin."""
        half, acc = self.total / 2, 0.0
        for b, c in enumerate(self.counts):
            acc += c
            if c > 0 and acc >= half:
                return self.sums[b] / c
        raise AssertionError("median of an empty histogram")


class BinnedLengthPredictor:
    """The default :class:`OutputLengthPredictor` (module docstring). Thread-safe (the OpenAI path and the graph
    executor share one)."""

    def __init__(self, *, min_support: int = MIN_SUPPORT, default_tokens: int = DEFAULT_TOKENS,
                 max_keys: int = MAX_KEYS) -> None:
        if min_support < 1 or default_tokens < 1 or max_keys < 3:
            raise ValueError(f"min_support and default_tokens must be >= 1, max_keys >= 3; got {min_support}, "
                             f"{default_tokens}, {max_keys}")
        self.min_support = min_support
        self.default_tokens = default_tokens
        self.max_keys = max_keys
        self._hists: OrderedDict[tuple, _Histogram] = OrderedDict()
        self._lock = threading.Lock()
        self._n = 0
        self._abs_err = 0.0
        self._in_bin = 0
        self._within_15 = 0

    def predict(self, features: PromptFeatures) -> int:
        with self._lock:
            return self._predict(features)

    def _predict(self, f: PromptFeatures) -> int:
        cap = max(1, f.max_tokens)
        for key in f.keys():
            h = self._hists.get(key)
            if h is not None and h.total >= self.min_support:
                return max(1, min(cap, round(h.median_mean())))
        # nothing trusted: the coarsest histogram with any data, else the default
        h = self._hists.get(f.keys()[-1])
        if h is not None and h.total > 0:
            return max(1, min(cap, round(h.median_mean())))
        return min(cap, self.default_tokens)

    def observe(self, features: PromptFeatures, output_tokens: int) -> None:
        with self._lock:
            predicted = self._predict(features)
            err = abs(predicted - output_tokens)
            self._n += 1
            self._abs_err += err
            self._in_bin += bin_of(predicted) == bin_of(output_tokens)
            self._within_15 += err <= 15
            for key in features.keys():
                h = self._hists.get(key)
                if h is None:
                    h = self._hists[key] = _Histogram()
                self._hists.move_to_end(key)
                h.add(output_tokens)
            while len(self._hists) > self.max_keys:
                self._hists.popitem(last=False)

    def accuracy(self) -> PredictionAccuracy:
        with self._lock:
            n = self._n
            if n == 0:
                return PredictionAccuracy(0, None, None, None)
            return PredictionAccuracy(n, self._abs_err / n, self._in_bin / n, self._within_15 / n)


@dataclass(frozen=True)
class ToolStats:
    name: str
    count: int
    mean_s: float
    std_s: float

    def to_dict(self) -> dict:
        return {"count": self.count, "mean_s": self.mean_s, "std_s": self.std_s}


class ToolDurations:
    """Running duration statistics per tool name (Welford). Thread-safe."""

    def __init__(self, *, max_tools: int = 1024) -> None:
        self.max_tools = max_tools
        self._stats: OrderedDict[str, list[float]] = OrderedDict()  # name -> [count, mean, M2]
        self._lock = threading.Lock()

    def observe(self, name: str, duration_s: float) -> None:
        """A call of tool ``name`` took ``duration_s`` (negative or non-finite values are ignored)."""
        if not math.isfinite(duration_s) or duration_s < 0:
            return
        with self._lock:
            s = self._stats.get(name)
            if s is None:
                s = self._stats[name] = [0.0, 0.0, 0.0]
            self._stats.move_to_end(name)
            s[0] += 1
            delta = duration_s - s[1]
            s[1] += delta / s[0]
            s[2] += delta * (duration_s - s[1])
            while len(self._stats) > self.max_tools:
                self._stats.popitem(last=False)

    def predict(self, name: str, client_hint_s: float | None = None) -> float | None:
        """The mean observed duration of ``name``; the client's hint until there is one (None: neither)."""
        with self._lock:
            s = self._stats.get(name)
            return s[1] if s is not None and s[0] > 0 else client_hint_s

    def get(self, name: str) -> ToolStats | None:
        with self._lock:
            s = self._stats.get(name)
            return None if s is None else _tool_stats(name, s)

    def all(self) -> list[ToolStats]:
        with self._lock:
            return [_tool_stats(n, s) for n, s in sorted(self._stats.items())]


def _tool_stats(name: str, s: list[float]) -> ToolStats:
    count = int(s[0])
    return ToolStats(name, count, s[1], math.sqrt(s[2] / (count - 1)) if count > 1 else 0.0)


@dataclass
class Predictors:
    """The manager's predictors, shared by the graph executor and the OpenAI completion service, plus the pause
    counts the manager itself made (by the handling the engine reported; "free" when the engine has none)."""

    output_length: OutputLengthPredictor = field(default_factory=BinnedLengthPredictor)
    tool_durations: ToolDurations = field(default_factory=ToolDurations)
    pauses: dict[str, int] = field(default_factory=dict)

    def paused(self, handling: str) -> None:
        self.pauses[handling] = self.pauses.get(handling, 0) + 1

    def stats(self, engine_pauses: Iterable[dict] = ()) -> dict:
        """The ``tools`` block of ``GET /api/v1/stats``: ``engine_pauses`` are the engines' ``tool_pauses`` status
        extras (counts, e.g. ``{"paused", "by_handling": {...}, "resumed", "expired", "demoted"}``), summed."""
        total: dict = {}
        for counts in engine_pauses:
            _add_counts(total, counts)
        return {"output_length": self.output_length.accuracy().to_dict(),
                "tool_durations": {t.name: t.to_dict() for t in self.tool_durations.all()},
                "pauses_requested": dict(self.pauses), "engine_pauses": total}


def _add_counts(total: dict, counts: dict) -> None:
    """Add the integer counts of ``counts`` (nested dicts too) into ``total``; anything else is skipped."""
    for key, value in counts.items():
        if isinstance(value, dict):
            _add_counts(total.setdefault(key, {}), value)
        elif isinstance(value, int) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value
