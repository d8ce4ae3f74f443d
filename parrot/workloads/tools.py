"""INFERCEPT / LAMPS tool-calling workloads (LAMPS Table 2), defined once, at the two scales that run them. No torch.

The two tables' numbers differ, so both are kept, named by their scale:

* :data:`TABLE2_KINDS` / :data:`TABLE2_MIXES` -- Table 2's API durations and call counts with token sizes, at GPU
  scale: the simulator's requests (:func:`make_workload` -> :class:`ToolRequest`, run by
  :mod:`parrot.sim.tool_experiments`).
* :data:`CPU_TOOLS` / :data:`CPU_MIXES` -- durations scaled down so a whole run fits in minutes on a CPU, prompts
  as text: the real engine's agent episodes (:func:`make_requests` -> :class:`AgentRequest`, run by
  :mod:`parrot.bench.tool_bench`).

**Table 2 scale (simulator), in tokens.** A request is a prompt, then segments: decode ``output_tokens``, call a
tool (``duration_s``; it returns ``return_tokens`` that are appended to the context), ..., and a last segment that
ends the request::

    | prompt | out_0 | ret_0 | out_1 | ret_1 | ... | out_k |       k tool calls, k + 1 generates
              ^ tool 0 runs here (the context is paused), then the next generate continues the same context

API durations and call counts per kind are LAMPS Table 2 (the INFERCEPT dataset; mean, sd; a normal clipped at
0 / at 1 call). Token lengths are *assumptions* (INFERCEPT's dataset files are not public; its benchmark draws
the pre-API output around 128 tokens, normal(128, 32)), chosen per kind and listed in :data:`TABLE2_KINDS`.
Arrivals are Poisson. Every draw is seeded, so the same workload is replayed under every policy.

Predictions (LAMPS §4.2, §6.4): each segment carries the hint the driver sends, ``predicted_output_tokens`` and
the tool's ``predicted_s``; :func:`with_prediction_error` perturbs them as the paper's error injection,
``predicted = measured + N(0, p * measured)`` (clipped at 1 token / 0 s), with its own seed.

**CPU scale (real engine), in text.** A request is an agent episode: a system prompt and a question, then
``len(segments)`` rounds of "think (generate ``out_tokens``) -> call a tool (``duration_s``, returns
``result_words`` words)", then a final answer of ``final_tokens``. The mixes follow Table 2 with durations scaled
down:

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

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from parrot.workloads.arrivals import poisson_arrivals


# ---- Table 2 scale: the simulator's requests, in tokens --------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    name: str
    duration_s: float
    return_tokens: int
    predicted_s: float  # the duration hint sent with the generate before it (and with the pause)


@dataclass(frozen=True)
class Segment:
    output_tokens: int
    predicted_output_tokens: int
    tool: ToolCall | None  # None: the request's last segment


@dataclass(frozen=True)
class ToolRequest:
    rid: int
    kind: str
    arrival_s: float
    prompt_tokens: int
    segments: tuple[Segment, ...]

    @property
    def num_calls(self) -> int:
        return sum(1 for s in self.segments if s.tool is not None)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + sum(s.output_tokens + (s.tool.return_tokens if s.tool else 0)
                                        for s in self.segments)


@dataclass(frozen=True)
class Kind:
    """One augmentation type: Table 2's API duration and call count (mean, sd), and assumed token sizes."""

    name: str
    duration_s: tuple[float, float]
    calls: tuple[float, float]
    prompt_tokens: tuple[float, float]
    output_tokens: tuple[float, float]   # per segment
    return_tokens: tuple[float, float]   # appended by each tool call


TABLE2_KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("math", (9e-5, 6e-5), (3.75, 1.3), (160, 48), (48, 16), (8, 4)),
    Kind("qa", (0.69, 0.17), (2.52, 1.73), (240, 64), (64, 24), (96, 32)),
    Kind("ve", (0.09, 0.014), (28.18, 15.2), (400, 96), (24, 8), (32, 12)),
    Kind("chatbot", (28.6, 15.6), (4.45, 1.96), (120, 40), (128, 48), (48, 20)),
    Kind("image", (20.03, 7.8), (6.91, 3.93), (120, 40), (48, 16), (16, 4)),
    Kind("tts", (17.24, 7.6), (6.91, 3.93), (120, 40), (64, 24), (16, 4)),
    Kind("toolbench", (1.72, 3.33), (2.45, 1.81), (640, 192), (64, 32), (96, 48)),
)}

INFERCEPT_KINDS = ("math", "qa", "ve", "chatbot", "image", "tts")
TABLE2_MIXES: dict[str, tuple[str, ...]] = {
    "single": INFERCEPT_KINDS,   # one call per request (LAMPS §6 "single-API")
    "multi": INFERCEPT_KINDS,    # Table 2 call counts (LAMPS §6 "multi-API", the full INFERCEPT dataset)
    "toolbench": ("toolbench",),
}


def _gauss(rng: random.Random, ms: tuple[float, float], lo: float) -> float:
    return max(lo, rng.gauss(ms[0], ms[1]))


def _tokens(rng: random.Random, ms: tuple[float, float], lo: int = 1) -> int:
    return max(lo, round(rng.gauss(ms[0], ms[1])))


