"""Prefix sharing in the manager (paper §5.3, §8.3, §8.4) on the fake engine: one prefix fill + forks for a
shared system prompt and for a generated document, identical outputs with sharing off, lifetime (grace, LRU,
session delete, cross-session), failure fallback, engine affinity, and the stats route."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from parrot.api import ServerSettings, create_app
from parrot.common.errors import StepFailed
from parrot.manager import DispatchRequest, EngineLoad, EngineRegistry, LeastLoadedPolicy, Manager, ManagerConfig
from parrot.manager.graph import RequestStatus
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from fakes import BOS, TAIL, FakeEngine

SYS = ("You are Parrot, a helpful assistant for a travel agency. Answer politely, in one short sentence, "
       "and never invent prices.\n")
TEMPLATE = SYS + "Q: {{input:q}}\nA: {{output:a}}"
# the text before the first input, shared by all; its trailing space moves onto the input value (BPE attaches a
# word's leading space to the word, see executor._moved_spaces)
PREFIX_TOKENS = [BOS] + FakeEngine.encode(SYS + "Q:")
QUERIES = [f"question number {i}?" for i in range(8)]


def run(body, engine=None, *, now=None, **config):
    """Run ``body(manager, engine)`` on a fresh manager (fake clock ``now[0]`` if given); always stop it."""
    engine = engine or FakeEngine()

    async def main():
        kw = {"clock": lambda: now[0]} if now is not None else {}
        mgr = Manager(EngineRegistry([engine]), config=ManagerConfig(engine_heartbeat_s=0, **config), **kw)
        await mgr.start()
        try:
            return await asyncio.wait_for(body(mgr, engine), 20)
        finally:
            await mgr.stop()

    return asyncio.run(main())


def out(name, **sampling):
    return PlaceholderSpec(name, True, None, sampling or None)


def inp(name, var_id):
    return PlaceholderSpec(name, False, var_id)


def submit_queries(mgr, session, queries=QUERIES, template=TEMPLATE):
    reqs = []
    for q in queries:
        v = mgr.create_variable(session, "q", q)
        reqs.append(mgr.submit(session, SubmitSpec(template, [inp("q", v.var_id), out("a")])))
    return reqs


async def answers(mgr, session, reqs):
    return [(await mgr.get_variable(session, r.outputs[0], timeout_s=10)).value for r in reqs]


def prefix_fills(eng):
    return [c for c in eng.calls_of("fill") if c[1].startswith("prefix-")]


def test_shared_system_prompt_is_filled_once_and_forked_by_every_request():
    now = [1000.0]

    async def body(mgr, eng):
        s = mgr.create_session()
        reqs = submit_queries(mgr, s)
        values = await answers(mgr, s, reqs)
        await asyncio.sleep(0)
        alive_after_finish = set(eng.contexts)
        collected_early = await mgr.sharing.collect()  # within the grace period: kept for later sharers
        now[0] += 31
        collected = await mgr.sharing.collect()
        return values, reqs, alive_after_finish, collected_early, collected, mgr.stats(), mgr.dag(s)

    eng = FakeEngine()
    values, reqs, alive, early, collected, stats, dag = run(body, eng, now=now)
    (fill,) = prefix_fills(eng)
    pid = fill[1]
    assert fill[2] is None and fill[3] == PREFIX_TOKENS  # exactly the request's own segment-wise tokens
    forks = eng.forks()
    assert len(forks) == 8 and {f[2] for f in forks} == {pid}
    query_of = {r.context_id: q for r, q in zip(reqs, QUERIES)}
    assert {f[1] for f in forks} == set(query_of)
    assert all(f[3] == FakeEngine.encode(" " + query_of[f[1]] + "\nA:") for f in forks)  # only the rest is filled
    assert values == [FakeEngine.reply_for(SYS + f"Q: {q}\nA:") + TAIL for q in QUERIES]
    assert all(r.status is RequestStatus.FINISHED and r.prefix_context == pid
               and r.num_shared_tokens == len(PREFIX_TOKENS) for r in reqs)
    assert alive == {pid} and early == 0  # children freed, prefix context kept during the grace period
    assert collected == 1 and eng.contexts == {} and pid in eng.freed
    n = len(PREFIX_TOKENS)
    assert stats["prefix_sharing"] == {
        "enabled": True, "live_contexts": 0, "contexts_created": 1, "contexts_freed": 1, "fill_failures": 0,
        "forks": 8, "tokens_shared": 8 * n, "tokens_prefilled": n, "tokens_saved": 7 * n}
    assert all(r["prefix_context"] == pid and r["num_shared_tokens"] == n for r in dag.requests)
    assert f"prefix {pid} ({n} tok)" in dag.text


def test_sharing_off_never_passes_a_parent_and_gives_the_same_outputs():
    async def body(mgr, eng):
        s = mgr.create_session()
        reqs = submit_queries(mgr, s)
        return await answers(mgr, s, reqs), reqs, mgr.stats()

    on_eng, off_eng = FakeEngine(), FakeEngine()
    on_values, on_reqs, _ = run(body, on_eng)
    off_values, off_reqs, stats = run(body, off_eng, prefix_sharing=False)
    assert off_values == on_values
    assert all(c[2] is None for c in off_eng.calls) and not prefix_fills(off_eng)
    assert all(r.prefix_context is None and r.num_shared_tokens == 0 for r in off_reqs)
    assert stats["prefix_sharing"]["enabled"] is False and stats["prefix_sharing"]["forks"] == 0
    # token identity: prefix context + the fork's fill == the whole unshared fill, request by request
    off_fill = {c[1]: c[3] for c in off_eng.calls_of("fill")}
    on_fork = {c[1]: c[3] for c in on_eng.forks()}
    assert len(off_fill) == len(on_fork) == 8
    for on_r, off_r in zip(on_reqs, off_reqs):
        assert off_fill[off_r.context_id] == PREFIX_TOKENS + on_fork[on_r.context_id]


def test_session_delete_frees_the_prefix_context_before_the_grace_period():
    async def body(mgr, eng):
        s = mgr.create_session()
        await answers(mgr, s, submit_queries(mgr, s, QUERIES[:3]))
        held = set(eng.contexts)
        await mgr.delete_session(s)
        return held

    eng = FakeEngine()
    held = run(body, eng)
    (fill,) = prefix_fills(eng)
    assert held == {fill[1]} and eng.contexts == {} and fill[1] in eng.freed


def test_generated_document_is_shared_by_its_consumers():
    """§8.4: A writes `doc`; B1..B4 start with {{input:doc}}: they become ready together, and the prefix
    context holds doc's tokens (the hash covers the materialized value)."""

    async def body(mgr, eng):
        eng.gate = asyncio.Event()  # hold A's generation until every consumer is submitted
        s = mgr.create_session()
        task = mgr.create_variable(s, "task", "a snake game")
        a = mgr.submit(s, SubmitSpec("Design document for {{input:task}}:\n{{output:doc}}",
                                     [inp("task", task.var_id), out("doc", max_tokens=64)]))
        bs = []
        for i in range(4):
            part = mgr.create_variable(s, "part", f"module {i}")
            bs.append(mgr.submit(s, SubmitSpec("{{input:doc}}\nReview the code of {{input:part}}. {{output:r}}",
                                               [inp("doc", a.outputs[0]), inp("part", part.var_id), out("r")])))
        await asyncio.sleep(0.01)
        eng.gate.set()
        doc = (await mgr.get_variable(s, a.outputs[0], timeout_s=10)).value
        values = await answers(mgr, s, bs)
        # a consumer submitted later, alone, still finds the prefix context (kept during the grace period)
        part = mgr.create_variable(s, "part", "module 9")
        late = mgr.submit(s, SubmitSpec("{{input:doc}}\nReview the code of {{input:part}}. {{output:r}}",
                                        [inp("doc", a.outputs[0]), inp("part", part.var_id), out("r")]))
        await answers(mgr, s, [late])
        return doc, values, bs + [late]

    eng = FakeEngine()
    doc, values, bs = run(body, eng)
    (fill,) = prefix_fills(eng)
    assert fill[3] == [BOS] + FakeEngine.encode(doc) + FakeEngine.encode("\nReview the code of")
    assert len(eng.forks()) == 5 and {f[2] for f in eng.forks()} == {fill[1]}
    assert values == [FakeEngine.reply_for(f"{doc}\nReview the code of module {i}.") + TAIL
                      for i in range(4)]
    assert all(b.prefix_context == fill[1] for b in bs)


