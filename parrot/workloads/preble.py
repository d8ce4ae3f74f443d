"""Generated request streams with the shape of Preble's five workloads (Table 1), scaled to a 4k-token window.

Each generator returns ``Request``s (arrival time, prompt text, max output tokens) for
:class:`~parrot.sim.cluster.SimCluster.complete` (the OpenAI completion path, no Semantic-Variable structure:
the prefixes are shared but nobody declares them). Texts are seeded random words (``synth_text``), so prompts
share exactly the parts the generator shares. Sizes in simulator tokens (mean, sd) next to Table 1's:

    workload     prompt here (Table 1)        output here (Table 1)   sharing structure
    toolbench    ~1,750 (1,835 +- 742)        43 +- 16 (43 +- 16)      system prompt + one of T tool instructions
                                                                       (Zipf-1.1 popularity) + a unique query
    embodied     ~1,500-2,300 (2,285 +- 471)  16 +- 13 (16 +- 13)      per episode: instruction, then each step
                                                                       extends the context by an observation
    programming  ~2,300 (3,871 +- 1,656)      190 capped 400 (190+-343) shared demo prompt + problem, k parallel
                                                                       samples of each problem
    videoqa      ~3,000 (9,865 +- 5,976)      4 (4 +- 1.5)             a long unique video prefix, ~8 questions
    loogle       ~3,200 (23,474 +- 6,105)     16 +- 10 (16 +- 9.9)     13-token system prompt, document, ~8 questions

Videos and documents are cut to fit the LLaMA-7B cost models' 4,096-token window; with a model window of 16k or
more (Mistral-7B's 32k: ``window``) they keep Table 1's sizes (video 9,865 +- 5,976, document 23,474 +- 6,105,
capped below the window); everything else follows Table 1. ``scale`` multiplies every prompt size (not the outputs, not the sharing structure): the real-engine
benchmark runs the same shapes at a fraction of the length on a small CPU model. Arrivals: Poisson at ``rate``
requests/s, or ``bursty`` (on/off: 4x the rate for a quarter of each 10-second period, 0 otherwise; the same
mean). Programming's parallel samples and a video's / document's questions arrive as independent requests in the
stream (a step of an embodied episode arrives after the previous one, in stream order).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from parrot.workloads.arrivals import arrivals
from parrot.workloads.synth import synth_text

WORKLOADS = ("toolbench", "embodied", "programming", "videoqa", "loogle")


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt: str
    max_tokens: int
    group: str  # the sharing unit (tool, episode, problem, video, document) for reports


def _normal(rng: random.Random, mean: float, sd: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.gauss(mean, sd))))


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def _sizer(rng: random.Random, scale: float) -> Callable[[float, float, int, int], int]:
    """``size(mean, sd, low, high)``: a normal prompt-part size in tokens, all four scaled by ``scale``."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    return lambda mean, sd, low, high: _normal(rng, mean * scale, sd * scale, max(1, round(low * scale)),
                                               max(1, round(high * scale)))


def toolbench(n: int, rng: random.Random, *, tools: int = 40, zipf_s: float = 1.1,
              scale: float = 1.0) -> list[tuple[str, int, str]]:
    size = _sizer(rng, scale)
    system = "[toolbench] You are an agent that calls APIs. " + synth_text(max(1, round(250 * scale)), rng)
    instr = [f"[tool {k}] " + synth_text(size(1350, 600, 300, 3000), rng) for k in range(tools)]
    weights = _zipf_weights(tools, zipf_s)
    out = []
    for _ in range(n):
        k = rng.choices(range(tools), weights)[0]
        query = synth_text(size(120, 60, 20, 400), rng)
        out.append((f"{system}\n{instr[k]}\nQuery: {query}\nAnswer:", _normal(rng, 43, 16, 4, 128), f"tool{k}"))
    return out


