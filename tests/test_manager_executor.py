"""Graph executor on the fake engine: ordering of outputs, server-side dataflow, failure propagation,
PrefixHash bookkeeping, context lifetime."""

from __future__ import annotations

import asyncio
import time

import pytest

from parrot.common.errors import StepFailed
from parrot.manager import EngineRegistry, Manager, ManagerConfig
from parrot.manager.graph import RequestStatus, VarStatus
from parrot.manager.prefix_store import prefix_hashes
from parrot.manager.submit import PlaceholderSpec, SubmitSpec
from parrot.sim.vloop import run_virtual
from fakes import BOS, TAIL, FakeEngine


def run(coro_fn, engine: FakeEngine | None = None, *, virtual: bool = False, **config):
    """Run ``coro_fn(manager, engine)`` on a fresh manager with a fake engine; always stop the manager.

    ``virtual``: on the simulator's virtual loop (:mod:`parrot.sim.vloop`), whose clock (also the manager's)
    moves only when every task is blocked, straight to the next timer: ``asyncio.sleep`` returns only once
    the manager is idle, and elapsed loop time counts timers that ran out, not the machine's speed."""
    engine = engine or FakeEngine()

    async def main():
        clock_kw = {"clock": asyncio.get_running_loop().time} if virtual else {}
        mgr = Manager(EngineRegistry([engine], **clock_kw), config=ManagerConfig(engine_heartbeat_s=0, **config),
                      **clock_kw)
        await mgr.start()
        try:
            return await asyncio.wait_for(coro_fn(mgr, engine), 20)
        finally:
            await mgr.stop()

    return run_virtual(main()) if virtual else asyncio.run(main())


def out(name, var_id=None, **sampling):
    return PlaceholderSpec(name, True, var_id, sampling or None)


def inp(name, var_id):
    return PlaceholderSpec(name, False, var_id)


def test_two_outputs_generated_in_order_in_one_context():
    async def body(mgr, eng):
        s = mgr.create_session()
        a = mgr.create_variable(s, "a", "hi")
        req = mgr.submit(s, SubmitSpec("A: {{input:a}}\nB: {{output:b}}\nC: {{output:c}}",
                                       [inp("a", a.var_id), out("b"), out("c")]))
        c = await mgr.get_variable(s, req.outputs[1], timeout_s=5)
        b = await mgr.get_variable(s, req.outputs[0])
        return req, b, c

    eng = FakeEngine()
    req, b, c = run(body, eng)
    # the space before each output is left for the model to generate (BPE attaches it to the next word)
    expected_b = FakeEngine.reply_for("A: hi\nB:")  # default stop "\n" ends b at the reply
    assert b.value == expected_b
    assert c.value == FakeEngine.reply_for("A: hi\nB:" + expected_b + "\nC:") + TAIL  # c saw b's text
    kinds = [call[0] for call in eng.calls]
    assert kinds == ["fill", "generate", "fill", "generate", "free"]
    assert eng.calls[1][3].stop == ("\n",) and eng.calls[3][3].stop == ()
    assert eng.calls[0][3][0] == 1  # BOS once, at the start
    assert eng.contexts == {} and eng.freed == [req.context_id]
    assert req.status is RequestStatus.FINISHED
    t = req.times
    assert t.submitted <= t.dispatched <= t.first_token <= t.finished


def test_spaces_before_a_placeholder_move_onto_it_and_other_whitespace_stays():
    """BPE attaches a word's leading space to the word: the spaces ending a text piece right before a
    placeholder lead an input's value, and before an output they are left for the model to generate (and
    stripped from the value). Newlines, tabs and spaces followed by a newline stay in their piece."""
    template = "Topic: {{input:t}}\nNotes: \n{{input:n}}\nTitle: {{output:x}}\nTab:\t{{output:y}}"
    pieces = ["Topic:", " parrots", "\nNotes: \n", "loud", "\nTitle:"]  # the head, tokenized piece by piece
    ctx1 = "".join(pieces)

    async def body(mgr, eng):
        eng.reply_lead = " "  # like a real model: the first generated token carries the space
        eng.gate = asyncio.Event()
        s = mgr.create_session()
        t, n = mgr.create_variable(s, "t", "parrots"), mgr.create_variable(s, "n", "loud")
        r = mgr.submit(s, SubmitSpec(template, [inp("t", t.var_id), inp("n", n.var_id), out("x"), out("y")]))
        queued = mgr.prefix_store.lookup(prefix_hashes(pieces)[-1]).queued  # hashed at queue time
        await asyncio.sleep(0.05)  # (virtual: returns once idle) running: filled, blocked in the first generate
        assert eng.generating == 1
        running = mgr.prefix_store.lookup(prefix_hashes(pieces)[-1])  # hashed at run time
        eng.gate.set()
        x = await mgr.get_variable(s, r.outputs[0], timeout_s=5)
        y = await mgr.get_variable(s, r.outputs[1], timeout_s=5)
        return f"{s.session_id}/{r.request_id}", queued, running, x.value, y.value, r

    eng = FakeEngine()
    key, queued, running, x, y, r = run(body, eng, virtual=True)
    assert eng.tokenized == pieces + ["\nTab:\t"]
    assert [c[0] for c in eng.calls] == ["fill", "generate", "fill", "generate", "free"]
    assert eng.calls[0][3] == [BOS] + FakeEngine.encode(ctx1)  # " parrots" in the same fill, no lone space
    assert queued == {key} and {(c.context_id, c.num_tokens) for c in running.contexts} == {
        (r.context_id, 1 + len(ctx1))}
    # x is generated from a context ending in "Title:"; the model's " " is in the context, not in the value
    assert x == FakeEngine.reply_for(ctx1) and not x.startswith(" ")
    assert eng.calls[2][3] == FakeEngine.encode("\nTab:\t")  # the tab is filled, not moved
    # y follows a tab: nothing was moved, so the generated leading space stays in its value
    assert y == " " + FakeEngine.reply_for(ctx1 + " " + x + "\nTab:\t") + TAIL


