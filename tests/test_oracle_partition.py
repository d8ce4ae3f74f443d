"""The oracle-partition baseline (Preble 5.2): key-portion groups dealt evenly to engines, requests follow their
group whatever the load, unknown requests go to the least loaded engine."""

from parrot.manager.policies.base import DispatchRequest, EngineLoad
from parrot.manager.policies.oracle import OraclePartitionPolicy, prompt_group_lookup


def _loads(*inflight: int) -> list[EngineLoad]:
    return [EngineLoad(name=f"e{i}", model="m", max_model_len=4096, status=None, inflight_requests=n,
                       inflight_tokens=100 * n) for i, n in enumerate(inflight)]


def _req(ids: tuple[int, ...]) -> DispatchRequest:
    return DispatchRequest(request_id=str(ids), prompt_token_ids=ids)


def test_groups_are_dealt_evenly_in_first_seen_order_and_stick_to_their_engine():
    groups = {(1, 2, 9): "tool-a", (1, 3, 9): "tool-b", (1, 4, 9): "tool-c", (1, 2, 8): "tool-a", (1, 5): "tool-d"}
    policy = OraclePartitionPolicy(prompt_group_lookup(groups))
    picks = [policy.choose(_req(ids), _loads(0, 0, 0)) for ids in [(1, 2, 9), (1, 3, 9), (1, 4, 9), (1, 5)]]
    assert picks == ["e0", "e1", "e2", "e0"]  # four layer nodes over three engines: dealt in turn
    # a later request of tool-a goes to e0 even when e0 is by far the most loaded (the oracle splits state, not load)
    assert policy.choose(_req((1, 2, 8)), _loads(50, 0, 0)) == "e0"
    assert policy.engine_of("tool-b") == "e1" and policy.engine_of("tool-z") is None


def test_unknown_requests_go_to_the_least_loaded_engine_and_lost_engines_are_redealt():
    policy = OraclePartitionPolicy(prompt_group_lookup({(7,): "doc-1"}))
    assert policy.choose(_req((9, 9)), _loads(3, 1, 2)) == "e1"
    assert policy.choose(DispatchRequest(request_id="sv"), _loads(0, 4, 4)) == "e0"  # no token ids: no group
    assert policy.choose(_req((7,)), _loads(0, 0, 0)) == "e0"
    survivors = _loads(0, 0, 0)[1:]  # e0 is gone: its group is dealt again, to a live engine
    assert policy.choose(_req((7,)), survivors) in {"e1", "e2"}
