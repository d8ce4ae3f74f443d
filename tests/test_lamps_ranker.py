"""LampsRanker: score order, FCFS ties, starvation after exactly N passes, cached scores with selective refresh."""

import pytest

from parrot.engine.scheduler.lamps import LampsRanker


def ident(x):
    return x


def test_order_by_score_ties_fcfs():
    scores = {"a": 9.0, "b": 2.0, "c": 5.0, "d": 2.0}
    r = LampsRanker()
    assert r.order(["a", "b", "c", "d"], ident, scores.__getitem__) == ["b", "d", "c", "a"]
    r2 = LampsRanker()
    assert r2.order(["d", "c", "b", "a"], ident, scores.__getitem__) == ["d", "b", "c", "a"]


def test_starving_after_exactly_threshold_passes_goes_to_head():
    scores = {"a": 9.0, "b": 2.0, "c": 5.0}
    r = LampsRanker(starvation_threshold=3)
    for i in range(3):
        assert r.order(["a", "b", "c"], ident, scores.__getitem__)[0] == "b"
        assert not r.is_starving("a")
        r.after_admission(admitted=[], still_waiting=["a", "c"])
        assert r.passes("a") == i + 1
    assert r.is_starving("a") and r.is_starving("c")
    # starving ones first, in score order among themselves; then the rest
    assert r.order(["a", "b", "c"], ident, scores.__getitem__) == ["c", "a", "b"]


def test_admission_resets_counter_but_starving_keeps_priority_until_forget():
    scores = {"a": 9.0, "b": 2.0}
    r = LampsRanker(starvation_threshold=2)
    r.after_admission([], ["a"])
    r.after_admission(["a"], [])          # admitted before starving: counter back to 0
    assert r.passes("a") == 0
    r.after_admission([], ["a"])
    assert not r.is_starving("a")
    r.after_admission([], ["a"])
    assert r.is_starving("a")
    r.after_admission(["a"], [])          # admitted (and e.g. preempted later): still first
    assert r.passes("a") == 0 and r.is_starving("a")
    assert r.order(["b", "a"], ident, scores.__getitem__) == ["a", "b"]
    r.forget("a")                         # finished or paused for a tool call
    assert not r.is_starving("a") and r.passes("a") == 0
    assert r.order(["b", "a"], ident, scores.__getitem__) == ["b", "a"]


def test_refresh_interval_caches_scores():
    scores = {"a": 1.0, "b": 2.0}
    calls = []

    def score(k):
        calls.append(k)
        return scores[k]

    r = LampsRanker(refresh_interval=3)
    assert r.order(["a", "b"], ident, score) == ["a", "b"]        # call 0: refresh
    scores["a"] = 5.0
    assert r.order(["a", "b"], ident, score) == ["a", "b"]        # call 1: cached
    r.order(["a", "b", "c"], ident, lambda k: score(k) if k != "c" else calls.append(k) or 0.5)  # c new: scored
    assert calls == ["a", "b", "c"]
    assert r.order(["a", "b"], ident, score) == ["b", "a"]        # call 3: refresh sees a = 5
    assert calls == ["a", "b", "c", "a", "b"]
    assert r.num_scored == 5


def test_every_call_refreshes_by_default():
    scores = {"a": 1.0, "b": 2.0}
    r = LampsRanker()
    assert r.order(["a", "b"], ident, scores.__getitem__) == ["a", "b"]
    scores["a"] = 3.0
    assert r.order(["a", "b"], ident, scores.__getitem__) == ["b", "a"]


def test_key_function_and_validation():
    items = [("x", 3), ("y", 1)]
    r = LampsRanker()
    assert r.order(items, key=lambda t: t[0], score=lambda t: t[1]) == [("y", 1), ("x", 3)]
    with pytest.raises(ValueError):
        LampsRanker(starvation_threshold=0)
    with pytest.raises(ValueError):
        LampsRanker(refresh_interval=0)