def test_dependent_request_runs_server_side_before_client_fetch():
    async def body(mgr, eng):
        s = mgr.create_session()
        task = mgr.create_variable(s, "task", "snake")
        r1 = mgr.submit(s, SubmitSpec("Code of {{input:task}}: {{output:code}}\nmore",
                                      [inp("task", task.var_id), out("code")], name="write_code"))
        code = r1.outputs[0]
        r2 = mgr.submit(s, SubmitSpec("Test {{input:task}} {{input:code}}: {{output:test}}",
                                      [inp("task", task.var_id), inp("code", code), out("test")],
                                      name="write_test"))
        test = await mgr.get_variable(s, r2.outputs[0], timeout_s=5)
        fetched_code_at = time.time()
        code_view = await mgr.get_variable(s, code)
        return r1, r2, test, code_view, fetched_code_at, mgr.dag(s)

    r1, r2, test, code, fetched_at, dag = run(body)
    # trailing spaces before a placeholder move onto it: "Code of snake:" is generated from, and the space-only
    # text between the two inputs becomes the leading space of the second value
    assert code.value == FakeEngine.reply_for("Code of snake:")
    assert test.value == FakeEngine.reply_for(f"Test snake {code.value}:") + TAIL
    assert r1.times.finished <= r2.times.dispatched < fetched_at
    assert "%3 = r_2 write_test(test) <- %1, %2  [finished, engine fake0]" in dag.text


def test_first_output_starts_its_consumer_before_the_request_finishes():
    async def body(mgr, eng):
        eng.token_delay_s = 0.002
        s = mgr.create_session()
        r1 = mgr.submit(s, SubmitSpec("{{output:b}}|{{output:c}}", [out("b", max_tokens=8), out("c", max_tokens=40)]))
        r2 = mgr.submit(s, SubmitSpec("use {{input:b}} {{output:d}}",
                                      [inp("b", r1.outputs[0]), out("d", max_tokens=4)]))
        await mgr.get_variable(s, r2.outputs[0], timeout_s=5)
        await mgr.get_variable(s, r1.outputs[1], timeout_s=5)
        return r1, r2

    r1, r2 = run(body)
    assert r2.times.dispatched < r1.times.finished


def test_failure_propagates_transitively_to_every_get_including_waiting_ones():
    """On the virtual loop: the failure reaches every get, the waiting one included, without any of their
    30 s timeouts running out (no virtual time passes between the failure and the last error)."""

    async def body(mgr, eng):
        eng.gate = asyncio.Event()
        eng.fail_generate_when = "BOOM"
        s = mgr.create_session()
        x = mgr.create_variable(s, "x", "BOOM")
        r1 = mgr.submit(s, SubmitSpec("{{input:x}} {{output:y}}", [inp("x", x.var_id), out("y")]))
        r2 = mgr.submit(s, SubmitSpec("{{input:y}} {{output:z}}", [inp("y", r1.outputs[0]), out("z")]))
        r3 = mgr.submit(s, SubmitSpec("{{input:z}} {{input:x}} {{output:w}}",
                                      [inp("z", r2.outputs[0]), inp("x", x.var_id), out("w")]))
        ok = mgr.submit(s, SubmitSpec("fine {{output:k}}", [out("k")]))
        # a get that is already waiting when the failure happens
        waiting = asyncio.create_task(mgr.get_variable(s, r3.outputs[0], timeout_s=30))
        await asyncio.sleep(0.05)  # (virtual: returns once idle)
        assert not waiting.done() and r1.status is RequestStatus.RUNNING
        loop = asyncio.get_running_loop()
        started = loop.time()
        eng.gate.set()
        errors = []
        for vid in (r1.outputs[0], r2.outputs[0]):
            with pytest.raises(StepFailed) as e:
                await mgr.get_variable(s, vid, timeout_s=30)
            errors.append(e.value)
        with pytest.raises(StepFailed) as e:
            await waiting
        errors.append(e.value)
        elapsed = loop.time() - started
        k = await mgr.get_variable(s, ok.outputs[0], timeout_s=5)
        return errors, elapsed, (r1, r2, r3), k, s

    eng = FakeEngine()
    errors, elapsed, reqs, k, s = run(body, eng, virtual=True)
    assert elapsed == 0  # virtual seconds: woken by the failure, no timeout ran out
    assert all(e.cause_code == "engine_error" and e.status_code == 424 for e in errors)
    assert "r_1" in errors[0].message and "fake engine failure" in errors[0].message
    assert "r_3" in errors[2].message and "'z'" in errors[2].message and "fake engine failure" in errors[2].message
    assert [r.status for r in reqs] == [RequestStatus.FAILED] * 3
    assert k.status is VarStatus.READY
    assert len(eng.calls_of("generate")) == 2  # r_2 and r_3 never reached the engine
    assert eng.contexts == {}
    assert "%4 = r_3 gen(w) <- %3, %1  [failed, error engine_error]" in s.graph.dump_text()


