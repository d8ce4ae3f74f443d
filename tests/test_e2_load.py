"""E2 picks among the holders of an exploited prefix by L + M + P + D, D the decoding an engine's in-flight requests
still have ahead (E2Config.current_decode): hand-built cluster states where the window history alone cannot tell
two prefix holders apart."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parrot.common.step_cost import StepCost
from parrot.manager.policies import E2Config, E2Policy
from parrot.manager.policies.base import ClusterView, Demand, DispatchRequest, EngineView, PlacedRequest, WorkKind

COST = StepCost(base_s=0.02, decode_row_s=1e-4, decode_ctx_s=1e-6, prefill_token_s=1e-3)
OFF = E2Config(rebalance=False, replicate=False, pd_balance=False)
SYS = list(range(1000, 1100))


def view(placed=None, now=0.0) -> ClusterView:
    placed = placed or {}
    return ClusterView({n: EngineView(n, "m", 4096, None, 10_000, tuple(placed.get(n, ())), step_cost=COST)
                        for n in ("a", "b")}, now=now)


def running(rid: str, prompt: int = 110, out: int = 16, at: float = 0.0) -> PlacedRequest:
    return PlacedRequest(rid, None, prompt + out, Demand(None, WorkKind.LATENCY), prompt_tokens=prompt, placed_at=at)


def req(rid: str, toks, out: int = 16) -> DispatchRequest:
    toks = tuple(toks)
    return DispatchRequest(rid, prompt_tokens=len(toks), max_new_tokens=out, prompt_token_ids=toks)


def step(ctx: float) -> float:
    return COST.base_s + COST.decode_row_s + COST.decode_ctx_s * ctx


def test_current_decode_is_the_output_left_of_in_flight_requests():
    p = E2Policy(OFF)
    p._inflight["r"] = (10, 110)  # 10 of its 110 prompt tokens missed: 10 ms of prefill before it decodes
    s = step(110 + 40 / 2)
    c0 = view({"a": [running("r", out=40)]}, now=0.0)
    p.sync(c0)
    assert p.current_decode(c0, "a") == pytest.approx(40 * s)  # nothing decoded yet
    assert p.current_decode(c0, "b") == 0.0
    later = view({"a": [running("r", out=40)]}, now=0.010 + 10 * s)
    p.sync(later)
    assert p.current_decode(later, "a") == pytest.approx(30 * s)  # prefill, then 10 tokens
    done = view({"a": [running("r", out=40)]}, now=100.0)
    p.sync(done)
    assert p.current_decode(done, "a") == 0.0
    # the marginal decode cost leaves out base_s; L stays the window history (empty here: D is not part of it)
    m = E2Policy(replace(OFF, decode_cost="marginal"))
    m.sync(c0)
    assert m.current_decode(c0, "a") == pytest.approx(40 * (s - COST.base_s))
    assert m.load(c0, "a") == 0.0


def test_current_decode_counts_base_once_for_a_batch():
    """Requests decoding together share each iteration's base_s: D = base_s x the longest + rows x their tokens."""
    p = E2Policy(OFF)
    c = view({"a": [running("x", out=40), running("y", out=10)]}, now=0.0)
    p.sync(c)
    row = lambda out: COST.decode_row_s + COST.decode_ctx_s * (110 + out / 2)  # noqa: E731
    assert p.current_decode(c, "a") == pytest.approx(40 * COST.base_s + 40 * row(40) + 10 * row(10))


def test_exploit_goes_to_the_holder_with_fewer_running_decodes():
    """Both engines hold the shared prompt and have the same window history; a is decoding three requests now.
    With D the newcomer goes to b; without it the tie goes to a by name (what the history alone does)."""
    for cfg, expect in ((OFF, "b"), (replace(OFF, current_decode=False), "a")):
        p = E2Policy(cfg)
        for e in ("a", "b"):
            p.tree.record(p.tree.insert(SYS), e, now=0.0)
        c = view({"a": [running(f"d{i}", at=0.0) for i in range(3)]}, now=0.05)
        p.sync(c)
        d = p.choose(req("new", SYS + list(range(5000, 10))), ["a", "b"], c)
        assert d.kind == "exploit" and d.engine == expect, (cfg, d)


def test_explore_and_rebalancing_keep_the_history_load():
    """D only breaks ties among prefix holders: an exploration (nothing cached) still costs L + M + P alone."""
    p = E2Policy(OFF)
    c = view({"a": [running(f"d{i}", at=0.0) for i in range(3)]}, now=0.05)
    p.sync(c)
    d = p.choose(req("new", list(range(5000, 5100))), ["a", "b"], c)
    assert d.kind == "explore" and d.engine == "a" and d.costs["a"] == pytest.approx(d.costs["b"])
