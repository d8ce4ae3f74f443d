"""Engine (local) scheduling policies, selectable per engine (``parrot serve --engine-policy NAME``,
``EngineSettings.engine_policy``, ``SimEngine(engine_policy=NAME)``). No torch.

A policy orders the engine's waiting queue and decides how a context paused for a tool call keeps its KV
(:class:`~.base.EnginePolicy`); the scheduler keeps the budgets, the KV and preemption. By name::

    name         admission order                                   paused context's KV
    fcfs         arrival (service order)                           preserved
    preble       Preble's priority groups by cached ratio (§4.3)   preserved
    lamps        LAMPS' memory over time, starving first (§4.3-4.4) predicted at queueing (LAMPS §4.2)
    lamps-request  as lamps, over the request's remaining segments,    as lamps  (``OpHint.later`` / ``elapsed_s``;
                 aged by the request's start                                  LAMPS §6)
    lamps-fcfs   arrival                                           predicted at queueing (the "handling only" ablation)
    infercept    arrival                                           least waste at the pause (INFERCEPT)
    discard      arrival                                           discarded, recomputed on return (vLLM)
    preserve     arrival                                           preserved (= fcfs, the tool benchmark's name)

``lamps`` is the builtin engine's default; the simulator's is ``fcfs``. Adding a policy: one module with an
:class:`~.base.EnginePolicy` subclass, and one entry in :data:`ENGINE_POLICIES`.
"""

from __future__ import annotations

from collections.abc import Callable

from parrot.engine.scheduler.policies.base import EnginePolicy, EnginePolicyConfig, EngineView
from parrot.engine.scheduler.policies.fcfs import FcfsDiscard, FcfsLeastWaste, FcfsPredicted, FcfsPreserve, FcfsSwap
from parrot.engine.scheduler.policies.lamps import LampsPolicy
from parrot.engine.scheduler.policies.lamps_request import LampsRequestPolicy
from parrot.engine.scheduler.policies.preble import PreblePreserve

EnginePolicyFactory = Callable[[str, EnginePolicyConfig], EnginePolicy]

# name -> factory(name, config); a fresh policy per engine (a policy may keep per-op state)
ENGINE_POLICIES: dict[str, EnginePolicyFactory] = {
    "fcfs": lambda name, cfg: FcfsPreserve(name),
    "preble": lambda name, cfg: PreblePreserve(name, cfg.priority_groups),
    "lamps": lambda name, cfg: LampsPolicy(name, cfg.starvation_threshold, cfg.refresh_interval),
    "lamps-request": lambda name, cfg: LampsRequestPolicy(name, cfg.starvation_threshold, cfg.refresh_interval),
    "lamps-fcfs": lambda name, cfg: FcfsPredicted(name),
    "infercept": lambda name, cfg: FcfsLeastWaste(name),
    "discard": lambda name, cfg: FcfsDiscard(name),
    "preserve": lambda name, cfg: FcfsPreserve(name),
}


def engine_policy_names() -> tuple[str, ...]:
    """The names :func:`make_engine_policy` knows now."""
    return tuple(ENGINE_POLICIES)


def make_engine_policy(name: str, config: EnginePolicyConfig | None = None) -> EnginePolicy:
    """A fresh policy called ``name``; ValueError naming the known ones otherwise."""
    factory = ENGINE_POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown engine policy {name!r} (known: {', '.join(ENGINE_POLICIES)})")
    return factory(name, config or EnginePolicyConfig())


__all__ = ["ENGINE_POLICIES", "EnginePolicy", "EnginePolicyConfig", "EnginePolicyFactory", "EngineView",
           "FcfsSwap", "engine_policy_names", "make_engine_policy"]
