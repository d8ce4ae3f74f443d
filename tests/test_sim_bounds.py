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


def test_the_joint_bound_gives_fewer_engines_no_speedup_and_prints():
    measured = X.mixed_results(quick=True)
    pts = B.fig19_joint_points(measured, quick=True)
    chat4, map4 = pts["separate"]
    rows = {k: (chat, mr) for k, chat, mr in pts["rows"]}
    assert set(rows) == {0, 1, 2, 3}
    # the apps on 3 engines (k = 1) are not faster than on all 4; nor on 2 or 1
    assert rows[1][1] >= map4
    assert rows[3][1] >= map4 and rows[2][1] >= map4
    # the chats on fewer engines are not faster than on 4
    assert min(pts["chat"][k] for k in (1, 2, 3)) >= chat4 > 0
    assert rows[1][0] == pts["chat"][1] and map4 == pts["apps"][4]
    text = B.fig19_joint(measured, quick=True, points=pts)
    for piece in ("[joint bound, Fig. 19]", "0 (shared", "1 (apps on 3)", "2 (apps on 2)", "3 (apps on 1)",
                  "measured parrot (shared 4)", "is closest to row k =", "90 % / 90 %"):
        assert piece in text, piece
