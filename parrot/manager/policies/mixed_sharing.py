"""``--policy parrot`` (the default Parrot policy): Algorithm 1 where throughput work may *share* an engine running
latency work, with the engine keeping the latency work's step within a target, instead of a fixed *split*
(throughput work only on engines running none: ``--policy parrot-split``, :class:`SplitPolicy`, Algorithm 1 as the
paper states it). Per throughput request and latency engine:

    target    = step of the engine's latency work alone x (1 + share_slack)       (nothing measurable: 10 %)
    allowance = (target - step alone - the rows the throughput work decodes there) / prefill_token_s
                prompt tokens per iteration the throughput work may add (the engine enforces it: OpHint.tpot_s,
                parrot.engine.scheduler.step_budget, learned from its measured steps)
    share  iff  allowance >= min_share_tokens  and  the request finishes there no later than on the best engine
                running no latency work: prompt at allowance tokens per target-long step, then its decode steps

Every latency request placed by this policy carries its engine's target to the engine (``Placement.tpot_s`` ->
``OpHint.tpot_s``; an explicit TPOT target of the request wins), so on whatever engine throughput work meets it, the
engine's iterations stay within it. With GPU cost models whose terms add (the roofline as a sum: every prompt
token costs a decode row's 0.145 ms over a 25 ms step), 10 % of a chat's step is ~17 tokens and the split stands;
where decode iterations leave compute idle (a max() roofline: prompt tokens ride free up to the ridge point) the
allowance is hundreds of tokens and the maps fill what the chats leave. Engines with no latency work are chosen as
in Algorithm 1, and an engine running latency work stays a latency engine while throughput work shares it (chats
keep to it, not spreading onto the map engines). Each evaluation is counted (``decision_counts``: ``share`` /
``split``, in ``/api/v1/stats`` beside E2's) and logged at DEBUG with the allowance and both finish times.
Measurements (simulator Fig. 19, the real CPU cluster): docs/results/simulator.md, docs/results/README.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence

from parrot.manager.policies.base import (
    ClusterView,
    Demand,
    DispatchRequest,
    Occupancy,
    Placement,
    QueuedRequest,
    WorkKind,
)
from parrot.manager.policies.cost_aware import CostLedger
from parrot.manager.policies.parrot_policy import AppCentricWithE2

log = logging.getLogger(__name__)

SHARE_SLACK = 0.10  # the latency work's step may grow by this share while throughput work rides in it
MIN_SHARE_TOKENS = 32  # an allowance below this is not worth a latency engine's KV and decode rows


class SharingPolicy(AppCentricWithE2):
    name = "parrot"

    def __init__(self, *args, share_slack: float = SHARE_SLACK, min_share_tokens: int = MIN_SHARE_TOKENS,
                 **kw) -> None:
        if not share_slack > 0:
            raise ValueError(f"share_slack must be > 0, got {share_slack!r}")
        if min_share_tokens < 1:
            raise ValueError(f"min_share_tokens must be >= 1, got {min_share_tokens!r}")
        super().__init__(*args, **kw)
        self.share_slack = share_slack
        self.min_share_tokens = min_share_tokens
        self._decisions = {"share": 0, "split": 0}
        self._shared: set[str] = set()  # this round: latency engines throughput work may share

    def decision_counts(self) -> dict[str, int]:
        return {**super().decision_counts(), **self._decisions}

    # ---- latency work carries its engine's target -------------------------------------------------------------
    def place(self, queue: Sequence[QueuedRequest], cluster: ClusterView) -> list[Placement]:
        queued = {q.ticket: q for q in queue}
        placed = super().place(queue, cluster)
        before = CostLedger(cluster, Occupancy(cluster))  # the latency work placed in earlier rounds
        return [self._targeted(p, queued[p.ticket], cluster, before) for p in placed]

    def _targeted(self, p: Placement, q: QueuedRequest, cluster: ClusterView, before: CostLedger) -> Placement:
        """``p`` with its engine's step target if ``q`` is latency work without a TPOT target of its own (the
        dispatcher passes an explicit one on as it is): one step of the latency work placed there in earlier
        rounds and ``q`` (Algorithm 1's and E2's placements alike), times 1 + share_slack."""
        if p.tpot_s is not None or q.info.targets.tpot_s is not None or \
                self._demand(q, cluster).kind is not WorkKind.LATENCY:
            return p
        step = self.latency_step_s(p.engine, before, q.request)
        return dataclasses.replace(p, tpot_s=None if step is None else step * (1 + self.share_slack))

    @staticmethod
    def latency_step_s(engine: str, ledger: CostLedger, joining: DispatchRequest | None = None) -> float | None:
        """One decode step of ``engine``'s latency work alone (its rows over their whole contexts; plus
        ``joining``, not in the ledger), or None if there is none or the step cost is unknown."""
        cost, lat = ledger.cost(engine), ledger.latency[engine]
        rows, tokens = lat.rows, lat.tokens
        if joining is not None:
            rows, tokens = rows + 1, tokens + joining.tokens
        if cost is None or rows == 0:
            return None
        return cost.step_s(rows, tokens)

    # ---- throughput work: share or split ------------------------------------------------------------------------
    def allowance(self, engine: str, m: QueuedRequest, occ: Occupancy, ledger: CostLedger) -> float:
        """Prompt tokens per iteration throughput request ``m`` may add on latency engine ``engine`` (module
        docstring); 0 if the step cost is unknown."""
        cost, step = ledger.cost(engine), self.latency_step_s(engine, ledger)
        if cost is None or step is None or cost.prefill_token_s <= 0:
            return 0.0
        # what the engine's other work and ``m`` add to each step as decode rows over their contexts (everything
        # placed there, over ``m``'s decode steps, beyond the latency work alone)
        rows, tokens = ledger.batch(engine, m.request.max_new_tokens)
        riding = max(0.0, cost.step_s(round(rows) + 1, int(tokens) + occ.extra_tokens(engine, [m.request])) - step)
        return max(0.0, (step * self.share_slack - riding) / cost.prefill_token_s)

    def shared_finish_s(self, engine: str, m: QueuedRequest, occ: Occupancy, ledger: CostLedger,
                        allowance: float) -> float:
        """When ``m`` would finish on latency engine ``engine``: the prompt tokens pending there and its own at
        ``allowance`` per target-long step, then its decode steps at the target."""
        step = self.latency_step_s(engine, ledger)
        assert step is not None and allowance > 0
        target = step * (1 + self.share_slack)
        prompt = max(0, occ.extra_tokens(engine, [m.request]) - m.request.max_new_tokens)
        return (ledger.prefill[engine] + prompt) / allowance * target + m.request.max_new_tokens * target

    def throughput_pool(self, m: QueuedRequest, names: Collection[str], free: Collection[str], occ: Occupancy,
                        ledger: CostLedger) -> list[str]:
        pool = super().throughput_pool(m, names, free, occ, ledger)
        self._shared.clear()
        if not free:
            return pool  # every candidate runs latency work: Algorithm 1 already uses them (rule c)
        best_free = min((ledger.finish_s(e, m.request.max_new_tokens, 1, occ.extra_tokens(e, [m.request]),
                                         max(0, occ.extra_tokens(e, [m.request]) - m.request.max_new_tokens))
                         for e in free if ledger.cost(e) is not None), default=None)
        for e in sorted(set(names) - set(free)):
            allowance = self.allowance(e, m, occ, ledger)
            shared = None if allowance < self.min_share_tokens else self.shared_finish_s(e, m, occ, ledger,
                                                                                        allowance)
            share = shared is not None and (best_free is None or shared <= best_free)
            self._decisions["share" if share else "split"] += 1
            log.debug("%s %s on %s: allowance %.0f tokens/step, finish shared %s / best free %s",
                      "share" if share else "split", m.request.request_id, e, allowance,
                      "-" if shared is None else f"{shared:.3f} s", "-" if best_free is None else f"{best_free:.3f} s")
            if share:
                pool.append(e)
                self._shared.add(e)
        return pool

    def throughput_room(self, e: str, m: QueuedRequest, d: Demand, extra: int, occ: Occupancy,
                        ledger: CostLedger) -> bool:
        """On a shared latency engine the engine's step budget, not the latency cap, bounds the throughput work
        (its room is the KV); elsewhere as in Algorithm 1 (``parrot-split``)."""
        if e not in self._shared:
            return super().throughput_room(e, m, d, extra, occ, ledger)
        kv = occ.cluster.engines[e].capacity_tokens
        return kv is None or occ.tokens[e] + extra <= kv

    def _latency_engines(self, q: QueuedRequest, throughput: set[str], occ: Occupancy,
                         cluster: ClusterView) -> tuple[str, ...]:
        """As in Algorithm 1 (``parrot-split``), except that an engine running latency work stays a latency engine
        when throughput work shares it: the chats keep to the engines they hold (their step targets protect them
        there) instead of spreading onto the map engines."""
        shared = {e for e in throughput if WorkKind.LATENCY in occ.kinds[e]}
        return super()._latency_engines(q, throughput - shared, occ, cluster)


class SplitPolicy(AppCentricWithE2):
    """``--policy parrot-split``: Algorithm 1's fixed split (throughput work only on engines running no latency work
    while there are any; latency work carries no step target). The ablation of :class:`SharingPolicy`."""

    name = "parrot-split"
