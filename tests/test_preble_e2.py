"""Preble E2 (parrot.manager.policies.e2 / radix): the tree, each algorithm step on hand-built trees and cluster
states, eviction notices, round-robin and the policy-name plumbing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parrot.common.step_cost import StepCost
from parrot.protocol.interface import EngineStatus
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.protocol.block_hashes import chain_hashes
from parrot.manager.manager import ManagerConfig
from parrot.manager.perf_deduction import SchedInfo
from parrot.manager.policies import POLICY_NAMES, AppCentricWithE2, E2Config, E2Policy, RoundRobinPolicy, make_policy
from parrot.manager.policies.base import ClusterView, DispatchRequest, EngineLoad, EngineView, PlacedRequest, \
    QueuedRequest, Demand, WorkKind
from parrot.manager.policies.e2 import _History
from parrot.manager.policies.radix import RadixTree

COST = StepCost(base_s=0.02, decode_row_s=1e-4, decode_ctx_s=1e-6, prefill_token_s=1e-3)
OFF = E2Config(rebalance=False, replicate=False, pd_balance=False)


def view(names=("a", "b"), capacity=10_000, placed=None, status=None, cost=COST, now=0.0) -> ClusterView:
    placed = placed or {}
    status = status or {}
    return ClusterView({n: EngineView(n, "m", 4096, status.get(n), capacity, tuple(placed.get(n, ())), step_cost=cost)
                        for n in names}, now=now)


def req(rid: str, toks, out: int = 10) -> DispatchRequest:
    toks = tuple(toks)
    return DispatchRequest(rid, prompt_tokens=len(toks), max_new_tokens=out, prompt_token_ids=toks)


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


SYS = seq(1000, 100)


# ---- the radix tree ----------------------------------------------------------------------------------------------
def test_tree_insert_split_match_and_hits():
    t = RadixTree(window_s=10)
    p1 = t.insert(SYS + seq(0, 20))
    assert [n.num_tokens for n in p1] == [120]
    p2 = t.insert(SYS + seq(50, 30))
    assert [n.num_tokens for n in p2] == [100, 30] and p1[0].start == 100 and p1[0].parent is p2[0]
    t.record(p2, "a", now=0.0)
    path, matched = t.match(SYS + seq(50, 10) + [7])
    assert matched == 110 and [n.num_tokens for n in path] == [100, 30]  # the last node matched in part
    assert t.cached_len(path, "a", matched) == 110 and t.cached_len(path, "b", matched) == 0
    assert p2[0].hits == {"a": 1} and t.cached_tokens["a"] == 130


def test_tree_window_expiry_prunes_unheld_unused_nodes():
    t = RadixTree(window_s=10)
    path = t.insert(SYS + seq(0, 20))
    t.record(path, "a", now=0.0)
    t.evict(path[0], "a")  # no longer held, still hit within the window: kept
    assert t.root.children
    t.expire(now=5.0)
    assert t.root.children
    t.expire(now=11.0)  # hit expired and held nowhere: pruned
    assert not t.root.children and t.num_nodes == 1


def test_tree_split_keeps_hits_for_expiry():
    t = RadixTree(window_s=10)
    p = t.insert(SYS + seq(0, 20))
    t.record(p, "a", now=0.0)
    t.insert(SYS + seq(500, 5))  # splits the recorded node: the upper half inherits its hit
    upper = t.root.children[SYS[0]]
    assert upper.num_tokens == 100 and upper.hits == {"a": 1}
    t.expire(now=20.0)
    assert upper.hits == {} and p[0].hits == {}


def test_lru_emulation_evicts_leaves_before_prefixes():
    t = RadixTree()
    a = t.insert(SYS + seq(0, 50))
    t.record(a, "e", now=0.0)
    b = t.insert(SYS + seq(200, 50))
    t.record(b, "e", now=1.0)
    leaf_a = a[0]  # split by b's insertion: it keeps the tail (SYS became a new parent)
    assert leaf_a.num_tokens == 50 and leaf_a.parent is b[0]
    victims = t.lru_victims("e", 40)
    assert victims == [leaf_a]  # the older leaf, never the shared system prompt before its children
    dropped = t.evict_lru("e", capacity_tokens=160)
    assert dropped == 50 and "e" not in leaf_a.engines and "e" in b[0].engines


# ---- exploit vs explore ----------------------------------------------------------------------------------------
def test_explore_picks_lowest_cost_then_exploit_follows_the_cache():
    p = E2Policy(OFF)
    c = view()
    d1 = p.choose(req("r1", SYS + seq(0, 20)), ["a", "b"], c)
    assert d1.kind == "explore" and d1.engine == "a"  # equal costs: by name
    d2 = p.choose(req("r2", SYS + seq(300, 20)), ["a", "b"], c)
    assert d2.kind == "exploit" and d2.engine == "a" and d2.cached == 100  # 100 cached > 20 missed
    d3 = p.choose(req("r3", SYS[:30] + seq(600, 80)), ["a", "b"], c)
    assert d3.kind == "explore"  # 30 cached < 80 missed: load decides
    assert d3.engine == "b"  # a carries the history load (L) of r1, r2


def test_exploit_chooses_among_key_node_holders_by_cost():
    p = E2Policy(OFF)
    c = view(("a", "b", "c"))
    for e in ("a", "b"):  # both hold the system prompt
        path = p.tree.insert(SYS)
        p.tree.record(path, e, now=0.0)
    p._history["a"] = _History()
    p._history["a"].add(0.0, 500, 10, 510)  # a is loaded
    d = p.choose(req("r", SYS + seq(0, 10)), ["a", "b", "c"], c)
    assert d.kind == "exploit" and d.engine == "b"
    assert set(d.costs) == {"a", "b"}  # only the holders of the key node were costed


# ---- the cost terms ----------------------------------------------------------------------------------------------
def test_load_cost_L_is_history_prefill_plus_decode():
    p = E2Policy(OFF)
    c = view()
    p.choose(req("r1", seq(0, 200), out=40), ["a"], c)
    # one request: prefill 200 missed tokens + 40 decode iterations of it at context 200 + 20 (the paper's DT_r)
    expect = 200 * COST.prefill_token_s + 40 * (COST.base_s + COST.decode_row_s + COST.decode_ctx_s * 220)
    assert p.load(c, "a") == pytest.approx(expect)
    marginal = E2Policy(replace(OFF, decode_cost="marginal"))  # what one more row adds to iterations run anyway
    marginal.choose(req("r1", seq(0, 200), out=40), ["a"], c)
    assert marginal.load(c, "a") == pytest.approx(expect - 40 * COST.base_s)
    assert p.load(c, "b") == 0.0
    p.sync(view(now=100.0))  # outside the window (60 s): forgotten
    assert p.load(c, "a") == 0.0


def test_eviction_cost_M_counts_evicted_nodes_times_sharers():
    p = E2Policy(OFF)
    c = view(capacity=300)
    for i in range(3):  # three requests share SYS on a: hits 3
        p.choose(req(f"r{i}", SYS + seq(100 * i, 10)), ["a"], c)
    assert p.tree.cached_tokens["a"] == 130
    # a request of 250 new tokens needs 130 + 250 - 300 = 80 tokens freed: the three 10-token leaves (1 hit each)
    # then SYS (3 hits)
    m = p.eviction_cost(c, "a", 250, ())
    assert m == pytest.approx(COST.prefill_token_s * (3 * 10 * 1 + 100 * 3))
    assert p.eviction_cost(c, "a", 100, ()) == pytest.approx(0.0)  # fits: nothing evicted
    assert p.eviction_cost(c, "b", 250, ()) == 0.0


def test_prefill_cost_P_counts_only_missed_tokens():
    p = E2Policy(OFF)
    c = view()
    path = p.tree.insert(SYS)
    p.tree.record(path, "a", now=0.0)
    n = len(SYS) + 50
    assert p.total_cost(c, "a", n, 100, path) == pytest.approx(50 * COST.prefill_token_s)
    assert p.total_cost(c, "b", n, 0, path) == pytest.approx(150 * COST.prefill_token_s)


# ---- post-assignment adjustments --------------------------------------------------------------------------------
def test_rebalancing_redirects_exploit_traffic_from_a_heavy_engine():
    p = E2Policy(E2Config(replicate=False, pd_balance=False, min_window_requests=2, th_bal=1.5))
    c = view()
    for i in range(4):  # a holds SYS; its history is heavy, b's light
        d = p.choose(req(f"r{i}", SYS + seq(100 * i, 10)), ["a"], c)
        assert d.engine == "a"
    p.choose(req("x", seq(5000, 20)), ["b"], c)  # a little load on b
    d = p.choose(req("y", SYS + seq(900, 10)), ["a", "b"], c)
    assert d.kind == "rebalance" and d.engine == "b"
    off = E2Policy(E2Config(rebalance=False, replicate=False, pd_balance=False))
    for i in range(4):
        off.choose(req(f"r{i}", SYS + seq(100 * i, 10)), ["a"], c)
    assert off.choose(req("y", SYS + seq(900, 10)), ["a", "b"], c).engine == "a"


def test_hot_prefix_is_replicated_when_its_queueing_doubles():
    p = E2Policy(E2Config(rebalance=False, pd_balance=False, window_s=10, min_hot_wait_s=0.01))
    t = 0.0
    for i in range(5):  # window 1: the prefix's requests queue behind nothing
        d = p.choose(req(f"q{i}", SYS + seq(100 * i, 10)), ["a", "b"], view(now=t))
        t += 1.0
    assert d.engine == "a" and d.kind in ("explore", "exploit")
    # window 2: a has a prefill backlog (placed requests with many missed tokens) -> the queueing estimate jumps
    backlog = [PlacedRequest(f"big{i}", None, 2000, Demand(None, WorkKind.LATENCY), prompt_tokens=2000,
                             placed_at=11.0) for i in range(3)]
    kinds = []
    for i in range(6):
        c = view(placed={"a": backlog}, now=11.0 + 0.01 * i)
        p.sync(c)
        kinds.append(p.choose(req(f"h{i}", SYS + seq(1000 + 50 * i, 10)), ["a", "b"], c))
    rep = [d for d in kinds if d.kind == "replicate"]
    assert rep and rep[0].engine == "b"
    assert "b" in p.tree.match(SYS)[0][0].engines  # the prefix has a second home


def test_pd_balancing_sends_explorations_to_a_decode_heavy_engine():
    p = E2Policy(E2Config(rebalance=False, replicate=False))
    placed = [PlacedRequest(f"d{i}", None, 150, Demand(None, WorkKind.LATENCY), prompt_tokens=100, placed_at=0.0)
              for i in range(3)]
    for i in range(3):
        p._inflight[f"d{i}"] = (0, 100)  # fully cached prompts: decode units
    c = view(placed={"b": placed})
    d = p.choose(req("new", seq(7000, 300)), ["a", "b"], c)
    assert d.kind == "pd-balance" and d.engine == "b"
    p2 = E2Policy(OFF)
    assert p2.choose(req("new", seq(7000, 300)), ["a", "b"], c).engine == "a"


# ---- eviction notices -------------------------------------------------------------------------------------------
def _status(name: str, notice) -> EngineStatus:
    return EngineStatus(name, "m", 4096, 0, 0, 0, 0, 100, 0, 0, 0, 16, 0, extra={"kv_evicted": notice})


def test_eviction_notice_drops_the_node_and_its_subtree():
    p = E2Policy(OFF)
    p.sync(view(status={"a": _status("a", {"seq": 0, "hashes": []})}))  # baseline; block size now known
    toks = SYS + seq(0, 60)  # 160 tokens = 10 blocks of 16
    p.choose(req("r", toks), ["a"], view())
    path, _ = p.tree.match(toks)
    assert p.tree.cached_len(path, "a") == 160
    h = chain_hashes(toks, 16)
    # the engine evicted block 7 (tokens 112..127, inside the leaf after SYS)
    p.sync(view(status={"a": _status("a", {"seq": 1, "hashes": [h[7]]})}))
    path, _ = p.tree.match(toks)
    assert p.tree.cached_len(path, "a") == 0 or p.tree.cached_len(path, "a") < 160
    assert "a" not in path[-1].engines


def test_eviction_notice_from_a_real_block_pool():
    pool = BlockPool(4, 16)
    toks = list(range(64))
    hashes = chain_hashes(toks, 16)
    blocks = pool.allocate(4)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    pool.release(blocks)
    pool.allocate(2)  # evicts the two least recently released blocks
    assert pool.num_evicted == 2 and list(pool.evicted_log) == hashes[:2]
    p = E2Policy(OFF)
    p.sync(view(names=("a",), status={"a": _status("a", {"seq": 0, "hashes": []})}))
    p.choose(req("r", toks), ["a"], view(names=("a",)))
    p.sync(view(names=("a",), status={"a": _status("a", {"seq": pool.num_evicted, "hashes": list(pool.evicted_log)})}))
    path, _ = p.tree.match(toks)
    assert p.tree.cached_len(path, "a") == 0


def test_engine_gone_is_forgotten():
    p = E2Policy(OFF)
    p.choose(req("r", SYS), ["a", "b"], view())
    p.sync(view())
    p.sync(view(names=("b",)))
    assert "a" not in p.tree.match(SYS)[0][0].engines


# ---- baselines and plumbing --------------------------------------------------------------------------------------
def test_round_robin_cycles_by_name():
    rr = RoundRobinPolicy()
    cands = [EngineLoad(n, "m", 4096, None, 0, 0) for n in ("b", "a", "c")]
    picks = [rr.choose(DispatchRequest(f"r{i}"), cands) for i in range(5)]
    assert picks == ["a", "b", "c", "a", "b"]
    assert rr.choose(DispatchRequest("x"), cands[:2]) == "a"  # c gone: wraps


def test_policy_names_and_config():
    assert {"e2", "round-robin", "least-loaded", "parrot"} <= set(POLICY_NAMES)
    assert isinstance(make_policy("e2"), E2Policy)
    assert isinstance(make_policy("round-robin"), RoundRobinPolicy)
    assert isinstance(make_policy("parrot"), AppCentricWithE2)
    assert ManagerConfig(policy="e2").policy == "e2"
    with pytest.raises(ValueError):
        ManagerConfig(policy="e3")
    with pytest.raises(ValueError):
        E2Config(th_bal=0.5)
    with pytest.raises(ValueError):
        E2Config(decode_cost="free")


def test_cli_accepts_policy_e2():
    from parrot.api.settings import ServerSettings
    assert ServerSettings(policy="e2").policy == "e2"
    assert ServerSettings(policy="round-robin").policy == "round-robin"


def test_parrot_policy_sends_unstructured_requests_to_e2():
    pol = make_policy("parrot")
    assert isinstance(pol, AppCentricWithE2)
    c = view()
    q = [QueuedRequest(i, req(f"u{i}", SYS + seq(100 * i, 10)), SchedInfo(app_order=float(i)), float(i), ("a", "b"))
         for i in range(3)]
    out = pol.place(q, c)
    assert len(out) == 3 and out[0].engine == out[1].engine  # one prefix: exploited on the engine holding it
    assert pol.e2.counts == {"explore": 1, "exploit": 1, "rebalance": 1}  # the third: two in the window, b idle
    structured = QueuedRequest(9, DispatchRequest("s", session_id="s1", prompt_tokens=10, max_new_tokens=5),
                               SchedInfo(app_order=9.0), 9.0, ("a", "b"))
    assert [p.ticket for p in pol.place([structured], c)] == [9]
    assert sum(pol.e2.counts.values()) == 3  # not counted by E2
