"""Preble §5.3's mixed workload: request arrivals from the Azure LLM inference trace (2023), each one a request of
the Tool workload (the trace's *code* requests) or of the VideoQA workload (its *conversation* requests).

The trace gives, per request, only its arrival time, prompt tokens and output tokens (no content), so Preble keeps
its arrival times (inter-arrivals scaled by 0.7 to load its cluster harder) and fills each arrival with a sampled
request of the workload that resembles that kind of use: Tool for code (similar prompt-to-output ratio, users ask
questions about a shared context), VideoQA for conversation. The same here, with a ``time_scale`` knob.

The shipped excerpt (``data/azure_llm_trace_2023_excerpt.csv``) is the first 300 s of the trace from the first
code request on (2023-11-16 18:17:03.98 UTC): 781 code and 1,519 conversation requests, times relative to that
start. Source: Azure/AzurePublicDataset, ``data/AzureLLMInferenceTrace_{code,conv}.csv`` (Patel et al.,
"Splitwise", ISCA 2024), licensed CC BY 4.0; only the rows of that window, unchanged except for the time base.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

from parrot.workloads.preble import Request, toolbench, videoqa

EXCERPT = Path(__file__).resolve().parent / "data" / "azure_llm_trace_2023_excerpt.csv"
KINDS = ("code", "conv")


@dataclass(frozen=True)
class TraceRow:
    t_s: float  # arrival, seconds after the excerpt's start
    kind: str  # "code" | "conv"
    context_tokens: int
    generated_tokens: int


def load_trace(path: Path = EXCERPT) -> list[TraceRow]:
    """The trace rows in arrival order; ValueError naming the row of a malformed file."""
    rows: list[TraceRow] = []
    with open(path, newline="", encoding="utf-8") as f:
        for i, r in enumerate(csv.DictReader(f), start=2):
            try:
                row = TraceRow(float(r["t_s"]), r["kind"], int(r["context_tokens"]), int(r["generated_tokens"]))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{i}: malformed trace row {r!r} ({e})") from None
            if row.kind not in KINDS or row.t_s < 0:
                raise ValueError(f"{path}:{i}: kind must be one of {KINDS} and t_s >= 0, got {r!r}")
            rows.append(row)
    rows.sort(key=lambda r: r.t_s)
    return rows


def azure_mixed(n: int, seed: int = 0, *, time_scale: float = 0.7, scale: float = 1.0,
                trace: list[TraceRow] | None = None) -> list[Request]:
    """The first ``n`` arrivals of the trace, inter-arrivals times ``time_scale`` (Preble: 0.7), code arrivals
    filled with Tool requests and conversation arrivals with VideoQA requests (prompt sizes times ``scale``);
    each request's ``group`` is its tool / video, prefixed by the trace kind."""
    if n < 1 or not time_scale > 0:
        raise ValueError(f"n must be >= 1 and time_scale > 0, got n={n!r}, time_scale={time_scale!r}")
    rows = (trace if trace is not None else load_trace())[:n]
    if len(rows) < n:
        raise ValueError(f"the trace has {len(rows)} arrivals, fewer than the {n} asked for")
    counts = {k: sum(1 for r in rows if r.kind == k) for k in KINDS}
    rng = random.Random(f"azure:{seed}")
    fill = {"code": iter(toolbench(counts["code"], rng, scale=scale) if counts["code"] else ()),
            "conv": iter(videoqa(counts["conv"], rng, scale=scale) if counts["conv"] else ())}
    out = []
    for r in rows:
        prompt, max_tokens, group = next(fill[r.kind])
        out.append(Request(r.t_s * time_scale, prompt, max_tokens, f"{r.kind}:{group}"))
    return out