def make_workload(mix: str, num_requests: int, rate: float, *, seed: int = 0, max_calls: int = 12,
                  max_tokens: int = 3584) -> list[ToolRequest]:
    """``num_requests`` requests of ``mix`` (kinds uniformly), Poisson arrivals at ``rate`` per second.
    ``max_calls`` caps a request's tool calls (VE's 28 would dominate a small run), ``max_tokens`` its whole
    context (calls are dropped from the end to fit the model window)."""
    if mix not in TABLE2_MIXES:
        raise ValueError(f"unknown tool mix {mix!r} (known: {', '.join(TABLE2_MIXES)})")
    if num_requests < 0 or rate <= 0 or max_calls < 1:
        raise ValueError("num_requests must be >= 0, rate > 0 and max_calls >= 1")
    rng = random.Random(f"tools:{mix}:{seed}")
    t = 0.0
    out: list[ToolRequest] = []
    for rid in range(num_requests):
        t += rng.expovariate(rate)
        kind = TABLE2_KINDS[rng.choice(TABLE2_MIXES[mix])]
        calls = 1 if mix == "single" else min(max_calls, max(1, round(rng.gauss(*kind.calls))))
        prompt = _tokens(rng, kind.prompt_tokens, 8)
        segs: list[Segment] = []
        total = prompt
        for i in range(calls + 1):
            n = _tokens(rng, kind.output_tokens, 4)
            tool = None
            if i < calls:
                dur = _gauss(rng, kind.duration_s, 0.0)
                tool = ToolCall(kind.name, dur, _tokens(rng, kind.return_tokens), dur)
            grown = total + n + (tool.return_tokens if tool else 0)
            if tool is not None and grown + kind.output_tokens[0] > max_tokens:
                tool = None  # no room for another call: this segment ends the request
            segs.append(Segment(n, n, tool))
            total += n + (tool.return_tokens if tool else 0)
            if tool is None:
                break
        out.append(ToolRequest(rid, kind.name, t, prompt, tuple(segs)))
    return out


def with_prediction_error(requests: Sequence[ToolRequest], p: float, *, seed: int = 0) -> list[ToolRequest]:
    """LAMPS §6.4: every predicted output length and tool duration becomes ``measured + N(0, p * measured)``."""
    if p < 0:
        raise ValueError(f"p must be >= 0, got {p!r}")
    rng = random.Random(f"tools-error:{p}:{seed}")
    out = []
    for r in requests:
        segs = []
        for s in r.segments:
            pred = max(1, round(s.output_tokens + rng.gauss(0.0, p * s.output_tokens)))
            tool = s.tool
            if tool is not None:
                tool = replace(tool, predicted_s=max(0.0, tool.duration_s + rng.gauss(0.0, p * tool.duration_s)))
            segs.append(replace(s, predicted_output_tokens=pred, tool=tool))
        out.append(replace(r, segments=tuple(segs)))
    return out


def describe(requests: Sequence[ToolRequest]) -> str:
    """One line of the workload's shape (printed with every table)."""
    if not requests:
        return "0 requests"
    n = len(requests)
    calls = sum(r.num_calls for r in requests)
    dur = sum(s.tool.duration_s for r in requests for s in r.segments if s.tool)
    span = requests[-1].arrival_s - requests[0].arrival_s
    kinds = sorted({r.kind for r in requests})
    return (f"{n} requests ({', '.join(kinds)}) over {span:.0f} s, {calls / n:.1f} calls/request, "
            f"mean tool {dur / max(1, calls):.2f} s, mean context {sum(r.total_tokens for r in requests) / n:.0f} "
            f"tokens")


# ---- CPU scale: the real engine's agent episodes, in text -----------------------------------------------------
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


CPU_TOOLS: dict[str, ToolSpec] = {t.name: t for t in (
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


CPU_MIXES: dict[str, tuple[AgentKind, ...]] = {
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
class AgentSegment:
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
    segments: tuple[AgentSegment, ...]
    final_tokens: int

    @property
    def tool_time_s(self) -> float:
        return sum(s.duration_s for s in self.segments)


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def make_requests(mix: str, n: int, rate: float, seed: int, cfg: WorkloadConfig = WorkloadConfig()
                  ) -> list[AgentRequest]:
    """``n`` agent requests of mix ``mix`` arriving as a Poisson process of ``rate``/s; deterministic in ``seed``."""
    if mix not in CPU_MIXES:
        raise ValueError(f"unknown mix {mix!r}; known: {sorted(CPU_MIXES)}")
    kinds = CPU_MIXES[mix]
    rng = random.Random(f"tool-workload:{mix}:{n}:{rate}:{seed}")
    arrivals = poisson_arrivals(n, rate, rng)
    reqs = []
    for i, t in enumerate(arrivals):
        kind = rng.choices(kinds, weights=[k.weight for k in kinds])[0]
        tool = CPU_TOOLS[kind.tool]
        segs = tuple(AgentSegment(tool.name, tool.sample(rng, cfg.duration_scale), rng.randint(*cfg.out_tokens),
                             words(rng.randint(*cfg.result_words), rng))
                     for _ in range(rng.randint(*kind.calls)))
        n_words = rng.randint(*cfg.prompt_words)
        system = (f"[agent {seed}-{i}] You are a {kind.name} agent with a {tool.name} tool. Notes: "
                  + words(n_words - 12, rng))
        reqs.append(AgentRequest(i, t, kind.name, system, f"Task {i}: " + words(10, rng) + "?", segs,
                                 rng.randint(*cfg.final_tokens)))
    return reqs
