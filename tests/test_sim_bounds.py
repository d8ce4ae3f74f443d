"""parrot.sim.bounds: the floors it divides by are lower bounds of what the simulated policies measure."""

from parrot.sim import bounds as B
from parrot.sim import experiments as X
from parrot.sim.cluster import ClusterConfig, SimCluster
from parrot.sim.cost_model import load_model
from parrot.sim.vloop import run_virtual


def test_no_policy_beats_the_chat_floor_or_the_map_reduce_alone_time():
    measured = X.mixed_results(quick=True)
    floor = load_model("llama7b-a6000").decode_s(1, 0)
    alone = min(B.map_reduce_alone(p, quick=True) for p in ("parrot", "fifo-throughput"))
    for policy, (chat_s_per_token, map_reduce_s, chats) in measured.items():
        assert chats >= 10
        assert chat_s_per_token > floor, policy
        assert map_reduce_s >= 0.95 * alone, policy  # serving chats beside the apps does not make them faster


def test_bounds_report_names_every_ratio_and_the_busy_share():
    text = B.bounds(quick=True)
    for row in ("chat vs fifo-latency", "chat vs fifo-throughput", "map-reduce vs fifo-latency",
                "map-reduce vs fifo-throughput", "busy share", "2023 scheduler",
                "Fig. 18 (8 files) vs latency-centric"):
        assert row in text


def test_the_2023_scheduler_reaches_every_simulated_engine():
    async def main():
        async with SimCluster(ClusterConfig(engines=2, cost_model="llama7b-a6000", chunked_prefill=False)) as c:
            return [e.scheduler.chunked_prefill for e in c.engines]

    assert run_virtual(main()) == [False, False]
    assert ClusterConfig().chunked_prefill is True
