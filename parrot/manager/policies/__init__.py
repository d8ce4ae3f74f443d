"""Global scheduling policies, selectable per server (``parrot serve --policy NAME``).

``parrot`` is the paper's application-centric Algorithm 1 (with Preble's E2 for requests without Semantic-Variable
structure) in which throughput work may ride on an engine running latency work, under the step target that
latency work carries to its engine, when that costs it nothing measurable (:mod:`.mixed_sharing`);
``parrot-split`` is Algorithm 1's fixed split (the ablation); ``e2`` is Preble's E2 for every request
(prefix-aware by token ids, :mod:`.e2`); ``round-robin`` is the data-parallel baseline of Preble §5.2;
``fifo-latency`` and ``fifo-throughput`` are the request-centric baselines of §8.1 (same code path, FIFO +
least-queue + one token cap); ``least-loaded`` dispatches at once without caps.
"""

from __future__ import annotations

from collections.abc import Callable

from parrot.manager.policies.app_centric import AppCentricPolicy
from parrot.manager.policies.base import (
    CapacityConfig,
    ClusterView,
    Demand,
    DispatchRequest,
    EngineLoad,
    EngineView,
    Occupancy,
    PerRequestPolicy,
    Placement,
    PlacedRequest,
    Policy,
    PrefixLookup,
    QueuedRequest,
    WorkKind,
)
from parrot.manager.policies.baseline import FifoPolicy, LeastLoadedPolicy, RoundRobinPolicy
from parrot.manager.policies.e2 import E2Config, E2Policy
from parrot.manager.policies.mixed_sharing import SharingPolicy, SplitPolicy
from parrot.manager.policies.parrot_policy import AppCentricWithE2

_FACTORIES: dict[str, Callable[[CapacityConfig], Policy]] = {
    # Algorithm 1, throughput work sharing latency engines under the engines' step budget (mixed_sharing)
    "parrot": lambda caps: SharingPolicy(caps, share_slack=caps.share_slack),
    "parrot-split": lambda caps: SplitPolicy(caps),  # Algorithm 1's fixed split (the ablation of sharing)
    "parrot-no-task-groups": lambda caps: SharingPolicy(caps, share_slack=caps.share_slack,
                                                        task_groups=False),  # an ablation (Fig. 18)
    "fifo-latency": lambda caps: FifoPolicy(caps.latency_cap_tokens, name="fifo-latency"),
    "fifo-throughput": lambda caps: FifoPolicy(caps.throughput_cap_tokens, name="fifo-throughput"),
    "least-loaded": lambda caps: LeastLoadedPolicy(),
    "e2": lambda caps: E2Policy(),
    "round-robin": lambda caps: RoundRobinPolicy(),
}
POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_policy(name: str, caps: CapacityConfig | None = None) -> Policy:
    """The policy called ``name`` (one of POLICY_NAMES); ValueError naming the known ones otherwise."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    return factory(caps or CapacityConfig())


__all__ = [
    "POLICY_NAMES", "AppCentricPolicy", "AppCentricWithE2", "E2Config", "E2Policy", "RoundRobinPolicy",
    "SharingPolicy", "SplitPolicy", "CapacityConfig", "ClusterView", "Demand", "DispatchRequest", "EngineLoad",
    "EngineView", "FifoPolicy", "LeastLoadedPolicy", "Occupancy", "PerRequestPolicy", "Placement", "PlacedRequest",
    "Policy", "PrefixLookup", "QueuedRequest", "WorkKind", "make_policy",
]