def test_prefix_contexts_are_shared_across_sessions_and_freed_when_all_are_gone():
    async def body(mgr, eng):
        eng.gate = asyncio.Event()
        s1, s2 = mgr.create_session(), mgr.create_session()
        r1 = submit_queries(mgr, s1, QUERIES[:2])
        r2 = submit_queries(mgr, s2, QUERIES[2:4])
        await asyncio.sleep(0.01)
        eng.gate.set()
        await answers(mgr, s1, r1)
        await answers(mgr, s2, r2)
        await mgr.delete_session(s1)
        after_first = set(eng.contexts)
        await mgr.delete_session(s2)
        return after_first, r1 + r2

    eng = FakeEngine()
    after_first, reqs = run(body, eng)
    (fill,) = prefix_fills(eng)
    assert {r.prefix_context for r in reqs} == {fill[1]}
    assert after_first == {fill[1]}  # still used by the other session
    assert eng.contexts == {}


@pytest.mark.parametrize("max_model_len, cause", [(512, None), (60, "context_length_exceeded")])
def test_failed_prefix_fill_falls_back_to_unshared_or_fails_typed(max_model_len, cause):
    async def body(mgr, eng):
        eng.fill_gate = asyncio.Event()  # every request plans while the prefix fill is in flight
        if cause is None:
            eng.fail_fill_when = "prefix-"
        s = mgr.create_session()
        reqs = submit_queries(mgr, s)
        await asyncio.sleep(0.01)
        eng.fill_gate.set()
        results = []
        for r in reqs:
            try:
                results.append((await mgr.get_variable(s, r.outputs[0], timeout_s=10)).value)
            except StepFailed as e:
                results.append(e)
        return results, reqs, mgr.stats()

    eng = FakeEngine(max_model_len=max_model_len)
    results, reqs, stats = run(body, eng)
    assert len(prefix_fills(eng)) == 1 and stats["prefix_sharing"]["fill_failures"] == 1
    assert eng.forks() == [] and all(r.prefix_context is None for r in reqs)
    if cause is None:  # every sharer completed unshared, with the unshared answer
        assert results == [FakeEngine.reply_for(SYS + f"Q: {q}\nA:") + TAIL for q in QUERIES]
    else:  # the prompt is too long anyway: every request fails with the typed cause, as it would unshared
        assert all(isinstance(e, StepFailed) and e.cause_code == cause for e in results)
    assert eng.contexts == {}