def embodied(n: int, rng: random.Random, *, steps: int = 8, scale: float = 1.0) -> list[tuple[str, int, str]]:
    size = _sizer(rng, scale)
    out: list[tuple[str, int, str]] = []
    active: list[list] = []  # [episode id, context so far, steps left]
    ep = 0
    while len(out) < n:
        if len(active) < 12 or rng.random() < 0.15:
            ctx = f"[episode {ep}] You control a robot. " + synth_text(size(1500, 300, 800, 2200), rng)
            active.append([ep, ctx, rng.randint(3, steps)])
            ep += 1
        slot = rng.randrange(len(active))
        e = active[slot]
        e[1] += "\nObservation: " + synth_text(size(90, 30, 20, 200), rng) + "\nAction:"
        out.append((e[1], _normal(rng, 16, 13, 2, 64), f"ep{e[0]}"))
        e[1] += " " + synth_text(max(1, round(12 * scale)), rng)  # the action taken (the next prompt holds it)
        e[2] -= 1
        if e[2] == 0 or len(e[1].split()) > 2600 * scale:
            active.pop(slot)
    return out


def programming(n: int, rng: random.Random, *, samples: tuple[int, int] = (4, 8),
                scale: float = 1.0) -> list[tuple[str, int, str]]:
    size = _sizer(rng, scale)
    demo = "[apps] Here are example solutions. " + synth_text(max(1, round(1500 * scale)), rng)
    out: list[tuple[str, int, str]] = []
    p = 0
    while len(out) < n:
        problem = f"[problem {p}] " + synth_text(size(800, 400, 150, 1800), rng)
        for _ in range(rng.randint(*samples)):
            out.append((f"{demo}\n{problem}\nSolution:", _normal(rng, 190, 120, 20, 400), f"prob{p}"))
        p += 1
    rng.shuffle(out)  # the samples of one problem are spread over the stream (several users, parallel calls)
    return out[:n]


def _questions_on(prefix_of: Callable[[int], str], n: int, rng: random.Random, per: float, out_len: Callable[[], int],
                  tag: str, scale: float) -> list[tuple[str, int, str]]:
    size = _sizer(rng, scale)
    out: list[tuple[str, int, str]] = []
    d = 0
    while len(out) < n:
        prefix = prefix_of(d)
        for _ in range(max(1, round(rng.gauss(per, per / 3)))):
            out.append((f"{prefix}\nQuestion: {synth_text(size(20, 6, 5, 40), rng)}\nAnswer:", out_len(),
                        f"{tag}{d}"))
        d += 1
    rng.shuffle(out)
    return out[:n]


LONG_WINDOW = 16384  # a model window from which videos and documents keep Table 1's sizes (not cut to 4k)


def videoqa(n: int, rng: random.Random, *, scale: float = 1.0, window: int = 4096) -> list[tuple[str, int, str]]:
    size = _sizer(rng, scale)
    mean, sd, top = (9865, 5976, window - 256) if window >= LONG_WINDOW else (3000, 500, 3700)
    return _questions_on(lambda d: f"[video {d}] " + synth_text(size(mean, sd, 1500, top), rng),
                         n, rng, 8.6, lambda: 4, "video", scale)


def loogle(n: int, rng: random.Random, *, scale: float = 1.0, window: int = 4096) -> list[tuple[str, int, str]]:
    size = _sizer(rng, scale)
    system = "Answer the question about the document below."
    mean, sd, top = (23474, 6105, window - 256) if window >= LONG_WINDOW else (3200, 400, 3700)
    return _questions_on(lambda d: f"{system}\n[doc {d}] " + synth_text(size(mean, sd, 2000, top), rng),
                         n, rng, 8.0, lambda: _normal(rng, 16, 10, 2, 48), "doc", scale)


_GENERATORS: dict[str, Callable[..., list[tuple[str, int, str]]]] = {
    "toolbench": toolbench, "embodied": embodied, "programming": programming, "videoqa": videoqa, "loogle": loogle,
}


def workload(name: str, n: int, rate: float, seed: int = 0, pattern: str = "poisson",
             scale: float = 1.0, window: int = 4096) -> list[Request]:
    """``n`` requests of workload ``name`` (one of WORKLOADS) arriving at ``rate``/s, seeded; prompt sizes times
    ``scale``; ``window``: the model's context window (from LONG_WINDOW on, videos and documents keep Table 1's
    sizes; below, they are cut to fit 4k)."""
    gen = _GENERATORS.get(name)
    if gen is None:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    rng = random.Random(f"preble:{name}:{seed}")
    items = gen(n, rng, scale=scale, **({"window": window} if name in ("videoqa", "loogle") else {}))
    times = arrivals(len(items), rate, random.Random(f"arrivals:{name}:{seed}:{rate}:{pattern}"), pattern)
    return [Request(t, p, m, g) for t, (p, m, g) in zip(times, items)]
