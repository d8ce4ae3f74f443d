"""INFERCEPT waste (eq. 1-3), handling choice and LAMPS' memory-over-time score, against hand-computed values."""

import pytest

from parrot.engine.scheduler.policies import EnginePolicyConfig, make_engine_policy
from parrot.engine.scheduler.tool_handling import FixedCosts, Handling, choose_handling, memory_time, waste

# recompute 1 ms/token, copy 0.4 ms/token + 5 ms per transfer, decode step 20 ms
COSTS = FixedCosts(fwd_per_token_s=0.001, swap_per_token_s=0.0004, decode_step_s=0.02, swap_base_s=0.005)


def w(h, c, other, t):
    return waste(h, context_tokens=c, other_tokens=other, batch_tokens=c + other, tool_s=t, costs=COSTS)


def test_waste_hand_values():
    # C = 100, C_other = 300, T = 2 s
    assert w(Handling.PRESERVE, 100, 300, 2.0) == pytest.approx(200.0)           # 2 * 100
    assert w(Handling.DISCARD, 100, 300, 2.0) == pytest.approx(40.0)             # 0.1*100 + 0.1*300
    assert w(Handling.SWAP, 100, 300, 2.0) == pytest.approx(36.0)                # 2 * (0.005+0.04) * 400
    # the batch's other contexts matter for discard/swap only
    assert w(Handling.PRESERVE, 100, 0, 2.0) == pytest.approx(200.0)
    assert w(Handling.DISCARD, 100, 0, 2.0) == pytest.approx(10.0)
    assert w(Handling.SWAP, 100, 0, 2.0) == pytest.approx(9.0)


def test_waste_rejects_negative():
    with pytest.raises(ValueError):
        w(Handling.PRESERVE, -1, 0, 1.0)
    with pytest.raises(ValueError):
        w(Handling.PRESERVE, 1, 0, -1.0)


def choose(c, other, t, **kw):
    return choose_handling(context_tokens=c, other_tokens=other, batch_tokens=c + other, tool_s=t, costs=COSTS, **kw)


def test_short_tool_preserves_whatever_the_context():
    # math tool, 1 ms: preserve 0.5 vs discard 0.5*2000 = 1000 vs swap 2*0.205*2000 = 820
    assert choose(500, 1500, 0.001) is Handling.PRESERVE
    assert choose(20, 1000, 0.001) is Handling.PRESERVE  # 0.02 vs 20.4 vs 26.52


def test_long_tool_short_context_discards():
    # 10 s image tool, C = 20: preserve 200, discard 0.02*1020 = 20.4, swap 2*(0.005+0.008)*1020 = 26.52
    assert choose(20, 1000, 10.0) is Handling.DISCARD


def test_long_tool_long_context_swaps():
    # C = 2000: preserve 20000, discard 2.0*3000 = 6000, swap 2*(0.005+0.8)*3000 = 4830
    assert choose(2000, 1000, 10.0) is Handling.SWAP


def test_medium_tool_crossover_in_tool_duration():
    # C = 200, other 800: discard 0.2*1000 = 200, swap 2*0.085*1000 = 170 -> preserve iff 200*T < 170
    assert choose(200, 800, 0.8) is Handling.PRESERVE   # 160
    assert choose(200, 800, 0.9) is Handling.SWAP       # 180


def test_allowed_restricts_and_ties_prefer_preserve_then_swap():
    assert choose(2000, 1000, 10.0, allowed=(Handling.PRESERVE, Handling.DISCARD)) is Handling.DISCARD
    flat = FixedCosts(fwd_per_token_s=0.002, swap_per_token_s=0.001, decode_step_s=0.02)
    # C=10, other 0: preserve T*10, discard 0.02*10 = 0.2, swap 2*0.01*10 = 0.2
    args = dict(context_tokens=10, other_tokens=0, batch_tokens=10, costs=flat)
    assert choose_handling(tool_s=0.02, **args) is Handling.PRESERVE   # three-way tie at 0.2
    assert choose_handling(tool_s=1.0, **args) is Handling.SWAP        # swap == discard: swap first
    with pytest.raises(ValueError):
        choose_handling(tool_s=1.0, allowed=(), **args)


MT = FixedCosts(fwd_per_token_s=0.001, swap_per_token_s=0.0004, decode_step_s=0.02)