def test_no_prefix_context_for_a_single_request_or_a_short_prefix():
    async def body(mgr, eng):
        s = mgr.create_session()
        await answers(mgr, s, submit_queries(mgr, s, QUERIES[:1]))
        await answers(mgr, s, submit_queries(mgr, s, QUERIES[:4], template="Q: {{input:q}}\nA: {{output:a}}"))

    eng = FakeEngine()
    run(body, eng)
    assert prefix_fills(eng) == [] and eng.forks() == []


def test_lru_bound_evicts_an_idle_prefix_context_for_a_new_one():
    async def body(mgr, eng):
        s = mgr.create_session()
        await answers(mgr, s, submit_queries(mgr, s, QUERIES[:2]))
        first = set(eng.contexts)
        await answers(mgr, s, submit_queries(mgr, s, QUERIES[:2], template="Other long preamble text. " + TEMPLATE))
        await asyncio.sleep(0)
        return first, set(eng.contexts)

    eng = FakeEngine()
    first, second = run(body, eng, max_prefix_contexts_per_engine=1)
    p1, p2 = (c[1] for c in prefix_fills(eng))
    assert first == {p1} and second == {p2} and p1 in eng.freed


def test_engine_that_lost_the_prefix_context_falls_back_and_a_restarted_engine_is_not_forked_from():
    async def body(mgr, eng):
        s = mgr.create_session()
        await answers(mgr, s, submit_queries(mgr, s, QUERIES[:2]))
        (pid,) = eng.contexts
        del eng.contexts[pid]  # the engine lost it behind the manager's back
        lost = await answers(mgr, s, submit_queries(mgr, s, QUERIES[2:4]))
        after_lost = mgr.stats()["prefix_sharing"]
        # the engine restarts: a new client registers under the same name
        new = FakeEngine()
        await mgr.registry.probe(mgr.registry.register(new))
        await mgr.sharing.collect()
        restarted = await answers(mgr, s, submit_queries(mgr, s, QUERIES[4:6]))
        return pid, lost, after_lost, new, restarted

    eng = FakeEngine()
    pid, lost, after_lost, new, restarted = run(body, eng)
    assert lost == [FakeEngine.reply_for(SYS + f"Q: {q}\nA:") + TAIL for q in QUERIES[2:4]]
    assert restarted == [FakeEngine.reply_for(SYS + f"Q: {q}\nA:") + TAIL for q in QUERIES[4:6]]
    assert all(f[2] == pid for f in eng.forks())  # the failed fork attempts named the lost context ...
    assert after_lost["forks"] == 2  # ... and only the first two requests count as forks
    (new_fill,) = prefix_fills(new)
    assert {f[2] for f in new.forks()} == {new_fill[1]} and new_fill[1] != pid
    assert all(c[2] in (None, new_fill[1]) for c in new.calls)


