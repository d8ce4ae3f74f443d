"""The statistics the real-engine tool benchmark (:mod:`parrot.bench.tool_bench`) reports per run: latency and
TTFT means and nearest-rank p99s, and each policy's ratios to a baseline policy. Pure Python: no server, no torch.
The requests themselves are :mod:`parrot.workloads.tools`' CPU-scale agent episodes.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from parrot.common.report import p99


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