def mt(**kw):
    return memory_time(prompt_tokens=10, output_tokens=4, costs=MT, **kw)


def test_memory_time_without_tool_is_prefill_plus_growth():
    # prefill 0.01 s * 10 tokens = 0.1; decode steps hold 11, 12, 13, 14 tokens for 0.02 s: 1.0
    assert mt(tool_s=None, handling=None) == pytest.approx(1.1)
    assert mt(tool_s=2.0, handling=None) == pytest.approx(1.1)


def test_memory_time_shapes_of_fig4():
    assert mt(tool_s=2.0, handling=Handling.PRESERVE) == pytest.approx(1.1 + 28.0)        # flat 14 x 2 s
    assert mt(tool_s=2.0, handling=Handling.DISCARD) == pytest.approx(1.1 + 0.014 * 14)   # recompute 14
    assert mt(tool_s=2.0, handling=Handling.SWAP) == pytest.approx(1.1 + 2 * 0.0056 * 14)  # out + in
    # discard/swap do not grow with the tool's duration, preserve does
    assert mt(tool_s=20.0, handling=Handling.DISCARD) == mt(tool_s=2.0, handling=Handling.DISCARD)
    assert mt(tool_s=20.0, handling=Handling.PRESERVE) > mt(tool_s=2.0, handling=Handling.PRESERVE)


def test_memory_time_post_tool_and_batch_stall():
    # post: 2 more steps holding 15, 16 tokens: 0.62
    assert mt(tool_s=2.0, handling=Handling.PRESERVE, post_tool_tokens=2) == pytest.approx(29.1 + 0.62)
    # the batch (other_tokens = 86) stalls during the 14-token recompute: + 0.014 * 86
    assert mt(tool_s=2.0, handling=Handling.DISCARD, other_tokens=86) == pytest.approx(1.296 + 1.204)
    with pytest.raises(ValueError):
        mt(tool_s=1.0, handling=Handling.SWAP, post_tool_tokens=-1)


def test_the_registry_s_tool_call_policies_order_and_handle_as_named():
    from parrot.engine.scheduler.policies.fcfs import FcfsOrder
    from parrot.engine.scheduler.policies.lamps import LampsOrder
    from parrot.engine.scheduler.policies.pauses import (DiscardPauses, LeastWastePauses, PredictedPauses,
                                                         PreservePauses)

    kinds = {"lamps": (LampsOrder, PredictedPauses), "lamps-fcfs": (FcfsOrder, PredictedPauses),
             "infercept": (FcfsOrder, LeastWastePauses), "discard": (FcfsOrder, DiscardPauses),
             "preserve": (FcfsOrder, PreservePauses), "fcfs": (FcfsOrder, PreservePauses)}
    for name, (order, handling) in kinds.items():
        pol = make_engine_policy(name)
        assert pol.name == name and isinstance(pol, order) and isinstance(pol, handling), name
    lamps = make_engine_policy("lamps")
    assert (lamps.ranker.starvation_threshold, lamps.ranker.refresh_interval) == (100, 1)
    lamps = make_engine_policy("lamps", EnginePolicyConfig(starvation_threshold=7, refresh_interval=3))
    assert (lamps.ranker.starvation_threshold, lamps.ranker.refresh_interval) == (7, 3)
    assert make_engine_policy("lamps") is not make_engine_policy("lamps")  # per engine: the ranker keeps state
    with pytest.raises(ValueError, match="infercept"):
        make_engine_policy("vllm")
    with pytest.raises(ValueError, match="starvation_threshold"):
        EnginePolicyConfig(starvation_threshold=0)


def test_cached_prompt_tokens_cost_no_prefill_time_in_the_score():
    costs = FixedCosts(fwd_per_token_s=1e-3, swap_per_token_s=1e-5, decode_step_s=0.01)
    cold = memory_time(prompt_tokens=800, output_tokens=10, tool_s=None, handling=None, costs=costs)
    warm = memory_time(prompt_tokens=800, output_tokens=10, tool_s=None, handling=None, costs=costs,
                       cached_tokens=780)
    held = memory_time(prompt_tokens=800, output_tokens=10, tool_s=None, handling=None, costs=costs,
                       cached_tokens=800)
    assert held < warm < cold
    assert cold - warm == pytest.approx((800 - 20) * 1e-3 * 800)  # the prefill area of the 780 cached tokens