@pytest.mark.parametrize("engine_kwargs, prompt, sampling, transforms, cause", [
    ({}, "x {{output:y}}", {}, [{"op": "regex", "pattern": "zzz"}], "transform_failed"),
    ({"max_model_len": 16}, "a long prompt beyond the window {{output:y}}", {}, [], "context_length_exceeded"),
])
def test_step_failure_causes(engine_kwargs, prompt, sampling, transforms, cause):
    async def body(mgr, eng):
        s = mgr.create_session()
        r = mgr.submit(s, SubmitSpec(prompt, [PlaceholderSpec("y", True, None, sampling, transforms)]))
        dep = mgr.submit(s, SubmitSpec("{{input:y}}{{output:z}}", [inp("y", r.outputs[0]), out("z")]))
        with pytest.raises(StepFailed) as e1:
            await mgr.get_variable(s, r.outputs[0], timeout_s=5)
        with pytest.raises(StepFailed) as e2:
            await mgr.get_variable(s, dep.outputs[0], timeout_s=5)
        return e1.value, e2.value

    eng = FakeEngine(**engine_kwargs)
    e1, e2 = run(body, eng)
    assert e1.cause_code == cause and e2.cause_code == cause
    assert eng.contexts == {}


def test_prefix_hashes_recorded_for_queue_and_contexts():
    async def body(mgr, eng):
        s = mgr.create_session()
        x = mgr.create_variable(s, "x")
        r = mgr.submit(s, SubmitSpec("SYS {{input:x}} Q {{output:y}}", [inp("x", x.var_id), out("y")]))
        pieces = ["SYS", " val", " Q"]  # the space before each placeholder is part of the piece after it
        h_before_x, h_before_y = prefix_hashes(pieces)[0], prefix_hashes(pieces)[2]
        key = f"{s.session_id}/{r.request_id}"
        queued = mgr.prefix_store.lookup(h_before_x).queued
        eng.gate = asyncio.Event()
        mgr.set_variable(s, x.var_id, "val")
        await asyncio.sleep(0.05)  # (virtual: returns once idle) running: filled, blocked in generate
        assert eng.generating == 1
        running = (mgr.prefix_store.lookup(h_before_x), mgr.prefix_store.lookup(h_before_y))
        eng.gate.set()
        await mgr.get_variable(s, r.outputs[0], timeout_s=5)
        after = mgr.prefix_store.lookup(h_before_y)
        return key, queued, running, after, r

    key, queued, (at_x, at_y), after, r = run(body, virtual=True)
    assert queued == {key}
    assert at_x.queued == frozenset() and {(c.context_id, c.num_tokens) for c in at_x.contexts} == {(r.context_id, 1 + len("SYS"))}
    assert {(c.engine, c.num_tokens) for c in at_y.contexts} == {("fake0", 1 + len("SYS val Q"))}
    assert after.contexts == frozenset()  # freed with the context


def test_long_poll_pending_then_ready_and_criteria_recorded():
    """On the virtual loop: a long-poll of a pending variable answers PENDING when its 0.2 s run out (not
    earlier), and a waiting one returns at the set, not at its 10 s timeout."""

    async def body(mgr, eng):
        loop = asyncio.get_running_loop()
        s = mgr.create_session()
        v = mgr.create_variable(s, "v")
        t0 = loop.time()
        pending = await mgr.get_variable(s, v.var_id, criteria="latency", timeout_s=0.2)
        waited = loop.time() - t0
        perf = s.graph.get_perf_obj(v.var_id)
        later = asyncio.create_task(mgr.get_variable(s, v.var_id, timeout_s=10))
        await asyncio.sleep(0.02)
        mgr.set_variable(s, v.var_id, "now")
        t1 = loop.time()
        ready = await later
        return pending, waited, perf, ready, loop.time() - t1

    pending, waited, perf, ready, wake = run(body, virtual=True)
    assert pending.status is VarStatus.PENDING and pending.value is None and waited == pytest.approx(0.2)
    assert perf.value == "latency"
    assert ready.value == "now" and wake == 0  # virtual seconds: woken by the event, not by the timeout