def test_dispatch_keeps_sharers_on_the_engine_holding_the_prefix():
    async def body(mgr, eng):
        s = mgr.create_session()
        reqs = submit_queries(mgr, s, QUERIES[:4])
        await answers(mgr, s, reqs)
        return reqs

    e0, e1 = FakeEngine("e0"), FakeEngine("e1")

    async def main():
        mgr = Manager(EngineRegistry([e0, e1]), config=ManagerConfig(engine_heartbeat_s=0))
        await mgr.start()
        try:
            return await asyncio.wait_for(body(mgr, e0), 20)
        finally:
            await mgr.stop()

    reqs = asyncio.run(main())
    assert {r.engine for r in reqs} == {"e0"} and len(prefix_fills(e0)) == 1 and len(e0.forks()) == 4
    assert e1.calls == []


def test_affinity_policy_respects_its_slack():
    def load(name, inflight, prefix):
        return EngineLoad(name, "m", 512, None, inflight, 0, prefix_tokens=prefix)

    req = DispatchRequest("r", prefix_hashes=("h",))
    policy = LeastLoadedPolicy(affinity_slack=2)
    assert policy.choose(req, [load("a", 3, 0), load("b", 1, 40)]) == "b"
    assert policy.choose(req, [load("a", 0, 0), load("b", 2, 40), load("c", 2, 80)]) == "c"
    assert policy.choose(req, [load("a", 0, 0), load("b", 3, 40)]) == "a"  # beyond the slack: least loaded
    assert LeastLoadedPolicy(prefix_affinity=False).choose(req, [load("a", 0, 0), load("b", 0, 40)]) == "a"


def test_stats_route_and_settings_switch(monkeypatch):
    monkeypatch.setenv("PARROT_PREFIX_SHARING", "false")
    assert ServerSettings().manager_config().prefix_sharing is False
    monkeypatch.delenv("PARROT_PREFIX_SHARING")
    assert ServerSettings().manager_config().sharing_config().enabled is True
    eng = FakeEngine()
    app = create_app(ServerSettings(engine_heartbeat_s=0, prefix_sharing=False), [eng])
    with TestClient(app) as c:
        body = c.get("/api/v1/stats").json()
    assert body["prefix_sharing"]["enabled"] is False and body["sessions"] == 0
    with pytest.raises(ValueError, match="prefix_min_tokens"):
        ServerSettings(prefix_min_tokens=0)
    with pytest.raises(ValueError, match="prefix_grace_s"):
        ManagerConfig(prefix_grace_s=-1)


