"""Agent workloads with tool calls for the real-engine tool benchmark (:mod:`parrot.bench.tool_bench`), and the
statistics it reports. Pure Python: no server, no torch.

A request is an agent episode: a system prompt and a question, then ``len(segments)`` rounds of "think (generate
``out_tokens``) -> call a tool (``duration_s``, returns ``result_words`` words)", then a final answer of
``final_tokens``. The tool mixes follow INFERCEPT's / LAMPS' Table 2 (LAMPS §3.2), with durations scaled down so a
whole run fits in minutes on a CPU:

    kind     tool        duration (mean, sd) s    calls / request   Table 2 (duration s, calls)
    math     calculator  0.002, 0.001             2-4               math    (9e-5, 3.75)
    qa       search      1.0, 0.25                1-3               QA      (0.69, 2.52)
    ve       env         0.15, 0.05               3-6               VE      (0.09, 28.2)
    chatbot  chat        2.5, 0.8                 2-4               chatbot (28.6, 4.45)
    image    image       4.0, 1.2                 1-2               image   (20.0, 6.91)

Every prompt is fresh random words (seeded), so the prefix cache never serves a request from another one: the only
reuse is a request's own context across its tool calls, which is what the tool policies handle.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_WORDS = ("river stone lamp harbor signal keeper tower glass lens coal wick beam reef storm tide chart compass "
          "anchor rope cliff island fog bell horn ship mast sail rudder keel deck cargo crew pilot dock pier "
          "gull wave shore sand rock granite brass iron copper oil flame mirror prism light dark night dawn dusk "
          "north south east west wind rain cloud thunder calm gale current depth sound channel bay cape point "
          "log record watch shift ladder stair lantern gallery dome spire base wall door window key clock "
          "map route course bearing knot mile league fathom hull bow stern port starboard galley cabin").split()


@dataclass(frozen=True)
class ToolSpec:
    """A tool's duration distribution (a normal, clipped at ``min_s``)."""
    name: str
    mean_s: float
    sd_s: float
    min_s: float = 0.0005

    def sample(self, rng: random.Random, scale: float = 1.0) -> float:
        return max(self.min_s, rng.gauss(self.mean_s, self.sd_s)) * scale


TOOLS: dict[str, ToolSpec] = {t.name: t for t in (
    ToolSpec("calculator", 0.002, 0.001),
    ToolSpec("search", 1.0, 0.25),
    ToolSpec("env", 0.15, 0.05),
    ToolSpec("chat", 2.5, 0.8),
    ToolSpec("image", 4.0, 1.2),
)}


@dataclass(frozen=True)
class AgentKind:
    """A kind of agent request: which tool it calls, how many times (uniform in ``calls``), how often it occurs."""
    name: str
    tool: str
    calls: tuple[int, int]
    weight: float


MIXES: dict[str, tuple[AgentKind, ...]] = {
    # INFERCEPT's multi-API dataset (LAMPS §6 "Multi"): every kind, several calls per request
    "multi": (AgentKind("math", "calculator", (2, 4), 0.25), AgentKind("qa", "search", (1, 3), 0.25),
              AgentKind("ve", "env", (3, 6), 0.15), AgentKind("chatbot", "chat", (2, 4), 0.15),
              AgentKind("image", "image", (1, 2), 0.20)),
    # one call per request (LAMPS §6 "Single")
    "single": (AgentKind("math", "calculator", (1, 1), 0.3), AgentKind("qa", "search", (1, 1), 0.4),
               AgentKind("image", "image", (1, 1), 0.3)),
}


@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes of a request (uniform ranges, inclusive) and the scale applied to every tool duration."""
    prompt_words: tuple[int, int] = (180, 320)   # system prompt + question (~1.3 tokens per word)
    out_tokens: tuple[int, int] = (12, 32)       # generated before each tool call
    result_words: tuple[int, int] = (8, 24)      # the tool's answer, appended to the context
    final_tokens: tuple[int, int] = (16, 40)     # the answer after the last tool call
    duration_scale: float = 1.0


@dataclass(frozen=True)
class Segment:
    """One think -> tool round."""
    tool: str
    duration_s: float
    out_tokens: int
    result: str


@dataclass(frozen=True)
class AgentRequest:
    index: int
    arrival_s: float
    kind: str
    system: str
    question: str
    segments: tuple[Segment, ...]
    final_tokens: int

    @property
    def tool_time_s(self) -> float:
        return sum(s.duration_s for s in self.segments)


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """``n`` arrival times (s, the first at 0) of a Poisson process of ``rate`` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def make_requests(mix: str, n: int, rate: float, seed: int, cfg: WorkloadConfig = WorkloadConfig()
                  ) -> list[AgentRequest]:
    """``n`` agent requests of mix ``mix`` arriving as a Poisson process of ``rate``/s; deterministic in ``seed``."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; known: {sorted(MIXES)}")
    kinds = MIXES[mix]
    rng = random.Random(f"tool-workload:{mix}:{n}:{rate}:{seed}")
    arrivals = poisson_arrivals(n, rate, rng)
    reqs = []
    for i, t in enumerate(arrivals):
        kind = rng.choices(kinds, weights=[k.weight for k in kinds])[0]
        tool = TOOLS[kind.tool]
        segs = tuple(Segment(tool.name, tool.sample(rng, cfg.duration_scale), rng.randint(*cfg.out_tokens),
                             words(rng.randint(*cfg.result_words), rng))
                     for _ in range(rng.randint(*kind.calls)))
        n_words = rng.randint(*cfg.prompt_words)
        system = (f"[agent {seed}-{i}] You are a {kind.name} agent with a {tool.name} tool. Notes: "
                  + words(n_words - 12, rng))
        reqs.append(AgentRequest(i, t, kind.name, system, f"Task {i}: " + words(10, rng) + "?", segs,
                                 rng.randint(*cfg.final_tokens)))
    return reqs


# ---- statistics -------------------------------------------------------------------------------------------------
def p99(xs: Sequence[float]) -> float:
    """Nearest-rank 99th percentile (the maximum below 100 samples)."""
    if not xs:
        raise ValueError("p99 of no samples")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))]


@dataclass
class RunStats:
    """Per-request outcomes of one (policy, client, rate) run."""
    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        lat, ttft = self.latencies_s, self.ttfts_s
        return {"requests": len(lat) + self.failed, "completed": len(lat), "failed": self.failed,
                "mean_s": statistics.mean(lat) if lat else None, "p50_s": statistics.median(lat) if lat else None,
                "p99_s": p99(lat) if lat else None,
                "ttft_mean_s": statistics.mean(ttft) if ttft else None, "ttft_p99_s": p99(ttft) if ttft else None,
                "errors": self.errors[:10]}


METRICS = ("mean_s", "p99_s", "ttft_mean_s", "ttft_p99_s")


def ratios(results: Mapping[str, Mapping], baseline: str) -> dict[str, dict[str, float | None]]:
    """Per policy: each of :data:`METRICS` over the baseline policy's (None where a value is missing)."""
    base = results.get(baseline)
    out = {}
    for name, r in results.items():
        out[name] = {m: (r[m] / base[m] if base is not None and r.get(m) is not None and base.get(m) else None)
                     for m in METRICS}
    return out
