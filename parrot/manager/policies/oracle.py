"""Preble §5.2's second baseline, *oracle partition*: the prefix tree is partitioned offline, by someone who has
seen the whole workload, at its key-portion layer, and each part is pinned to one engine.

Preble builds it by ensembling every request of a workload into one prefix tree, picking by hand the layer of
nodes that carries the workload's key portion (the tool instruction, the video, the document, the problem, the
episode's instruction) and splitting that layer evenly over the K data-parallel engines. Here the offline
knowledge is a function from a request to its node in that layer (its *group*); the groups are dealt to the
engines in order of first appearance, one each in turn, so every engine gets the same number of layer nodes::

    layer nodes (groups) in first-seen order:   tool-7  tool-2  tool-9  tool-4  tool-1 ...
    engines (sorted names), dealt in turn:      e0      e1      e2      e3      e0     ...

Every request of a group then goes to its group's engine, whatever the load (the oracle splits the *state* evenly,
not the load: a popular tool or a long video makes its engine the hot one, which is the baseline's known weakness,
Preble §5.2). Requests without a group (the oracle did not see them) go to the least loaded engine. Each engine
keeps its own prefix cache. The policy needs that offline knowledge, so it is built by benchmarks, not chosen by
name on the command line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from parrot.manager.policies.base import DispatchRequest, EngineLoad, PerRequestPolicy


class OraclePartitionPolicy(PerRequestPolicy):
    """Every request of a key-portion group on the engine its group was dealt to (see the module docstring)."""

    name = "oracle-partition"

    def __init__(self, group_of: Callable[[DispatchRequest], str | None]) -> None:
        self.group_of = group_of
        self._owner: dict[str, str] = {}  # group -> engine it was dealt to
        self._dealt = 0  # groups dealt so far (the next one goes to engine number _dealt mod K)
        self.num_unknown = 0  # requests the oracle had no group for (placed by load)

    def choose(self, request: DispatchRequest, candidates: Sequence[EngineLoad]) -> str:
        group = self.group_of(request)
        names = sorted(c.name for c in candidates)
        if group is None:
            self.num_unknown += 1
            return min(candidates, key=lambda c: (c.inflight_requests, c.inflight_tokens, c.name)).name
        owner = self._owner.get(group)
        if owner is None or owner not in names:  # a new group, or its engine is gone: deal it to the next engine
            owner = self._owner[group] = names[self._dealt % len(names)]
            self._dealt += 1
        return owner

    @property
    def num_groups(self) -> int:
        """Key-portion groups dealt so far."""
        return len(self._owner)

    def engine_of(self, group: str) -> str | None:
        """The engine ``group`` was dealt to (None before its first request)."""
        return self._owner.get(group)


def prompt_group_lookup(groups: dict[tuple[int, ...], str]) -> Callable[[DispatchRequest], str | None]:
    """``group_of`` for requests known offline by their prompt token ids (the benchmark's ensembled workload)."""

    def group_of(request: DispatchRequest) -> str | None:
        ids = request.prompt_token_ids
        return groups.get(tuple(ids)) if ids is not None else None

    return group_of