# ---- the real engine ---------------------------------------------------------------------------------------------
REAL_SYS = ("You are the support assistant of the Parrot Hotel in Lisbon. The hotel has 120 rooms, a rooftop pool "
            "open from 8 am to 10 pm, a restaurant serving Portuguese food, free wifi in every room, and a gym in "
            "the basement. Breakfast is served from 7 am to 11 am. Check-in starts at 3 pm and check-out is at "
            "noon. Pets are welcome for a fee of 20 euros per night. The nearest metro station is Baixa-Chiado, "
            "five minutes on foot. Parking costs 25 euros per day and must be booked in advance. Guests can rent "
            "bicycles at the front desk. The spa offers massages every afternoon. Always answer in one short, "
            "friendly sentence, and never invent facts that are not listed above.\n")


@pytest.mark.model
def test_real_engine_outputs_identical_with_sharing_and_fewer_tokens_computed():
    from parrot.common.errors import ModelNotFound
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.files.model_files import default_model_path
    from parrot.engine.settings import EngineSettings

    try:
        path = default_model_path()
    except ModelNotFound as e:
        pytest.skip(str(e))
    questions = ["When is breakfast?", "Can I bring my dog?", "Is there a pool?", "Where can I park?"]
    template = REAL_SYS + "Guest: {{input:q}}\nAssistant: {{output:a}}"
    sampling = {"max_tokens": 12, "temperature": 0.0, "stop": ["\n"]}

    async def main():
        # fp32 for stable greedy ties; the engine's own prefix cache off, so only the manager's forks share KV
        client = build_local_engine_client(EngineSettings(
            model=path, dtype="float32", weight_quant="none", kv_cache_tokens=4096, max_model_len=1024,
            max_batch_tokens=512, enable_prefix_cache=False))
        try:
            results = {}
            for sharing in (False, True):
                mgr = Manager(EngineRegistry([client]),
                              config=ManagerConfig(engine_heartbeat_s=0, prefix_sharing=sharing))
                await mgr.start()
                try:
                    before = (await client.status()).extra["tokens_computed"]
                    s = mgr.create_session()
                    reqs = []
                    for q in questions:
                        v = mgr.create_variable(s, "q", q)
                        reqs.append(mgr.submit(s, SubmitSpec(template, [inp("q", v.var_id), out("a", **sampling)])))
                    shared_seen = 0
                    while not all(r.status in (RequestStatus.FINISHED, RequestStatus.FAILED) for r in reqs):
                        shared_seen = max(shared_seen, (await client.status()).kv_blocks_shared)
                        await asyncio.sleep(0.005)
                    values = await answers(mgr, s, reqs)
                    await asyncio.sleep(0.05)  # the engine publishes its status after each loop turn
                    computed = (await client.status()).extra["tokens_computed"] - before
                    results[sharing] = (values, computed, shared_seen, reqs, mgr.stats()["prefix_sharing"])
                finally:
                    await mgr.stop()
            return results, (await client.status()).num_contexts
        finally:
            await client.close()

    results, contexts_left = asyncio.run(asyncio.wait_for(main(), 120))
    off_values, off_computed, _, _, _ = results[False]
    on_values, on_computed, shared_seen, on_reqs, stats = results[True]
    assert all(v.strip() for v in off_values)
    assert on_values == off_values  # greedy: identical token ids in, identical answers out
    n_prefix = on_reqs[0].num_shared_tokens
    assert n_prefix >= 150 and all(r.num_shared_tokens == n_prefix for r in on_reqs)
    assert stats["forks"] == 4 and stats["contexts_created"] == 1
    assert shared_seen > 0 or on_computed < off_computed
    assert off_computed - on_computed >= 2 * n_prefix  # 4 prompts of the prefix computed once instead of 4 times
    assert contexts_left == 0
