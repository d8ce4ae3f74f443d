"""``--policy parrot-share``: Algorithm 1 (the ``parrot`` policy) with one more choice for throughput work while
latency work runs: *share* an engine running latency work, or keep the *split* (throughput work only on engines
running none). The choice is made per throughput request and per latency engine from the engine's step cost:

    share  iff  predicted step of the latency work with the request riding in its batch  <=  its step target

    predicted step = step_s(rows + 1, ctx + tokens(r), prefill = prompt(r))   the iteration that carries r's
                     (rows, ctx: the engine's work over the latency requests'   prompt next to the latency
                      remaining steps, CostLedger.batch; pending prefill        requests' decode rows
                      spread over those steps on top)
    step target    = CostLedger.budget_s: the engine filled with its latency work up to its latency cap (what
                     the cap means, paper §8.1: the running tokens at which latency reaches its limit)

A request's whole prompt is counted in the one iteration that carries it (the manager cannot split it into
per-iteration chunks; the engine's chunked prefill may spread it, which only lowers the step). With GPU cost
models a decode row is cheap next to the weights' stream, but every prompt token costs the same as a decode row,
so a map stage's prompts (~1k tokens) exceed a chat's step target and the split stands; decode-heavy work with
short prompts shares. Engines with no latency work are chosen as in Algorithm 1, and an engine running latency
work stays a latency engine while throughput work shares it (chats keep to it, not spreading onto the map
engines). Each evaluation (one per throughput request, latency engine and scheduling round) is counted
(``decision_counts``: ``share`` / ``split``, in ``/api/v1/stats`` beside E2's) and logged at DEBUG with the
predicted step and the target. Not the default: docs/results/simulator.md (Fig. 19) has its measurements.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from parrot.manager.policies.base import ClusterView, Occupancy, QueuedRequest, WorkKind
from parrot.manager.policies.cost_aware import CostLedger
from parrot.manager.policies.parrot_policy import AppCentricWithE2

log = logging.getLogger(__name__)


class SharingPolicy(AppCentricWithE2):
    name = "parrot-share"

    def __init__(self, *args, target_scale: float = 1.0, **kw) -> None:
        """``target_scale``: the step target as a multiple of the latency budget (1: the cap's step time; above 1
        trades the latency work's step for throughput, a measurement knob for the share-vs-split frontier)."""
        if not target_scale > 0:
            raise ValueError(f"target_scale must be > 0, got {target_scale!r}")
        super().__init__(*args, **kw)
        self.target_scale = target_scale
        self._decisions = {"share": 0, "split": 0}

    def decision_counts(self) -> dict[str, int]:
        return {**super().decision_counts(), **self._decisions}

    def throughput_pool(self, m: QueuedRequest, names: Collection[str], free: Collection[str], occ: Occupancy,
                        ledger: CostLedger) -> list[str]:
        pool = super().throughput_pool(m, names, free, occ, ledger)
        if not free:
            return pool  # every candidate runs latency work: Algorithm 1 already uses them (rule c)
        for e in sorted(set(names) - set(free)):
            step, target = self.shared_step_s(e, m, occ, ledger)
            share = target is not None and step <= target * self.target_scale
            self._decisions["share" if share else "split"] += 1
            log.debug("%s %s on %s: predicted latency step %.1f ms, target %s", "share" if share else "split",
                      m.request.request_id, e, step * 1e3,
                      "none" if target is None else f"{target * self.target_scale * 1e3:.1f} ms")
            if share:
                pool.append(e)
        return pool

    def _latency_engines(self, q: QueuedRequest, throughput: set[str], occ: Occupancy,
                         cluster: ClusterView) -> tuple[str, ...]:
        """As in ``parrot``, except that an engine running latency work stays a latency engine when throughput
        work shares it: the chats keep to the engines they hold instead of spreading onto the map engines."""
        shared = {e for e in throughput if WorkKind.LATENCY in occ.kinds[e]}
        return super()._latency_engines(q, throughput - shared, occ, cluster)

    @staticmethod
    def shared_step_s(engine: str, m: QueuedRequest, occ: Occupancy, ledger: CostLedger) -> tuple[float, float | None]:
        """(predicted step of ``engine``'s latency work with ``m`` riding in its batch, the latency work's step
        target or None if it has none or the cost is unknown); see the module docstring."""
        cost, lat = ledger.cost(engine), ledger.latency[engine]
        target = ledger.budget_s(engine, lat)
        if cost is None or target is None:
            return 0.0, None
        r = m.request
        extra = occ.extra_tokens(engine, [r])
        prompt = max(0, extra - r.max_new_tokens)
        steps = max(1.0, lat.new_tokens / lat.rows)
        rows, tokens = ledger.batch(engine, steps)
        step = cost.step_s(round(rows) + 1, int(tokens) + extra, prompt) + cost.prefill_token_s * ledger.prefill[
            engine] / steps
        return step, target
